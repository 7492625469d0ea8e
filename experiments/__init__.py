"""absl entry points (forward, and later train / eval / sweep / rl)."""

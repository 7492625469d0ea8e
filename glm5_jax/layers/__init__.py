"""Building blocks shared by every attention variant and FFN: norms, RoPE, SwiGLU, param helpers."""

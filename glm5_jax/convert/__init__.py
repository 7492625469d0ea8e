"""HF GLM-5 checkpoint import (`hf.load_hf`: config in hf_config, files in hf_files, the name
mapping in hf_layout), converted checkpoints on disk, and attention-pattern conversion."""

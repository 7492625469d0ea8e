"""HF GLM-5 checkpoint import (`hf.load_hf`) and the name mapping it uses."""

"""Quantization: INT4 quantization-aware training of the routed experts (`qat.py`), the integer
formats and matmuls of quantized inference (`ops.py`), the Hadamard-based rotation folded into
the weights (`rotation.py`), and params quantized for serving or export (`serve.py`). How to
use them: docs/quantization.md. (FP8 checkpoint import is `glm5_jax.convert.hf_fp8`.)"""

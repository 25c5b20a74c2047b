"""Triton kernels (run on CPU tensors under ``TRITON_INTERPRET=1``, compile-checked for sm_90)."""

from .quantize import dequantize_mse, dequantize_turbo_block, hopper_compile, quantize_mse, quantize_turbo_block

__all__ = ["quantize_mse", "dequantize_mse", "quantize_turbo_block", "dequantize_turbo_block", "hopper_compile"]

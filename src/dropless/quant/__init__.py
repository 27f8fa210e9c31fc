"""Low-precision grouped matmuls: MX block-scaled FP8 (OCP Microscaling v1.0), emulated exactly.

`quantized_gmm(cfg)` is the one seam the MoE layer calls when `cfg.gmm_quantization != "none"`.
"""
from dropless.quant.gmm import (MXFP8Config, mxfp8_grouped_matmul, native_support,
                                quantized_gmm)
from dropless.quant.mxfp8 import (BLOCK, ELEM_FORMATS, SCALE_ROUNDINGS, GroupedMX, dequantize,
                                  dequantize_grouped, fake_quantize, fake_quantize_grouped,
                                  quantize, quantize_grouped)

__all__ = ["quantized_gmm", "MXFP8Config", "mxfp8_grouped_matmul", "native_support",
           "quantize", "dequantize", "quantize_grouped", "dequantize_grouped", "fake_quantize",
           "fake_quantize_grouped", "GroupedMX", "BLOCK", "ELEM_FORMATS", "SCALE_ROUNDINGS"]

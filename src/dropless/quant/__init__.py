"""Low-precision grouped matmuls, emulated exactly: MX block-scaled FP8 (OCP Microscaling v1.0)
and NVFP4 (E2M1 + E4M3 block scales + FP32 tensor scale, NVIDIA's pre-training recipe).

`quantized_gmm(cfg)` (MXFP8) and `nvfp4_quantized_gmm(cfg)` (NVFP4) are what the MoE layer's
precision seam (`moe.experts.gmm_for`) calls when `cfg.gmm_quantization != "none"`.
"""
from dropless.quant.gmm import (MXFP8Config, mxfp8_grouped_matmul, native_support,
                                quantized_gmm)
from dropless.quant.mxfp8 import (BLOCK, ELEM_FORMATS, SCALE_ROUNDINGS, GroupedMX, dequantize,
                                  dequantize_grouped, fake_quantize, fake_quantize_grouped,
                                  quantize, quantize_grouped)
from dropless.quant.nvfp4_gmm import NVFP4Config, nvfp4_grouped_matmul, nvfp4_quantized_gmm

__all__ = ["quantized_gmm", "MXFP8Config", "mxfp8_grouped_matmul", "native_support",
           "quantize", "dequantize", "quantize_grouped", "dequantize_grouped", "fake_quantize",
           "fake_quantize_grouped", "GroupedMX", "BLOCK", "ELEM_FORMATS", "SCALE_ROUNDINGS",
           "NVFP4Config", "nvfp4_grouped_matmul", "nvfp4_quantized_gmm"]

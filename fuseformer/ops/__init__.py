"""Fused ops. One file an op; each has a reference, Triton kernels, launchers and registration.

import fuseformer.ops as F
y, h = F.rms_norm(x, weight, eps=1e-6, residual=r)
"""

from fuseformer.ops.activations import geglu, geglu_ref, swiglu, swiglu_ref
from fuseformer.ops.attention import flash_attention, flash_attention_ref
from fuseformer.ops.cross_entropy import cross_entropy, cross_entropy_ref
from fuseformer.ops.fp8_decode import fp8_weight_gemm, fp8_weight_gemm_ref, fp8_weight_mlp, fp8_weight_mlp_ref
from fuseformer.ops.fp8_gemm import fp8_gemm, fp8_gemm_glu, fp8_gemm_glu_ref, fp8_gemm_ref
from fuseformer.ops.fused_linear_cross_entropy import fused_linear_cross_entropy, fused_linear_cross_entropy_ref
from fuseformer.ops.layer_norm import layer_norm, layer_norm_ref
from fuseformer.ops.mlp import fused_mlp, fused_mlp_ref
from fuseformer.ops.paged_attention import paged_attention, paged_attention_ref
from fuseformer.ops.quant_fp8 import dequantize_fp8, quantize_fp8, quantize_fp8_ref, quantize_weight_fp8
from fuseformer.ops.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref
from fuseformer.ops.rms_norm import rms_norm, rms_norm_ref
from fuseformer.ops.rms_norm_quant import rms_norm_quant_fp8, rms_norm_quant_fp8_ref
from fuseformer.ops.rotary import apply_rotary, apply_rotary_ref
from fuseformer.ops.sampling import gumbel_sample, gumbel_sample_ref

# Every public op, in the order ``fuseformer info`` lists them.
OPS = (
    "rms_norm",
    "layer_norm",
    "swiglu",
    "geglu",
    "reshape_and_cache",
    "paged_attention",
    "apply_rotary",
    "flash_attention",
    "cross_entropy",
    "fused_linear_cross_entropy",
    "fused_mlp",
    "quantize_fp8",
    "rms_norm_quant_fp8",
    "fp8_gemm",
    "fp8_gemm_glu",
    "fp8_weight_gemm",
    "fp8_weight_mlp",
    "gumbel_sample",
)

__all__ = [
    "OPS",
    "apply_rotary",
    "apply_rotary_ref",
    "cross_entropy",
    "cross_entropy_ref",
    "dequantize_fp8",
    "flash_attention",
    "flash_attention_ref",
    "fp8_gemm",
    "fp8_gemm_glu",
    "fp8_gemm_glu_ref",
    "fp8_gemm_ref",
    "fp8_weight_gemm",
    "fp8_weight_gemm_ref",
    "fp8_weight_mlp",
    "fp8_weight_mlp_ref",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_ref",
    "fused_mlp",
    "fused_mlp_ref",
    "geglu",
    "geglu_ref",
    "gumbel_sample",
    "gumbel_sample_ref",
    "layer_norm",
    "layer_norm_ref",
    "paged_attention",
    "paged_attention_ref",
    "quantize_fp8",
    "quantize_fp8_ref",
    "quantize_weight_fp8",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "rms_norm",
    "rms_norm_quant_fp8",
    "rms_norm_quant_fp8_ref",
    "rms_norm_ref",
    "swiglu",
    "swiglu_ref",
]

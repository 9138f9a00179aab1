"""FP8 training (``TrainConfig(fp8=True)``, ``fuseformer train --fp8 true``), applied from outside the model.

The linear layers of the decoder layers (qkv, o, gate-up and down projections) run their three GEMMs
(forward, input gradient, weight gradient) in float8 through torchao's float8 training
(``torchao.float8``, rowwise scaling: e4m3 operands with a dynamic scale per row of each operand,
bf16 outputs), the library made for this. What stays as it is: the fp32 master weights and the
optimizer (a Float8Linear keeps its weight in the master dtype and casts it per step), the
embeddings, the norms, attention, and the LM head with its fused linear cross-entropy (bf16: its
logits feed a softmax over the whole vocabulary, where e4m3's 3 mantissa bits would show).
Parameter names do not change, so checkpoints and ``--export`` are those of a bf16 run.

The model's MLP calls ``fused_mlp`` on its weights (the gate-up GEMM with the activation in its
epilogue), which a converted ``nn.Linear`` would not see; here each MLP instance's forward is
replaced by gate-up Linear -> ``swiglu``/``geglu`` on the packed halves -> down Linear, so both
GEMMs are the float8 ones.

On a CPU torchao runs the same e4m3 casts and scaled GEMMs through torch's CPU kernels: the numbers
of an fp8 run are checked there (slowly); the speed is a GPU's (Hopper or Ada, SM 8.9+).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

import fuseformer.ops as F

# A float8 GEMM (torch._scaled_mm) needs both dims of each weight to be multiples of 16.
_FP8_ALIGN = 16


def _import_torchao():
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise ValueError(
            "TrainConfig: fp8=True trains through torchao's float8 training, which is not installed "
            "(pip install 'fuseformer[fp8]', or pip install torchao)"
        ) from exc
    return Float8LinearConfig, convert_to_float8_training


def check_fp8_device(device: torch.device) -> None:
    """ValueError unless ``device`` can run float8 GEMMs: a CPU, or a CUDA GPU of compute capability
    8.9 or newer (Ada, Hopper, Blackwell)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            name = torch.cuda.get_device_name(device)
            raise ValueError(
                f"TrainConfig: fp8=True needs float8 tensor cores (compute capability 8.9+: Ada, Hopper); "
                f"{name} is {major}.{minor}"
            )
    elif device.type != "cpu":
        raise ValueError(f"TrainConfig: fp8=True runs on CUDA GPUs and CPUs, not on {device.type}")


def _fp8_eligible(module: nn.Module, fqn: str) -> bool:
    return (
        isinstance(module, nn.Linear) and module.in_features % _FP8_ALIGN == 0 and module.out_features % _FP8_ALIGN == 0
    )


def _mlp_forward(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The MLP through its (float8) Linear modules: down(act(gate) * up) with the packed gate-up."""
    gate_up = mlp.gate_up_proj(x)
    if mlp.act == "silu":
        h = F.swiglu(gate_up)
    else:  # "gelu_tanh" or "gelu" (erf)
        h = F.geglu(gate_up, approximate="tanh" if mlp.act == "gelu_tanh" else "none")
    return mlp.down_proj(h)


def apply_fp8_training(lm: nn.Module) -> list[str]:
    """Convert ``lm``'s decoder-layer linear layers to torchao's float8 training (rowwise scales), in
    place; returns the names of the converted layers. A layer whose dims are not multiples of 16 stays
    in the training dtype (a ValueError if that leaves none converted). Call it before activation
    checkpointing and DDP/FSDP wrap the layers."""
    Float8LinearConfig, convert_to_float8_training = _import_torchao()
    config = Float8LinearConfig.from_recipe_name("rowwise")
    converted: list[str] = []
    for i, layer in enumerate(lm.model.layers):
        names = [n for n, m in layer.named_modules() if _fp8_eligible(m, n)]
        convert_to_float8_training(layer, config=config, module_filter_fn=_fp8_eligible)
        converted += [f"model.layers.{i}.{n}" for n in names]
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and hasattr(mlp, "gate_up_proj"):
            mlp.forward = functools.partial(_mlp_forward, mlp)
    if not converted:
        raise ValueError(
            f"TrainConfig: fp8=True found no linear layer whose dims are multiples of {_FP8_ALIGN} "
            "(what float8 GEMMs need); train this model without fp8"
        )
    if next(lm.parameters()).is_cuda:
        # torchao's amax, scale and cast ops run one kernel each in eager: run 118 (H100, Llama-1B
        # B 4 x S 4096) trained at 0.48x bf16 so. Compiled (as torchao's docs ask), each linear's casts
        # fuse into a few kernels around its scaled GEMMs; the layers around them stay eager. CUDA only:
        # on a CPU inductor would compile C++ for minutes to check numbers the eager path checks.
        for name in converted:
            lm.get_submodule(name).compile()
    return converted

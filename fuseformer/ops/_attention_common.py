"""What the flash-attention forward (attention.py) and backward (attention_bwd.py) share, and the
logit soft-capping tanh that paged_attention.py uses too. Both attention modules import from here,
so the import graph has no cycle: attention.py imports attention_bwd (its autograd calls the
backward); attention_bwd imports nothing of attention.py.

- ``tanh``: for logit soft-capping (Gemma 2), scores = softcap * tanh(scores / softcap) after the
  scale, before the mask and softmax. Built on exp2 so that it runs on every Triton the package
  supports (3.6 through 3.9) and under the interpreter, without a libdevice import whose path moved
  between them.
- the kernels' tile loads and key-block bounds (``_load_tile``, ``_kv_bounds``);
- the launch configuration: block sizes per padded head dim (``KernelConfig``; the default rule
  ``default_config`` over the tables; ``kernel_config``, the lookup through the autotune cache;
  ``resolve_config``, which puts a launcher's explicit ``config=`` on top; the tuning candidates
  ``candidate_configs``, which bench/tune.py times) and ``launch``, which falls back to smaller
  configs when one does not fit;
- the layout helpers (strides, TMA descriptors over (rows, H * D) views).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources
from triton.tools.tensor_descriptor import TensorDescriptor

from fuseformer.runtime import autotune
from fuseformer.runtime.backend import INTERPRET


# --------------------------------------------------------------------------------------------
# Kernel helpers
# --------------------------------------------------------------------------------------------
@triton.jit
def tanh(x):
    """tanh in fp32 from one exp2: (1 - e) / (1 + e) with e = exp(-2|x|) <= 1 (no overflow for any x;
    +-inf give +-1, NaN stays NaN), the sign put back after."""
    e = tl.math.exp2(-2.885390081777927 * tl.abs(x))  # exp(-2|x|); 2.885... = 2 log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _load_tile(ptrs, row_ok, d_ok, MASK_ROWS: tl.constexpr, EVEN_D: tl.constexpr):
    """Load a (rows, BLOCK_D) tile; masked rows and padded head-dim columns read 0 (never a gap)."""
    if MASK_ROWS:
        if EVEN_D:
            x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        if EVEN_D:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    return x


@triton.jit
def _kv_bounds(
    m0, sq, sk, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr,
):  # fmt: skip
    """Key blocks for the query rows [m0, m0 + BLOCK_M): lo <= full_lo <= full_hi <= hi.

    [full_lo, full_hi) every row sees entirely (no mask); [lo, full_lo) and [full_hi, hi) are
    partly visible (masked); keys outside [lo, hi) no row sees (skipped).
    """
    diag = sk - sq
    m_last = m0 + BLOCK_M - 1
    lo = 0
    hi = sk
    full_lo = 0
    full_hi = (sk // BLOCK_N) * BLOCK_N
    if HAS_LEFT:
        lo = (tl.maximum(m0 + diag - window_left, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.cdiv(tl.maximum(m_last + diag - window_left, 0), BLOCK_N) * BLOCK_N
    if HAS_RIGHT:
        hi = tl.minimum(hi, tl.maximum(m_last + diag + window_right + 1, 0))
        full_hi = tl.minimum(full_hi, (tl.maximum(m0 + diag + window_right + 1, 0) // BLOCK_N) * BLOCK_N)
    no_full = full_hi <= full_lo
    full_lo = tl.where(no_full, lo, full_lo)
    full_hi = tl.where(no_full, lo, full_hi)
    return lo, full_lo, full_hi, hi


# --------------------------------------------------------------------------------------------
# Launch configuration: a table per padded head dim (the default), the autotune cache over it
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Block sizes and launch options of one attention kernel."""

    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    # Forward only: warp-specialize the unmasked key loop (tl.range(..., warp_specialize=True)).
    warp_specialize: int = 0


# Starting points for the H100/H200 (sm_90), keyed by the padded head dim (BLOCK_D); not yet timed
# on the H200 (benchmarks/sweeps.py has the ``attention`` sweep for that). Chosen so that ptxas
# (Triton 3.6, sm_90a, bf16, offline compile) reports no register spills:
# fwd with TMA K/V: hd 64 128x128/3 stages 171 regs; hd 128 128x128/2 stages 206 regs, 161 KiB smem
# (3 stages: 225 KiB, just fits); hd 256 128x64/2 stages 232 regs. Pointer loads (no TMA) need more:
# hd 128 128x128 reaches 255 regs with a few bytes of spill, 128x64/3 stages 182 regs.
# H200 sweep (2026-11-30, bf16, B*S 16384, H 32, hd 128; docs/perf-notes.md): causal S4096 best at
# 128x128/8 warps/3 stages (451 TFLOP/s; 2 stages ~400), full S16384 at 128x64/4 warps/2 stages (510;
# 128x128/8/2: 440). Warp specialization (tl.range(..., warp_specialize=True)) did not help (440, 495).
# hd 64: causal 64x128/4/2 401 (128x128/8/3: 312), full 128x128/4/3 425 (375).
_FWD_TABLE = {
    16: KernelConfig(128, 64, 4, 3),
    32: KernelConfig(128, 64, 4, 3),
    64: KernelConfig(64, 128, 4, 2),
    128: KernelConfig(128, 128, 8, 3),
    256: KernelConfig(128, 64, 8, 2),
}
# Without a causal/window bound (every key block unmasked), where the sweep chose differently.
_FWD_FULL_TABLE = {64: KernelConfig(128, 128, 4, 3), 128: KernelConfig(128, 64, 4, 2)}
# dk/dv: BLOCK_N key rows accumulate dk, dv (2 x BLOCK_N x BLOCK_D fp32) while BLOCK_M q rows stream.
# ptxas: hd 64 64x128: 234 regs; hd 128 32x128: 254 regs (64x128 spills 108 B); hd 256 32x64: 40 B spill.
# H200 sweep, causal S4096 hd 128: 64x64/4 warps 330 TFLOP/s over the whole backward (32x128/8: 274);
# hd 64: 32x64/4 280 (64x128/8: 240).
_BWD_DKDV_TABLE = {
    16: KernelConfig(64, 128, 8, 2),
    32: KernelConfig(64, 128, 8, 2),
    64: KernelConfig(32, 64, 4, 2),
    128: KernelConfig(64, 64, 4, 2),
    256: KernelConfig(32, 64, 8, 2),
}
# dq: BLOCK_M q rows accumulate dq while BLOCK_N key rows stream. ptxas: hd 128 198-230 regs.
# H200 sweep, causal S4096 hd 128: 64x64/4 warps 293 (with the old dk/dv config; 128x64/8: 273);
# hd 64: 64x64/4 252 (128x64/8: 241).
_BWD_DQ_TABLE = {
    16: KernelConfig(128, 64, 8, 2),
    32: KernelConfig(128, 64, 8, 2),
    64: KernelConfig(64, 64, 4, 2),
    128: KernelConfig(64, 64, 4, 2),
    256: KernelConfig(64, 64, 8, 2),
}
# Under the interpreter: small, unequal blocks so that CPU-sized tests cross several of them.
_INTERPRET_CONFIGS = {
    "fwd": KernelConfig(32, 16, 4, 1),
    "bwd_dkdv": KernelConfig(16, 32, 4, 1),
    "bwd_dq": KernelConfig(32, 16, 4, 1),
}
_TABLES = {"fwd": _FWD_TABLE, "bwd_dkdv": _BWD_DKDV_TABLE, "bwd_dq": _BWD_DQ_TABLE}


# The autotune cache's kernel names (runtime/autotune.py); a stored config has every KernelConfig field.
KERNELS = {"fwd": "attention_fwd", "bwd_dkdv": "attention_bwd_dkdv", "bwd_dq": "attention_bwd_dq"}
_FIELDS = KernelConfig.__slots__


def config_key(block_d: int, bounded: bool, dtype: torch.dtype) -> str:
    """The autotune key: padded head dim, ``causal`` (a causal or window bound: masked diagonal
    blocks) or ``full``, dtype."""
    return f"D{block_d}-{'causal' if bounded else 'full'}-{autotune.dtype_name(dtype)}"


def default_config(kind: str, block_d: int, bounded: bool) -> KernelConfig:
    """The default rule of kernel ``kind``: the tables above (the interpreter's small configs under
    TRITON_INTERPRET=1)."""
    if INTERPRET:
        return _INTERPRET_CONFIGS[kind]
    if kind == "fwd" and not bounded and block_d in _FWD_FULL_TABLE:
        return _FWD_FULL_TABLE[block_d]
    return _TABLES[kind][block_d]


@autotune.plan_cache
def kernel_config(
    kind: str,
    block_d: int,
    bounded: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
) -> KernelConfig:
    """The config of kernel ``kind`` ("fwd", "bwd_dkdv", "bwd_dq") for padded head dim ``block_d``;
    ``bounded``: a causal or window bound (masked diagonal blocks) rather than full attention. The
    autotune cache's for (block_d, bounded, dtype) on ``device``, else :func:`default_config`; looked up
    once per such tuple."""
    stored = autotune.get_config(
        KERNELS[kind], config_key(block_d, bounded, dtype), device=device,
        default=lambda: asdict(default_config(kind, block_d, bounded)), fields=_FIELDS,
    )  # fmt: skip
    return KernelConfig(**stored)


def resolve_config(
    kind: str, config: dict | None, block_d: int, bounded: bool, dtype: torch.dtype, device: torch.device
) -> KernelConfig:
    """What a launcher runs: :func:`kernel_config`, with the fields of an explicit ``config`` (the
    launcher's argument: tuning, sweeps, tests) on top."""
    cfg = kernel_config(kind, block_d, bounded, dtype, device)
    return replace(cfg, **config) if config else cfg


def _fallbacks(cfg: KernelConfig):
    """cfg, then fewer stages, then smaller blocks: what to try when a config runs out of shared memory."""
    seen = []
    for stages in range(cfg.num_stages, 0, -1):
        seen.append(replace(cfg, num_stages=stages))
    if cfg.BLOCK_N > 32:
        seen.append(replace(cfg, BLOCK_N=cfg.BLOCK_N // 2, num_stages=min(cfg.num_stages, 2)))
    if cfg.BLOCK_M > 32:
        seen.append(replace(cfg, BLOCK_M=cfg.BLOCK_M // 2, BLOCK_N=max(32, cfg.BLOCK_N // 2), num_stages=1))
    return seen


# (kernel name, requested config, constexpr key) -> the config that fit, so a failed config is tried once.
_FITTED: dict[tuple, KernelConfig] = {}


def launch(kernel, grid_fn, cfg: KernelConfig, args, consts: dict, key: tuple) -> KernelConfig:
    """Launch ``kernel`` with ``cfg``; if it does not fit (OutOfResources), with the next fallback.

    ``args``: the positional arguments, or a function of the config returning them (descriptors
    carry the block shape)."""
    full_key = (kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel), cfg, key)
    candidates = [_FITTED[full_key]] if full_key in _FITTED else _fallbacks(cfg)
    error = None
    for c in candidates:
        try:
            kernel[grid_fn(c)](
                *(args(c) if callable(args) else args),
                **consts,
                BLOCK_M=c.BLOCK_M,
                BLOCK_N=c.BLOCK_N,
                num_warps=c.num_warps,
                num_stages=c.num_stages,
            )
        except OutOfResources as exc:
            error = exc
            continue
        _FITTED[full_key] = c
        return c
    raise error


# --------------------------------------------------------------------------------------------
# Layouts (launchers take unit stride in the head dim)
# --------------------------------------------------------------------------------------------
def _seq_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, seq, head) strides of a (B, S, H, D) or packed (T, H, D) tensor."""
    if varlen:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# The forward streams K and V through TMA descriptors (sm_90+, and the interpreter) when their
# layout allows: one async bulk copy per tile instead of per-thread address math and loads.
def _use_tma(t: torch.Tensor) -> bool:
    if t.is_cuda:
        return torch.cuda.get_device_capability(t.device)[0] >= 9
    return INTERPRET


def _rows_view(t: torch.Tensor, varlen: bool) -> torch.Tensor | None:
    """(B, S, H, D) or (T, H, D) as a (rows, H * D) matrix view (row b * S + s, or t), when the layout
    allows one and a TMA descriptor (16-byte aligned base and row stride); else None."""
    h, d = t.shape[-2], t.shape[-1]
    if t.numel() == 0 or t.stride(-1) != 1 or (h > 1 and t.stride(-2) != d):
        return None
    if d & (d - 1):
        # A padded head dim (59 -> 64) would make each tile's box run into the next head's columns;
        # on the H200 the dk/dv kernel hit an illegal instruction there (hd 59, run 4): pointer loads.
        return None
    if varlen:
        rows, row_stride = t.shape[0], t.stride(0)
    elif t.shape[1] == 1:
        rows, row_stride = t.shape[0], t.stride(0)
    elif t.shape[0] == 1 or t.stride(0) == t.shape[1] * t.stride(1):
        rows, row_stride = t.shape[0] * t.shape[1], t.stride(1)
    else:
        return None
    if (row_stride * t.element_size()) % 16 or t.data_ptr() % 16:
        return None
    return t.as_strided((rows, h * d), (row_stride, 1))


def _descriptor(view: torch.Tensor, block_rows: int, block_d: int) -> TensorDescriptor:
    return TensorDescriptor(view, list(view.shape), [view.stride(0), 1], [block_rows, block_d])


# --------------------------------------------------------------------------------------------
# Tuning candidates (``fuseformer bench --tune``: bench/tune.py; benchmarks/sweeps.py's attention sweep)
# --------------------------------------------------------------------------------------------
# Quick tuning: (BLOCK_M, BLOCK_N, num_warps, num_stages) around the H200 sweeps' winners (tables above).
_QUICK_CANDIDATES = {
    "fwd": ((64, 128, 4, 2), (128, 64, 4, 2), (128, 128, 4, 3), (128, 128, 8, 3), (128, 64, 8, 2)),
    "bwd_dkdv": ((32, 64, 4, 2), (64, 64, 4, 2), (32, 128, 8, 2), (64, 128, 8, 2)),
    "bwd_dq": ((64, 64, 4, 2), (128, 64, 8, 2), (64, 128, 4, 2), (128, 64, 4, 2)),
}
# The full sweep: (BLOCK_M values, BLOCK_N values, num_stages values), warps 4 and 8.
_SWEEP = {
    "fwd": ((64, 128), (32, 64, 128), (2, 3, 4)),
    "bwd_dkdv": ((16, 32, 64), (64, 128), (1, 2, 3)),
    "bwd_dq": ((64, 128), (32, 64, 128), (1, 2, 3)),
}


def candidate_configs(kind: str, block_d: int, bounded: bool, quick: bool = False) -> list[dict]:
    """The sweep of one kernel, its current default first (it wins ties). A config that does not fit
    shared memory runs its fallback (``launch``) and is timed as such."""
    if quick:
        grid = _QUICK_CANDIDATES[kind]
    else:
        bms, bns, stages = _SWEEP[kind]
        grid = [(m, n, w, st) for m in bms for n in bns for w in (4, 8) for st in stages]
    out = [asdict(default_config(kind, block_d, bounded))]
    out += [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st, warp_specialize=0) for m, n, w, st in grid]
    if kind == "fwd" and not quick:  # warp-specialized key loop (TMA producer warps)
        out += [dict(BLOCK_M=128, BLOCK_N=n, num_warps=w, num_stages=st, warp_specialize=1)
                for n in (64, 128) for w in (4, 8) for st in (2, 3)]  # fmt: skip
    return [c for i, c in enumerate(out) if c not in out[:i]]

"""One token per row of logits by the Gumbel-max trick, with counter-based noise (inference only; no
autograd): the op the engine's sampler runs for every sampled (non-greedy) row of a step, in one launch.

For row r with logits l (V,), temperature T, seed s and position p, the token is

    argmax_v ( l[v] / T + g[v] ),   g[v] = -log(-log u[v]),   u[v] uniform in (0, 1)

(with T == 0: argmax_v l[v], no noise). That is a draw from softmax(l / T), as ``argmax(probs / q)``
with ``q ~ Exponential(1)`` is. ``u`` comes from Philox-4x32-10 (Salmon et al. 2011, the generator of
cuRAND and of Triton's ``tl.randint``), keyed by the seed's two 32-bit halves and counted by the token
and the position, so a row's token depends only on its logits, temperature, seed and position: not on
the batch it shares, the order of its rows or the draws before it. The engine passes a seeded
request's own seed and the position of the token it samples, and for unseeded rows one fresh seed a
step with the row index as their position.

Counter layout (the reference and the kernel agree on it; the kernel's block size does not enter):
the vocabulary is cut into chunks of ``4 * LANES`` tokens; token ``v = c * 4 * LANES + j * LANES + i``
(chunk c, word j in 0..3, lane i) takes word j of Philox at counter (c * LANES + i, p mod 2^32,
p div 2^32, 0). u = (bits >> 9 + 0.5) / 2^23: 23 bits, never 0 or 1 in fp32.

Ties keep the lowest index (as ``torch.argmax``); NaN logits win (as ``torch.argmax``, which takes NaN
as the largest); a row of -inf samples token 0.

Here: the reference ``gumbel_sample_ref`` (Philox in int64 tensor arithmetic: the oracle), the kernels
(a row's vocabulary split over several programs when the batch is small, and the merge of their
partial winners), the launcher ``gumbel_sample_fwd``, the ``torch.library`` registration and the public
``gumbel_sample``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fuseformer.ops._utils import FLOAT_DTYPES, Launcher, check_shape, check_tensor, launch_config, sm_count
from fuseformer.runtime.backend import choose_backend

_OP = "gumbel_sample"
LANES = 256  # Philox counters per chunk; a chunk is 4 * LANES tokens (one draw gives 4 words)
_CHUNK = 4 * LANES
# Philox-4x32's key increments and round multipliers (the reference and the kernels read these).
_KEY_A, _KEY_B = tl.constexpr(0x9E3779B9), tl.constexpr(0xBB67AE85)
_ROUND_A, _ROUND_B = tl.constexpr(0xD2511F53), tl.constexpr(0xCD9E8D57)
_M32 = 0xFFFFFFFF
_NO_INDEX = tl.constexpr(2**31 - 1)  # a lane's winner before any token beat -inf


# --------------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------------
def _philox_ref(c0, c1, c2, c3, k0, k1):
    """Philox-4x32-10 on int64 tensors holding uint32 values (broadcasting); returns the 4 words."""
    for _ in range(10):
        hi0, lo0 = _mul_hi_lo(_ROUND_B.value, c2)
        hi1, lo1 = _mul_hi_lo(_ROUND_A.value, c0)
        c0, c1, c2, c3 = hi0 ^ c1 ^ k0, lo0, hi1 ^ c3 ^ k1, lo1
        k0, k1 = (k0 + _KEY_A.value) & _M32, (k1 + _KEY_B.value) & _M32
    return c0, c1, c2, c3


def _mul_hi_lo(a: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(a * x) >> 32 and (a * x) & (2^32 - 1) for a uint32 constant ``a`` and uint32 values ``x`` in int64,
    by 16-bit halves of ``a`` (every partial product stays below 2^63)."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    lo_part = a_lo * x  # < 2^48
    hi_part = a_hi * x  # < 2^48
    total_lo = lo_part + ((hi_part & 0xFFFF) << 16)  # < 2^49
    lo = total_lo & _M32
    hi = ((hi_part >> 16) + (total_lo >> 32)) & _M32
    return hi, lo


def philox_uniform_ref(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """(N, vocab) fp32 uniforms in (0, 1): row r's noise for seed ``seeds[r]`` (int64, the bits of a
    uint64) at position ``positions[r]``, in the counter layout of the module docstring."""
    chunks = triton.cdiv(vocab, _CHUNK)
    device = seeds.device
    seeds, positions = seeds.long()[:, None], positions.long()[:, None]
    k0, k1 = seeds & _M32, (seeds >> 32) & _M32
    c0 = torch.arange(chunks * LANES, dtype=torch.int64, device=device)[None, :]
    c1, c2 = positions & _M32, (positions >> 32) & _M32
    words = _philox_ref(c0, c1.expand_as(k0), c2.expand_as(k0), torch.zeros_like(k0), k0, k1)
    n = seeds.shape[0]
    bits = torch.stack([w.expand(n, chunks * LANES).reshape(n, chunks, LANES) for w in words], dim=2)
    bits = bits.reshape(n, chunks * _CHUNK)[:, :vocab]
    return ((bits >> 9).to(torch.float32) + 0.5) * (1.0 / 8388608.0)


def gumbel_sample_ref(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """(N,) int64: argmax(logits / T + Gumbel noise) per row (T == 0: argmax(logits)), in fp32."""
    x = logits.float()
    t = temperature.float()[:, None]
    u = philox_uniform_ref(seeds, positions, x.shape[1])
    scores = torch.where(t == 0, x, x / torch.where(t == 0, 1.0, t) - torch.log(-torch.log(u)))
    return scores.argmax(dim=-1)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------
@triton.jit
def _mulhilo(a, x):
    # (a * x) >> 32 and (a * x) mod 2^32 for uint32 a (a constant) and x: through 64 bits.
    p = x.to(tl.uint64) * a
    return (p >> 32).to(tl.uint32), p.to(tl.uint32)


@triton.jit
def _philox(c0, c1, c2, c3, k0, k1):
    # Philox-4x32-10, as _philox_ref (and cuRAND, and Triton's tl.randint4x).
    for _ in tl.static_range(10):
        hi0, lo0 = _mulhilo(_ROUND_B, c2)
        hi1, lo1 = _mulhilo(_ROUND_A, c0)
        c0 = hi0 ^ c1 ^ k0
        c2 = hi1 ^ c3 ^ k1
        c1 = lo0
        c3 = lo1
        k0 = (k0.to(tl.uint64) + _KEY_A).to(tl.uint32)
        k1 = (k1.to(tl.uint64) + _KEY_B).to(tl.uint32)
    return c0, c1, c2, c3


@triton.jit
def _noisy(LOGITS, cols, V, bits, temperature, greedy):
    # One word of Philox bits -> scores l / T + g of its tokens (greedy rows: l); out of range: -inf,
    # NaN: +inf (argmax takes NaN as the largest).
    ok = cols < V
    x = tl.load(LOGITS + cols, mask=ok, other=float("-inf")).to(tl.float32)
    u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    g = -tl.log(-tl.log(u))
    s = tl.where(greedy, x, tl.math.div_rn(x, tl.where(greedy, 1.0, temperature)) + g)
    s = tl.where(s == s, s, float("inf"))
    return tl.where(ok, s, float("-inf"))


@triton.jit
def _keep(best, best_idx, s, cols):
    # The running winner of each lane: strictly greater scores only (the lowest index wins a tie).
    take = s > best
    return tl.where(take, s, best), tl.where(take, cols, best_idx)


# Nothing but the logits (read in vectors) is specialized: not the split count, the chunks a split,
# nor the alignment of the per-row vectors read and written one value a program (the engine's
# positions are the second row of one (2, N) copy: 16-byte aligned only for even N). One compiled
# kernel per logits dtype whatever the batch, so no batch a server meets compiles anything.
@triton.jit(
    do_not_specialize=["TEMPERATURE", "SEEDS", "POSITIONS", "BEST", "BEST_IDX", "OUT", "chunks_per_split", "splits"]
)
def _gumbel_sample_fwd_kernel(
    LOGITS, TEMPERATURE, SEEDS, POSITIONS, BEST, BEST_IDX, OUT,
    stride_row, V, chunks_per_split, splits,
    LANES: tl.constexpr,
):  # fmt: skip
    # Program (row, split) scans the split's chunks of the row; each chunk is one Philox draw per lane,
    # whose four words score four runs of LANES tokens. One split: the winner goes to OUT; more: the
    # split's winner (score, index) to BEST, BEST_IDX, merged by _gumbel_merge_kernel.
    row = tl.program_id(0)
    split = tl.program_id(1)
    temperature = tl.load(TEMPERATURE + row).to(tl.float32)
    greedy = temperature == 0.0
    seed = tl.load(SEEDS + row).to(tl.uint64, bitcast=True)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    position = tl.load(POSITIONS + row).to(tl.uint64, bitcast=True)
    p_lo = (position & 0xFFFFFFFF).to(tl.uint32)
    p_hi = (position >> 32).to(tl.uint32)
    lanes = tl.arange(0, LANES)
    logits = LOGITS + row.to(tl.int64) * stride_row
    best = tl.full([LANES], float("-inf"), tl.float32)
    best_idx = tl.full([LANES], _NO_INDEX, tl.int32)
    first = split * chunks_per_split
    for c in range(first, first + chunks_per_split):
        counter = (c * LANES + lanes).to(tl.uint32)
        zero = counter * 0
        b0, b1, b2, b3 = _philox(counter, zero + p_lo, zero + p_hi, zero, zero + k0, zero + k1)
        base = c * (4 * LANES) + lanes
        best, best_idx = _keep(best, best_idx, _noisy(logits, base, V, b0, temperature, greedy), base)
        best, best_idx = _keep(best, best_idx, _noisy(logits, base + LANES, V, b1, temperature, greedy), base + LANES)
        cols = base + 2 * LANES
        best, best_idx = _keep(best, best_idx, _noisy(logits, cols, V, b2, temperature, greedy), cols)
        cols = base + 3 * LANES
        best, best_idx = _keep(best, best_idx, _noisy(logits, cols, V, b3, temperature, greedy), cols)
    m = tl.max(best, 0)
    idx = tl.min(tl.where(best == m, best_idx, _NO_INDEX), 0)
    idx = tl.where(idx == _NO_INDEX, first * 4 * LANES, idx)  # nothing above -inf: the split's first token
    if splits == 1:
        tl.store(OUT + row, idx.to(tl.int64))
    else:
        tl.store(BEST + row * splits + split, m)
        tl.store(BEST_IDX + row * splits + split, idx)


@triton.jit(do_not_specialize=["OUT", "splits"])
def _gumbel_merge_kernel(BEST, BEST_IDX, OUT, splits, BLOCK_S: tl.constexpr):
    # One program per row: the best of its splits' winners (the lowest index on a tie).
    row = tl.program_id(0)
    k = tl.arange(0, BLOCK_S)
    ok = k < splits
    s = tl.load(BEST + row * splits + k, mask=ok, other=float("-inf"))
    idx = tl.load(BEST_IDX + row * splits + k, mask=ok, other=_NO_INDEX)
    m = tl.max(s, 0)
    tl.store(OUT + row, tl.min(tl.where(s == m, idx, _NO_INDEX), 0).to(tl.int64))


# --------------------------------------------------------------------------------------------
# Launcher (no autograd; inputs already checked; logits with a unit stride in the vocabulary)
# --------------------------------------------------------------------------------------------
_MAX_SPLITS = 64  # programs a row at most (the merge kernel's block)


def _splits(rows: int, chunks: int, sms: int) -> int:
    """Programs a row: enough for ~2 per SM over the batch, a power of two, at most one a chunk."""
    want = max(1, (2 * sms) // max(rows, 1))
    splits = 1
    while splits * 2 <= min(want, chunks, _MAX_SPLITS):
        splits *= 2
    return splits


def gumbel_sample_fwd(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    splits: int | None = None,
) -> torch.Tensor:
    """logits (N, V) fp16/bf16/fp32, temperature (N,) fp32, seeds and positions (N,) int64 -> (N,) int64.
    ``splits``: programs a row (1 to 64; None: the rule, ``_splits``, a power of two)."""
    n, v = logits.shape
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    chunks = triton.cdiv(v, _CHUNK)
    if splits is None:
        splits = _splits(n, chunks, sm_count(logits) if logits.is_cuda else 1)
    elif not 1 <= splits <= _MAX_SPLITS:
        raise ValueError(f"gumbel_sample_fwd: splits must be 1 to {_MAX_SPLITS}, got {splits}")
    per_split = triton.cdiv(chunks, splits)
    # Not written with one split, but allocated all the same: their dtypes are in the kernel's signature.
    best = torch.empty(n, splits, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(n, splits, dtype=torch.int32, device=logits.device)
    _launcher(
        (n, splits),
        launch_config(LANES=LANES, num_warps=4),
        (logits, temperature, seeds, positions, best, best_idx, out),
        (logits.stride(0), v, per_split, splits),
    )
    if splits > 1:
        _merge_launcher((n,), launch_config(BLOCK_S=_MAX_SPLITS, num_warps=1), (best, best_idx, out), (splits,))
    return out


_launcher = Launcher(_gumbel_sample_fwd_kernel)
_merge_launcher = Launcher(_gumbel_merge_kernel)


# --------------------------------------------------------------------------------------------
# torch.library registration: opaque to torch.compile; CUDA-graph capturable (no host syncs)
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("fuseformer::gumbel_sample", mutates_args=())
def _gumbel_sample_op(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    return gumbel_sample_fwd(logits, temperature, seeds, positions)


@_gumbel_sample_op.register_fake
def _(logits, temperature, seeds, positions):
    return logits.new_empty(logits.shape[0], dtype=torch.int64)


# --------------------------------------------------------------------------------------------
# Public function
# --------------------------------------------------------------------------------------------
def gumbel_sample(
    logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
) -> torch.Tensor:
    """Sample one token per row from softmax(logits / temperature), with noise fixed by (seed, position).

    Args:
        logits: (N, V) fp16, bf16, fp32 (fp64 runs on the reference); -inf for tokens a row may not take.
        temperature: (N,) fp32, >= 0 (not checked: that would wait for the device); 0 makes the row
            greedy (argmax, no noise).
        seeds: (N,) int64, each row's seed (the bits of a uint64: seeds >= 2^63 as negative int64).
        positions: (N,) int64, each row's draw counter (the engine: the position of the sampled token).

    Returns: (N,) int64 token ids. The same (logits row, temperature, seed, position) gives the same
    token whatever the batch around it.
    """
    check_tensor(_OP, "logits", logits, dtypes=FLOAT_DTYPES, ndim=2)
    n = logits.shape[0]
    check_tensor(_OP, "temperature", temperature, dtypes=(torch.float32,), device=logits.device, device_of="logits")
    check_shape(_OP, "temperature", temperature, (n,), "one per row of logits")
    for name, t in (("seeds", seeds), ("positions", positions)):
        check_tensor(_OP, name, t, dtypes=(torch.int64,), device=logits.device, device_of="logits")
        check_shape(_OP, name, t, (n,), "one per row of logits")
    backend = choose_backend(_OP, logits.device, logits.dtype != torch.float64, "fp64 logits")
    if backend == "reference":
        return gumbel_sample_ref(logits, temperature, seeds, positions)
    logits = logits if logits.stride(1) == 1 else logits.contiguous()
    args = (logits, temperature.contiguous(), seeds.contiguous(), positions.contiguous())
    return _gumbel_sample_op(*args) if torch.compiler.is_compiling() else gumbel_sample_fwd(*args)

"""fused_linear_cross_entropy: the Triton path (chunks, the first chunk in grad_weight's memory, growing
chunks) against the fp64 reference (DESIGN.md §3) for every reduction, ignore_index, label smoothing,
z-loss, bias or none; gradients taken not copied; memory; bad input; compile; opcheck."""

import importlib

import pytest
import torch
import torch.nn.functional as TF

import fuseformer
import fuseformer.ops as F
from fuseformer.testing import assert_close, compile_offline

# The modules, not the functions of the same names that fuseformer.ops exports.
FLCE = importlib.import_module("fuseformer.ops.fused_linear_cross_entropy")

REDUCTIONS = ["mean", "sum", "none"]


def _targets(n, v, device, ignore_frac=0.2, ignore_index=-100):
    t = torch.randint(0, v, (n,), device=device)
    t[torch.rand(n, device=device) < ignore_frac] = ignore_index
    return t


def _grad_for(loss):
    return torch.randn(loss.shape, dtype=torch.float32, device=loss.device).to(loss.dtype)


def _check_flce(n, h, v, dtype, device, reduction, bias=True, label_smoothing=0.0, z_loss=0.0, chunk_tokens=None,
                ignore_frac=0.2, lead=None, softcap=0.0):  # fmt: skip
    hidden = torch.randn(n, h, device=device).to(dtype)
    weight = (torch.randn(v, h, device=device) / h**0.5).to(dtype)
    b = torch.randn(v, device=device).to(dtype) if bias else None
    t = _targets(n, v, device, ignore_frac)
    if lead is not None:
        hidden, t = hidden.view(*lead, h), t.view(*lead)
    leaves = [a for a in (hidden, weight, b) if a is not None]
    kw = dict(reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)

    def run(fn, cast, **extra):
        args = [a.detach().to(cast).requires_grad_() for a in leaves]
        return fn(args[0], args[1], t, args[2] if bias else None, **kw, **extra), args

    with fuseformer.use_backend("triton"):
        out, args = run(F.fused_linear_cross_entropy, dtype, **({"chunk_size": chunk_tokens} if chunk_tokens else {}))
    ref, ref_args = run(FLCE.fused_linear_cross_entropy_ref, torch.float64, upcast=True)
    base, base_args = run(FLCE.fused_linear_cross_entropy_ref, dtype, upcast=False)
    assert out.dtype == dtype and out.shape == ref.shape
    assert_close("loss", out, ref, base)
    g = _grad_for(out)
    for o in (out, ref, base):
        o.backward(g.to(o.dtype))
    for name, a, r, bb in zip(["dhidden", "dweight", "dbias"], args, ref_args, base_args):
        assert a.grad.dtype == dtype
        assert_close(name, a.grad, r.grad, bb.grad)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few tokens, so that the CPU shapes go through several chunks."""
    monkeypatch.setattr(FLCE, "_MIN_CHUNK_BYTES", 1)
    monkeypatch.setattr(FLCE, "_chunk_size", lambda n, h, v, es: 8)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("n, h, v", [(1, 40, 1000), (23, 40, 1000), (7, 96, 5003), (61, 24, 1000), (1, 64, 7),
                                     (3, 32, 2)])  # fmt: skip
def test_flce_matches_reference(n, h, v, reduction, device, small_chunks):
    _check_flce(n, h, v, torch.float16, device, reduction)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_flce_other_dtypes(dtype, reduction, device, small_chunks):
    _check_flce(19, 40, 1000, dtype, device, reduction)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_flce_smoothing_z_loss_no_bias_3d(reduction, device, small_chunks):
    _check_flce(21, 64, 999, torch.float16, device, reduction, bias=False, label_smoothing=0.1, z_loss=1e-3,
                lead=(3, 7))  # fmt: skip


def test_flce_default_chunking(device):
    _check_flce(33, 40, 1000, torch.float32, device, "mean")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_flce_softcap(reduction, device, small_chunks):
    """Gemma 2's final soft-cap (logits ~1.4 std, a cap of 1.5 bites): the first chunk on the transposed
    kernels (24 tokens), the rest in chunks of 8 on the row kernel, the recomputing backward of "none"."""
    _check_flce(61, 24, 1000, torch.float16, device, reduction, softcap=1.5, label_smoothing=0.1)


def test_flce_softcap_default_chunking_and_effect(device):
    _check_flce(33, 40, 1000, torch.float32, device, "mean", softcap=1.5)
    h, w = torch.randn(16, 40, dtype=torch.float64), torch.randn(300, 40, dtype=torch.float64) / 40**0.5
    t = torch.randint(0, 300, (16,))
    capped = FLCE.fused_linear_cross_entropy_ref(h, w, t, softcap=1.5)
    assert abs(capped - FLCE.fused_linear_cross_entropy_ref(h, w, t)) > 1e-2  # the cap changes the loss


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_flce_chunk_size_argument(reduction, device, monkeypatch):
    """chunk_size sets the tokens per chunk (forward, and the recomputing backward of "none")."""
    seen = []
    chunks = FLCE._chunks

    def spy(*args, **kw):
        seen.append(args[-1])
        return chunks(*args, **kw)

    monkeypatch.setattr(FLCE, "_chunks", spy)
    _check_flce(23, 40, 1000, torch.float16, device, reduction, chunk_tokens=5)
    assert seen and all(c == 5 for c in seen)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_flce_all_ignored_gives_zero(reduction, device):
    hidden = torch.randn(5, 16, device=device, requires_grad=True)
    weight = torch.randn(50, 16, device=device, requires_grad=True)
    t = torch.full((5,), -100, device=device)
    with fuseformer.use_backend("triton"):
        loss = F.fused_linear_cross_entropy(hidden, weight, t, reduction=reduction)
    assert torch.equal(loss, torch.zeros_like(loss))
    loss.sum().backward()
    assert torch.equal(hidden.grad, torch.zeros_like(hidden)) and torch.equal(weight.grad, torch.zeros_like(weight))


def test_flce_frozen_weight_and_no_grad(device):
    hidden = torch.randn(9, 24, device=device, requires_grad=True)
    weight = torch.randn(70, 24, device=device)
    t = _targets(9, 70, device)
    ref = TF.cross_entropy(hidden.detach() @ weight.T, t)
    with fuseformer.use_backend("triton"):
        with torch.no_grad():
            torch.testing.assert_close(F.fused_linear_cross_entropy(hidden, weight, t), ref)
        loss = F.fused_linear_cross_entropy(hidden, weight, t)
    loss.backward()
    h2 = hidden.detach().clone().requires_grad_()
    TF.cross_entropy(h2 @ weight.T, t).backward()
    torch.testing.assert_close(hidden.grad, h2.grad)
    assert weight.grad is None


def test_flce_reduction_none_matches_torch_gradients(device):
    """The case Liger's FLCE got wrong: per-token gradients of reduction="none"."""
    hidden = torch.randn(13, 32, device=device, requires_grad=True)
    weight = torch.randn(101, 32, device=device, requires_grad=True)
    t = _targets(13, 101, device)
    h2, w2 = (a.detach().clone().requires_grad_() for a in (hidden, weight))
    with fuseformer.use_backend("triton"):
        ours = F.fused_linear_cross_entropy(hidden, weight, t, reduction="none")
    theirs = TF.cross_entropy(h2 @ w2.T, t, reduction="none")
    g = torch.randn(13, device=device)
    (ours * g).sum().backward()
    (theirs * g).sum().backward()
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(hidden.grad, h2.grad)
    torch.testing.assert_close(weight.grad, w2.grad)


def test_flce_nan_propagates(device):
    hidden = torch.randn(4, 16, device=device)
    hidden[2, 3] = float("nan")
    weight = torch.randn(30, 16, device=device)
    t = torch.randint(0, 30, (4,), device=device)
    with fuseformer.use_backend("triton"):
        loss = F.fused_linear_cross_entropy(hidden, weight, t, reduction="none")
    assert torch.isnan(loss[2]) and torch.isfinite(loss[[0, 1, 3]]).all()


@pytest.mark.parametrize(
    "fn, kwargs, match",
    [
        (
            F.fused_linear_cross_entropy,
            dict(hidden=torch.randn(3, 8), weight=torch.randn(5, 7), target=torch.zeros(3, dtype=torch.long)),
            r"weight has shape \(5, 7\)",
        ),  # fmt: skip
        (
            F.fused_linear_cross_entropy,
            dict(hidden=torch.randn(3, 8), weight=torch.randn(5, 8).half(), target=torch.zeros(3, dtype=torch.long)),
            "weight has dtype float16",
        ),  # fmt: skip
        (
            F.fused_linear_cross_entropy,
            dict(hidden=torch.randn(3, 8), weight=torch.randn(5, 8), target=torch.zeros(2, dtype=torch.long)),
            "target has shape",
        ),  # fmt: skip
        (
            F.fused_linear_cross_entropy,
            dict(
                hidden=torch.randn(3, 8),
                weight=torch.randn(5, 8),
                target=torch.zeros(3, dtype=torch.long),
                softcap=-1.0,
            ),
            "softcap must be",
        ),  # fmt: skip
        (
            F.fused_linear_cross_entropy,
            dict(
                hidden=torch.randn(3, 8),
                weight=torch.randn(5, 8),
                target=torch.zeros(3, dtype=torch.long),
                chunk_size=0,
            ),
            "chunk_size must be a positive int or None, got 0",
        ),  # fmt: skip
        (
            F.fused_linear_cross_entropy,
            dict(
                hidden=torch.randn(3, 8),
                weight=torch.randn(5, 8),
                target=torch.zeros(3, dtype=torch.long),
                bias=torch.randn(4),
            ),
            r"bias has shape \(4,\)",
        ),  # fmt: skip
    ],
)
def test_flce_bad_input(fn, kwargs, match):
    with pytest.raises(ValueError, match=match):
        fn(**kwargs)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_compiles_fullgraph(reduction, device, compile_backend):
    hidden = torch.randn(10, 24, device=device, requires_grad=True)
    weight = torch.randn(60, 24, device=device, requires_grad=True)
    bias = torch.randn(60, device=device, requires_grad=True)
    t = _targets(10, 60, device)

    def fn(hidden, weight, bias):
        a = F.fused_linear_cross_entropy(hidden, weight, t, bias, reduction=reduction)
        b = F.cross_entropy(hidden @ weight.T, t, reduction=reduction, label_smoothing=0.1)
        return (a + b).sum()

    with fuseformer.use_backend("triton"):
        eager = fn(hidden, weight, bias)
        eager_grads = torch.autograd.grad(eager, (hidden, weight, bias))
        compiled = torch.compile(fn, fullgraph=True, backend=compile_backend)(hidden, weight, bias)
        grads = torch.autograd.grad(compiled, (hidden, weight, bias))
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b)


def test_flce_custom_op_passes_opcheck(device):
    t = _targets(6, 50, device)
    hidden = torch.randn(6, 16, device=device, requires_grad=True)
    weight = torch.randn(50, 16, device=device, requires_grad=True)
    with fuseformer.use_backend("triton"):
        for reduction in ("mean", "none"):
            for chunk in (4, 0):  # fixed chunks; the default (grad_hidden a view of the chunks' arena)
                cap = 1.5 if chunk else 0.0
                args = (hidden, weight, t, None, -100, reduction, 0.0, 0.0, True, True, False, chunk, cap)
                torch.library.opcheck(FLCE._flce_fwd_op, args)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("n, h, v", [(1024, 2048, 128256), (999, 4096, 50257), (1, 1024, 32000), (3000, 1024, 50257)])
def test_flce_gpu(n, h, v, dtype, reduction):
    # N <= H: every token in the first chunk (grad_weight's memory); (3000, 1024): then growing chunks.
    _check_flce(n, h, v, dtype, "cuda", reduction)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_flce_softcap_gpu(dtype, reduction):
    """A soft-cap of 1 on logits of unit spread (it bites) at Gemma 2's 256k vocabulary: the first chunk on
    the transposed kernels, then growing chunks on the row kernel."""
    _check_flce(3000, 1024, 256000, dtype, "cuda", reduction, softcap=1.0, bias=False)


@pytest.mark.gpu
def test_flce_gpu_memory_stays_below_logits():
    """8192 tokens, H 4096, V 128256 bf16: the peak above the inputs is the two gradients (which
    are outputs: dW 0.98 GiB, dH 0.06 GiB) and one chunk of logits (244 x V, 0.06 GiB): 1.0994 GiB,
    under the issue's 1.1 GiB.
    Run 5 measured 2.08 GiB = 2 x (dW + dH): each gradient copied once more in the backward."""
    n, h, v = 8192, 4096, 128256
    hidden = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(v, h, device="cuda") / h**0.5).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")
    # cuBLAS/cuBLASLt workspaces (allocated once a process, ~32 MiB) and Triton's compile, before the count.
    small = [a[:64].detach().requires_grad_() for a in (hidden, weight)]
    F.fused_linear_cross_entropy(small[0], small[1], t[:64] % 64).backward()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    F.fused_linear_cross_entropy(hidden, weight, t).backward()
    torch.cuda.synchronize()
    above = torch.cuda.max_memory_allocated() - before
    chunk = FLCE._growing_plan(n, h, v, FLCE._chunk_size(n, h, v, 2), h)[0]
    expected = 2 * (v * h + n * h + chunk * v)  # 1.0994 GiB
    assert above <= expected + (32 << 20), f"{above / 2**30:.3f} GiB above the inputs, expected {expected / 2**30:.3f}"
    assert above <= 1.1 * 2**30, f"{above / 2**30:.4f} GiB above the inputs: over the goal of 1.1 GiB"
    assert weight.grad is not None and hidden.grad is not None


def test_flce_gradients_are_taken_not_copied(device, monkeypatch):
    """The gradients made in the forward become .grad as they are: no Python wrapper of a gradient
    buffer outlives the forward (where autograd counts such a wrapper as a reference, it deep-copies
    the gradient: +grad_weight of memory), and .grad shares the forward's buffers."""
    _check_gradients_taken(device, torch.float32, monkeypatch)


@pytest.mark.gpu
def test_flce_gradients_are_taken_not_copied_gpu(monkeypatch):
    """The same on the GPU's torch and bf16: run 5's extra 0.98 GiB was a copy of grad_weight."""
    _check_gradients_taken("cuda", torch.bfloat16, monkeypatch)


def _check_gradients_taken(device, dtype, monkeypatch):
    import gc
    import weakref

    seen = {}
    real = FLCE.fused_linear_cross_entropy_fwd

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen["refs"] = [weakref.ref(g) for g in out[1:3]]
        seen["ptrs"] = [g.data_ptr() for g in out[1:3]]
        return out

    monkeypatch.setattr(FLCE, "fused_linear_cross_entropy_fwd", spy)
    hidden = torch.randn(20, 16, device=device).to(dtype).requires_grad_()
    weight = torch.randn(50, 16, device=device).to(dtype).requires_grad_()
    t = _targets(20, 50, device)
    with fuseformer.use_backend("triton"):
        loss = F.fused_linear_cross_entropy(hidden, weight, t)
    gc.collect()
    assert [r() is None for r in seen["refs"]] == [True, True], "a gradient's Python wrapper outlived the forward"
    loss.backward()
    assert [hidden.grad.data_ptr(), weight.grad.data_ptr()] == seen["ptrs"]


def test_flce_one_logits_buffer_for_all_chunks(device, monkeypatch):
    """The chunks share one allocation for their logits (a fresh one per chunk would hold two at the
    peak): with grad_hidden to compute, one arena holding grad_hidden and the logits scratch; without
    (the forward of "none"), one (C, V) buffer; with chunk_size given, that buffer and grad_hidden."""
    shapes = []
    real = FLCE.empty
    monkeypatch.setattr(FLCE, "empty", lambda shape, **kw: shapes.append(tuple(shape)) or real(shape, **kw))
    monkeypatch.setattr(FLCE, "_chunk_size", lambda n, h, v, es: 8)
    arena = (29 * 24 + 8 * 300 + FLCE._ARENA_ALIGN,)
    _check_flce(29, 24, 300, torch.float32, device, "mean")  # 24 tokens in grad_weight's memory, then 5
    assert shapes.count(arena) == 1 and not [s for s in shapes if len(s) == 2 and s[1] == 300], shapes
    shapes.clear()
    _check_flce(29, 24, 300, torch.float32, device, "none")  # forward (no gradient) and the recomputing backward
    assert shapes.count((8, 300)) == 1 and shapes.count(arena) == 1, shapes
    shapes.clear()
    _check_flce(29, 24, 300, torch.float32, device, "mean", chunk_tokens=8)
    assert shapes.count((8, 300)) == 1 and shapes.count((29, 24)) == 1, shapes


def test_flce_growing_chunks_cover_the_tokens_without_overlap():
    """Each chunk's logits lie past the grad_hidden rows written so far and inside the arena; the chunks
    tile the tokens in order. At the goal shape: 24 chunks (480 tokens down to 224) where fixed chunks
    of 241 tokens take 34, in the same memory."""
    for n, h, v, scratch_tokens in [(8192, 4096, 128256, 241), (29, 24, 300, 8), (40, 64, 80, 4), (1, 5, 7, 1),
                                    (1000, 3, 50257, 3)]:  # fmt: skip
        chunks = FLCE._growing_chunks(n, h, v, scratch_tokens * v)
        total = n * h + scratch_tokens * v + FLCE._ARENA_ALIGN
        assert chunks[0][0] == 0 and chunks[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
        for s, e, off in chunks:
            assert e > s and off >= e * h and off + (e - s) * v <= total and off % FLCE._ARENA_ALIGN == 0
        assert len(chunks) <= -(-n // scratch_tokens)
    sizes = [e - s for s, e, _ in FLCE._growing_chunks(8192, 4096, 128256, 241 * 128256)]
    assert len(sizes) == 24 and sizes[0] == 480 and sizes[-1] == 224


def test_flce_scratch_grows_a_little_to_save_a_chunk():
    """At the goal shape, past the first chunk's 4096 tokens, 241 tokens of scratch leave a last chunk of
    32 tokens; 244 take the 4096 tokens in 14 chunks, and the peak (grad_weight, grad_hidden, scratch)
    stays under the issue's 1.1 GiB. Elsewhere the scratch grows by 1/64, only to save a chunk, and the
    plan returned is the one for the scratch returned."""
    n, h, v = 8192, 4096, 128256
    assert [e - s for s, e, _ in FLCE._growing_chunks(n, h, v, 241 * v, h)][-1] == 32
    c, plan = FLCE._growing_plan(n, h, v, 241, h)
    assert c == 244 and len(plan) == 14 and plan == FLCE._growing_chunks(n, h, v, c * v, h)
    assert 2 * (v * h + n * h + c * v + FLCE._ARENA_ALIGN) <= 1.1 * 2**30 - (512 << 10)
    for n, h, v, c0, first in [(29, 24, 300, 8, 24), (1000, 64, 5003, 17, 64), (3000, 1024, 32000, 90, 1024),
                               (40, 64, 80, 4, 0), (1, 5, 7, 1, 1)]:  # fmt: skip
        c, plan = FLCE._growing_plan(n, h, v, c0, first)
        assert c0 <= c <= c0 + c0 // 64 and plan == FLCE._growing_chunks(n, h, v, c * v, first)
        chunks = len(plan)
        assert chunks <= len(FLCE._growing_chunks(n, h, v, c0 * v, first))
        assert c == c0 or chunks < len(FLCE._growing_chunks(n, h, v, c0 * v, first))


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("grads", ["all", "weight only", "hidden only"])
def test_flce_first_chunk_and_growing_chunks_match_reference(reduction, grads, device, monkeypatch):
    """With the default chunking the first min(N, H) tokens are one chunk in grad_weight's memory
    (transposed logits, the column CE kernel, grad_weight in slices from the last) and the rest grow
    into grad_hidden's unwritten rows (hidden size near the vocabulary's: well past the 4-token
    scratch). Every gradient matches, with or without grad_hidden and grad_weight."""
    monkeypatch.setattr(FLCE, "_chunk_size", lambda n, h, v, es: 4)
    n, h, v = 120, 16, 40
    sizes = [e - s for s, e, _ in FLCE._growing_chunks(n, h, v, 4 * v, first=h)]
    assert sizes[0] > 4 and sum(sizes) == n - h, sizes
    firsts, growing = [], []
    real_first, real_grow = FLCE._first_chunk_in_dw, FLCE._growing_chunks
    monkeypatch.setattr(FLCE, "_first_chunk_in_dw", lambda *a, **k: firsts.append(a[-1]) or real_first(*a, **k))
    monkeypatch.setattr(FLCE, "_growing_chunks", lambda *a: growing.append(a) or real_grow(*a))
    hidden = torch.randn(n, h, device=device)
    weight = torch.randn(v, h, device=device) / h**0.5
    bias = torch.randn(v, device=device)
    t = _targets(n, v, device, 0.2)
    want = {"all": (True, True), "weight only": (False, True), "hidden only": (True, False)}[grads]
    leaves = [hidden.clone().requires_grad_(want[0]), weight.clone().requires_grad_(want[1]),
              bias.clone().requires_grad_()]  # fmt: skip
    refs = [a.detach().double().requires_grad_(a.requires_grad) for a in leaves]
    with fuseformer.use_backend("triton"):
        out = F.fused_linear_cross_entropy(*leaves[:2], t, leaves[2], reduction=reduction)
    ref = FLCE.fused_linear_cross_entropy_ref(*refs[:2], t, refs[2], reduction=reduction, upcast=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    g = _grad_for(out)
    out.backward(g)
    ref.backward(g.double())
    for a, r in zip(leaves, refs):
        if a.requires_grad:
            torch.testing.assert_close(a.grad.double(), r.grad, rtol=1e-4, atol=1e-5)
    assert firsts == ([h] if want[1] else []), firsts
    assert bool(growing) == want[0], growing


def test_flce_under_autocast_casts_fp32_weight(device):
    """torch.autocast: an fp32 LM head with fp16 hidden states, as F.linear would take them."""
    hidden = torch.randn(9, 32, device=device, requires_grad=True)
    weight = (torch.randn(70, 32, device=device) / 32**0.5).requires_grad_()
    t = _targets(9, 70, device)
    with fuseformer.use_backend("triton"), torch.autocast(device, dtype=torch.float16):
        loss = F.fused_linear_cross_entropy(hidden, weight, t)
    assert loss.dtype == torch.float16
    loss.backward()
    assert weight.grad.dtype == torch.float32 and hidden.grad.dtype == torch.float32
    h2, w2 = (a.detach().clone().requires_grad_() for a in (hidden, weight))
    ref = TF.cross_entropy((h2.half() @ w2.half().T).float(), t)
    ref.backward()
    torch.testing.assert_close(loss.float(), ref, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(weight.grad, w2.grad, rtol=1e-2, atol=1e-3)


def test_flce_second_backward_through_the_same_graph_raises(device):
    """Eager mean/sum scale the saved gradients in place (no second grad_weight-sized buffer); a
    second backward through the same graph must then fail loudly, not return rescaled gradients."""
    hidden = torch.randn(5, 16, device=device, requires_grad=True)
    weight = torch.randn(30, 16, device=device, requires_grad=True)
    t = _targets(5, 30, device)
    with fuseformer.use_backend("triton"):
        loss = F.fused_linear_cross_entropy(hidden, weight, t)
    torch.autograd.grad(loss, (hidden, weight), retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss, (hidden, weight))


def test_flce_first_chunk_tiny_vocabulary_weight_only(device):
    """grad_weight only, 2 tokens of a 3-word vocabulary, H 64: the logits buffer (6 elements) is
    smaller than one grad_weight row, and the first chunk's slices get a row of their own."""
    hidden = torch.randn(2, 64, device=device)
    weight = (torch.randn(3, 64, device=device) / 8).requires_grad_()
    t = torch.tensor([0, 2], device=device)
    with fuseformer.use_backend("triton"):
        F.fused_linear_cross_entropy(hidden, weight, t).backward()
    w = weight.detach().clone().requires_grad_()
    torch.nn.functional.cross_entropy(hidden @ w.T, t).backward()
    torch.testing.assert_close(weight.grad, w.grad, rtol=1e-4, atol=1e-5)


_OFFLINE_COLS = r"""
import importlib
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

CE = importlib.import_module("fuseformer.ops.cross_entropy")
FLCE = importlib.import_module("fuseformer.ops.fused_linear_cross_entropy")
stats = {"X": "*bf16", "T": "*i64", "PART": "*fp32", "stride_v": "i32", "C": "i32", "V": "i32", "V_SPLIT": "i32",
         "softcap": "fp32"}
grad = {"X": "*bf16", "T": "*i64", "LOSS": "*fp32", "LSE": "*fp32", "SCALE": "*fp32", "PART": "*fp32",
        "stride_v": "i32", "stride_scale": "i32", "C": "i32", "V": "i32", "V_SPLIT": "i32", "SPLITS": "i32",
        "ignore_index": "i32", "label_smoothing": "fp32", "z_loss": "fp32", "softcap": "fp32"}
cfg = dict(CE._COLS_CONFIG)
warps = cfg.pop("num_warps")
cfg.pop("PROGRAMS")
for wl, sm, z, cap in [(True, False, False, False), (True, True, True, True), (False, False, False, False)]:
    jobs = [(CE._cross_entropy_cols_stats_kernel, stats, dict(HAS_SMOOTHING=sm, SOFTCAP=cap, **cfg)),
            (CE._cross_entropy_cols_grad_kernel, grad,
             dict(WRITE_LOSS=wl, WRITE_GRAD=True, HAS_SMOOTHING=sm, HAS_Z_LOSS=z, SOFTCAP=cap, **cfg))]
    for fn, sig, consts in jobs:
        src = ASTSource(fn=fn, signature=dict(sig, **{k: "constexpr" for k in consts}), constexprs=consts)
        triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps))
src = ASTSource(fn=FLCE._scale_unless_one_kernel, signature={"X": "*bf16", "G": "*fp32", "N": "i64",
                "BLOCK": "constexpr"}, constexprs={"BLOCK": FLCE._SCALE_BLOCK})
triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8))
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests compile it for real")
def test_column_kernels_compile_for_sm90_offline():
    """The FLCE's column CE kernels (first chunk) and the backward's scaling kernel compile for sm_90
    with their shipped tiles (the interpreter runs them on the CPU but does not compile them)."""
    compile_offline(_OFFLINE_COLS, timeout=300)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_scale_unless_one_scales_in_fp32_and_skips_one(dtype, device):
    """The eager FLCE backward's in-place scaling: t * g computed in fp32 and rounded once, and nothing
    written when g == 1 (its contents kept bit for bit, NaN included). bf16 runs on the GPU test below
    (the interpreter rounds bf16 stores differently)."""
    if device == "cpu" and not FLCE.INTERPRET:
        pytest.skip("the kernel runs on a GPU or under TRITON_INTERPRET=1")
    t = torch.randn(3 * FLCE._SCALE_BLOCK + 5, device=device).to(dtype)
    t[7] = float("nan")
    t0 = t.clone()
    FLCE._scale_unless_one_(t, torch.tensor(1.0, device=device))
    assert torch.equal(t.view(torch.uint8), t0.view(torch.uint8))
    FLCE._scale_unless_one_(t, torch.tensor(0.37, device=device))
    assert torch.equal(t[8:], (t0[8:].float() * 0.37).to(dtype)) and t[7].isnan()


@pytest.mark.gpu
def test_scale_unless_one_bf16_gpu():
    t = torch.randn(1 << 20, device="cuda", dtype=torch.bfloat16)
    t0 = t.clone()
    FLCE._scale_unless_one_(t, torch.tensor(1.0, device="cuda"))
    assert torch.equal(t, t0)
    FLCE._scale_unless_one_(t, torch.tensor(0.37, device="cuda"))
    assert torch.equal(t, (t0.float() * 0.37).to(torch.bfloat16))


@pytest.mark.parametrize("g", [1.0, 2.5])
def test_flce_backward_of_the_loss_itself_and_of_a_scaled_loss(g, device):
    """loss.backward() (incoming gradient 1: the scaling pass is skipped on the device) and a scaled
    loss (gradient accumulation's loss / k) both give the reference's gradients."""
    hidden = torch.randn(37, 24, device=device)
    weight = torch.randn(300, 24, device=device) / 5
    t = _targets(37, 300, device)
    leaves = [a.clone().requires_grad_() for a in (hidden, weight)]
    refs = [a.double().requires_grad_() for a in (hidden, weight)]
    with fuseformer.use_backend("triton"):
        (F.fused_linear_cross_entropy(*leaves, t) * g).backward()
    (FLCE.fused_linear_cross_entropy_ref(*refs, t, upcast=True) * g).backward()
    for a, r in zip(leaves, refs):
        torch.testing.assert_close(a.grad.double(), r.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_flce_out_dtype_float32_keeps_the_fp32_loss(backend):
    """out_dtype=torch.float32: the loss is the fp32 accumulation itself, not rounded to hidden's dtype
    (fp16 here: the interpreter's dots are right in fp16), and its gradient flows as before."""
    h = torch.randn(37, 48, dtype=torch.float16, requires_grad=True)
    w = (torch.randn(97, 48) * 0.2).to(torch.float16).requires_grad_()
    t = torch.randint(0, 97, (37,))
    ref = TF.cross_entropy(h.double() @ w.double().T, t)
    with fuseformer.use_backend(backend):
        low = F.fused_linear_cross_entropy(h, w, t)
        loss = F.fused_linear_cross_entropy(h, w, t, out_dtype=torch.float32)
    assert low.dtype == torch.float16 and loss.dtype == torch.float32
    # The same accumulation, not rounded: it rounds to the fp16 loss.
    assert abs(loss.item() - ref.item()) < 1e-3 and loss.to(torch.float16) == low
    loss.backward()
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
    with pytest.raises(ValueError, match="out_dtype"):
        F.fused_linear_cross_entropy(h, w, t, out_dtype=torch.int32)

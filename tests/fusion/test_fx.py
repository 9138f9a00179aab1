"""The FX pattern pass (fusion/fx.py) on a small Transformer written in plain PyTorch."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fuseformer.fusion import fx as fxpass
from fuseformer.fusion.base import KINDS
from fuseformer.testing import assert_close

ALL = frozenset(KINDS)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, dim, heads, max_len=64, dropout=0.0):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.drop = nn.Dropout(dropout)
        self.register_buffer("mask", torch.tril(torch.ones(max_len, max_len)).view(1, 1, max_len, max_len))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:, :, :T, :T] == 0, float("-inf"))
        att = self.drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.norm1, self.attn = RMSNorm(dim), Attention(dim, heads)
        self.norm2, self.mlp = RMSNorm(dim), MLP(dim, hidden)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, vocab=97, dim=48, heads=4, hidden=80, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim, heads, hidden) for _ in range(layers)])
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx, targets=None):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        logits_flat = self.lm_head(x).view(-1, self.lm_head.out_features)
        if targets is None:
            return logits_flat
        return F.cross_entropy(logits_flat, targets.view(-1))


def _inputs(batch=2, seq=13, vocab=97):
    return torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))


def _apply_all(res):
    for c in res.candidates:
        c.apply()


def _grads(model):
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _check_against(model, base, ref, args, ref_args, training):
    """§3 on the output (and every gradient when training): model (fused, fp32) against ref (fp64)
    with base (the unfused fp32 model) as the baseline."""
    outs = []
    for m, a in ((model, args), (base, args), (ref, ref_args)):
        with torch.set_grad_enabled(training):
            out = m(*a)
            if training:
                out.backward()
        outs.append(out)
    assert_close("output", *outs)
    if training:
        gm, gb, gr = _grads(model), _grads(base), _grads(ref)
        assert gm.keys() == gb.keys() == gr.keys() and gm
        for name in gm:
            assert_close(f"grad {name}", gm[name], gr[name], gb[name])


def _counts(res):
    out = {}
    for c in res.candidates:
        out[c.kind] = out.get(c.kind, 0) + 1
    return out


@pytest.mark.parametrize("training", [True, False])
def test_tiny_lm_fuses_every_kind_and_matches(training):
    model = TinyLM().train(training)
    base, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    idx, tgt = _inputs()
    args = (idx, tgt) if training else (idx,)
    keys = list(model.state_dict())
    params = {n: id(p) for n, p in model.named_parameters()}
    res = fxpass.find_candidates(model, training=training, kinds=ALL, sample_args=args)
    # 2 blocks x 2 norms + the final norm; the norms after the first take the residual add.
    expected = {"norm": 5, "attention": 2, "mlp": 2} | ({"loss": 1} if training else {})
    assert _counts(res) == expected, [(c.path, c.kind) for c in res.candidates]
    assert sum("residual" in c.replacement for c in res.candidates) == 3
    assert all("causal" in c.replacement for c in res.candidates if c.kind == "attention")
    for c in res.candidates:  # each compared module exists before apply
        model.get_submodule(c.path)
    _apply_all(res)
    assert list(model.state_dict()) == keys
    assert {n: id(p) for n, p in model.named_parameters()} == params
    _check_against(model, base, ref, args, args, training)


def test_undo_and_restore_give_back_the_same_model():
    model = TinyLM().eval()
    idx, _ = _inputs()
    modules = [(n, id(m)) for n, m in model.named_modules()]
    with torch.no_grad():
        expected = model(idx)
    res = fxpass.find_candidates(model, training=False, kinds=ALL, sample_args=(idx,))
    assert res.candidates and res.restore is not None
    originals = {c.path: model.get_submodule(c.path) for c in res.candidates}
    _apply_all(res)
    _apply_all(res)  # idempotent
    for c in res.candidates:
        assert model.get_submodule(c.path) is not originals[c.path]
        c.undo()
        c.undo()
        assert model.get_submodule(c.path) is originals[c.path]
    with torch.no_grad():
        assert torch.equal(model(idx), expected)  # the restructured model computes the same numbers
    res.restore()
    res.restore()
    assert [(n, id(m)) for n, m in model.named_modules()] == modules
    assert "forward" not in model.__dict__
    assert not any(k.startswith("_tensor_constant") for k in model.__dict__)
    with torch.no_grad():
        assert torch.equal(model(idx), expected)


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)) * 2)


def test_nothing_to_fuse_leaves_the_model_alone():
    model = Plain()
    modules = [(n, id(m)) for n, m in model.named_modules()]
    attrs = set(model.__dict__)
    res = fxpass.find_candidates(model, training=False, kinds=ALL, sample_args=(torch.randn(3, 8),))
    assert res.candidates == [] and res.skipped == [] and res.restore is None
    assert [(n, id(m)) for n, m in model.named_modules()] == modules
    assert set(model.__dict__) == attrs


class DataDependent(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: torch.fx cannot trace this
            x = x * 2
        return self.lin(self.norm(x))


class Mixed(nn.Module):
    def __init__(self, dim=32, heads=2, hidden=48):
        super().__init__()
        self.first = Block(dim, heads, hidden)
        self.odd = DataDependent(dim)
        self.last = Block(dim, heads, hidden)

    def forward(self, x):
        return self.last(self.odd(self.first(x)))


def test_untraceable_part_is_skipped_and_its_siblings_fused():
    model = Mixed().eval()
    base, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    x = torch.randn(2, 9, 32)
    res = fxpass.find_candidates(model, training=False, kinds=ALL, sample_args=(x,))
    traced = {s.path: s.reason for s in res.skipped if s.kind == "trace"}
    assert set(traced) == {"", "odd"}, res.skipped
    assert "not traceable" in traced["odd"] and "control flow" in traced["odd"]
    paths = [c.path for c in res.candidates]
    assert any(p.startswith("first.") for p in paths) and any(p.startswith("last.") for p in paths)
    assert any(p.startswith("odd.norm.") for p in paths)  # the untraceable module's child, traced alone
    _apply_all(res)
    _check_against(model, base, ref, (x,), (x.double(),), False)


def test_unsupported_head_dim_is_skipped():
    model = Block(dim=320, heads=1, hidden=64).eval()
    x = torch.randn(1, 5, 320)
    res = fxpass.find_candidates(model, training=False, kinds=ALL, sample_args=(x,))
    assert "attention" not in _counts(res) and _counts(res)["norm"] == 2
    (skip,) = [s for s in res.skipped if s.kind == "attention"]
    assert skip.path == "attn" and "head dim 320" in skip.reason


class SDPA(nn.Module):
    def __init__(self, dim=32, heads=4, mask=False, causal=True):
        super().__init__()
        self.heads, self.mask, self.causal = heads, mask, causal
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, bias=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        if self.mask:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return y.transpose(1, 2).reshape(B, T, C)


class AdditiveMask(nn.Module):
    """Attention with the mask given by the caller (arbitrary: not fusable)."""

    def forward(self, q, k, v, mask):
        att = torch.softmax(q @ k.transpose(-2, -1) / 4.0 + mask, dim=-1)
        return att @ v


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_is_fused(causal):
    model = SDPA(causal=causal).eval()
    base, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    x = torch.randn(2, 7, 32)
    res = fxpass.find_candidates(model, training=False, kinds=ALL, sample_args=(x,))
    (c,) = res.candidates
    assert c.kind == "attention" and ("causal" in c.replacement) == causal
    _apply_all(res)
    _check_against(model, base, ref, (x,), (x.double(),), False)


def test_arbitrary_masks_are_skipped():
    q, k, v = (torch.randn(2, 3, 6, 16) for _ in range(3))
    res = fxpass.find_candidates(AdditiveMask(), training=False, kinds=ALL, sample_args=(q, k, v, torch.randn(6, 6)))
    assert res.candidates == [] and "mask" in res.skipped[0].reason
    model = SDPA(mask=True).eval()
    res = fxpass.find_candidates(
        model, training=False, kinds=ALL, sample_args=(torch.randn(2, 5, 32), torch.randn(5, 5))
    )
    assert res.candidates == [] and "mask" in res.skipped[0].reason


class Variants(nn.Module):
    """One norm or GLU written in one of the ways the pass knows."""

    def __init__(self, variant, dim=40):
        super().__init__()
        self.variant = variant
        self.w = nn.Parameter(1 + 0.1 * torch.randn(dim))
        self.b = nn.Parameter(0.1 * torch.randn(dim))
        self.ln, self.rms = nn.LayerNorm(dim), nn.RMSNorm(dim, eps=1e-5)
        self.gate, self.up = nn.Linear(dim, 24), nn.Linear(dim, 24)
        self.act = nn.SiLU()

    def forward(self, x):
        v = self.variant
        if v == "div_sqrt":
            return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + 1e-6) * self.w
        if v == "type_as":
            xf = x.float()  # Meta's Llama: self._norm(x.float()).type_as(x)
            return (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + 1e-5)).type_as(x)
        if v == "nn_layernorm":
            return self.ln(x + 1.0)
        if v == "f_layer_norm":
            return F.layer_norm(x, (x.shape[-1],), self.w, self.b, 1e-5)
        if v == "nn_rmsnorm":
            h = x + x.flip(0)
            return self.rms(h) + h
        if v == "f_rms_norm":
            return F.rms_norm(x, (40,), self.w)
        g, u = self.gate(x), self.up(x)
        if v == "nn_silu":
            return self.act(g) * u
        if v == "sigmoid":
            return u * (g * torch.sigmoid(g))
        if v == "gelu_tanh":
            return F.gelu(g, approximate="tanh") * u
        return F.gelu(g) * u  # "gelu"


_NORMS = ["div_sqrt", "type_as", "nn_layernorm", "f_layer_norm", "nn_rmsnorm", "f_rms_norm"]


@pytest.mark.parametrize("variant", _NORMS + ["nn_silu", "sigmoid", "gelu_tanh", "gelu"])
def test_variants(variant):
    model = Variants(variant)
    base, ref = copy.deepcopy(model), copy.deepcopy(model).double()
    x = torch.randn(3, 5, 40, requires_grad=True)
    res = fxpass.find_candidates(model, training=True, kinds=ALL, sample_args=(x,))
    (c,) = res.candidates
    assert c.kind == ("norm" if variant in _NORMS else "mlp")
    if variant == "nn_rmsnorm":
        assert "residual" in c.replacement
    _apply_all(res)

    def run(m, a):
        return m(a).square().sum()

    outs = []
    for m, a in ((model, x), (base, x), (ref, x.detach().double().requires_grad_())):
        out = run(m, a)
        out.backward()
        outs.append(out)
    assert_close("loss", *outs)
    for name, g in _grads(model).items():
        assert_close(name, g, _grads(ref)[name], _grads(base)[name])


def test_kinds_filter_and_loss_only_when_training():
    model = TinyLM().eval()
    idx, tgt = _inputs()
    res = fxpass.find_candidates(model, training=False, kinds=frozenset({"loss", "mlp"}), sample_args=(idx, tgt))
    assert _counts(res) == {"mlp": 2}
    assert any(s.kind == "loss" and "training" in s.reason for s in res.skipped)


def test_calls_outside_the_trace_run_the_class_forward():
    """Traced with targets given; a call without them (or in the other mode) still works."""
    model = TinyLM().train()
    idx, tgt = _inputs()
    res = fxpass.find_candidates(model, training=True, kinds=ALL, sample_args=(idx, tgt))
    _apply_all(res)
    logits = model(idx)  # targets=None: the class's forward (the trace specialized on a tensor)
    assert logits.shape == (idx.numel(), 97)
    model.eval()
    with torch.no_grad():
        loss = model(idx, tgt)
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_no_sample_inputs_structural_matching():
    model = TinyLM().eval()
    idx, _ = _inputs()
    with torch.no_grad():
        expected = model(idx)
    res = fxpass.find_candidates(model, training=False, kinds=ALL)
    # Without samples the causal masks cannot be read: attention is skipped, the rest is found.
    assert _counts(res) == {"norm": 5, "mlp": 2}
    assert sum(s.kind == "attention" for s in res.skipped) == 2
    _apply_all(res)
    with torch.no_grad():
        assert_close("logits", model(idx), expected.double(), expected)


def test_end_to_end_optimize():
    pytest.importorskip("fuseformer.fusion.hf", reason="optimize needs the HF pass (fusion/hf.py) to import")
    import fuseformer

    model = TinyLM().train()
    base = copy.deepcopy(model)
    idx, tgt = _inputs()
    keys = list(model.state_dict())
    report = fuseformer.optimize(model, training=True, sample_inputs=(idx, tgt))
    kept = [r for r in report.replacements if r.status == "kept"]
    assert {r.kind for r in kept} == set(KINDS) - {"fp8"}, report  # fp8 only with optimize(fp8=True)
    # "linear": every nn.Linear the traced code still calls; not the LM head, whose weight the fused loss reads.
    linears = {r.path for r in kept if r.kind == "linear"}
    assert linears == {
        f"blocks.{i}.{m}" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.w1", "mlp.w2", "mlp.w3")
    }
    assert list(model.state_dict()) == keys
    loss, loss0 = model(idx, tgt), base(idx, tgt)
    assert abs(loss.item() - loss0.item()) < 1e-4
    fuseformer.revert(model)
    assert "forward" not in model.__dict__ and not hasattr(model, fxpass.CONTAINER)
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))

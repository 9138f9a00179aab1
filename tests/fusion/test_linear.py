"""The ``"linear"`` kind of ``optimize`` (fusion/linear.py): a float32 CPU model's ``nn.Linear`` layers
as ``fuseformer.layers.Linear`` (its class set on the instance), on a tiny Hugging Face Llama built from a
config and on modules written in plain PyTorch. Numbers by DESIGN.md §3 (fuseformer.testing.assert_close):
the optimized model against a float64 copy of the original, the original fp32 model the baseline."""

from __future__ import annotations

import copy
import math
import types

import pytest
import torch
import torch.nn.functional as tnf
from torch import nn

transformers = pytest.importorskip("transformers")

import fuseformer  # noqa: E402
from fuseformer.fusion import linear as linear_pass  # noqa: E402
from fuseformer.fusion.base import Candidate  # noqa: E402
from fuseformer.layers import Linear  # noqa: E402
from fuseformer.testing import assert_close  # noqa: E402

L, V, H = 2, 128, 64  # layers, vocab, hidden of the tiny Llama


def llama(tied: bool = False) -> nn.Module:
    """A tiny random Llama whose logits are O(1)-O(10) (LM head 4 / sqrt(fan_in), blocks 0.5 / sqrt(fan_in)),
    so that greedy decoding is decisive rather than a chain of near-ties."""
    cfg = transformers.AutoConfig.for_model(
        "llama",
        hidden_size=H,
        intermediate_size=96,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=V,
        max_position_embeddings=256,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=tied,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                std = 1.0 if "embed" in name else (4.0 if "lm_head" in name else 0.5) / math.sqrt(p.shape[1])
                p.copy_(torch.randn(p.shape) * std)
    return model.eval()


class GeluMLP(nn.Module):
    """Two linears around a GELU: nothing the FX pass fuses, so only "linear" candidates."""

    def __init__(self, dim=24, hidden=40):
        super().__init__()
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = nn.GELU()

    def forward(self, x):
        return x + self.down(self.act(self.up(x)))


class SwiGLU(nn.Module):
    """silu(gate) * up between linears: the FX pass's "mlp" fuses the product only, so the linears, still
    called as modules, are "linear" candidates too."""

    def __init__(self, dim=24, hidden=40):
        super().__init__()
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down(tnf.silu(self.gate(x)) * self.up(x))


def _kinds(report, kind: str) -> list[str]:
    return [r.path for r in report.kept if r.kind == kind]


def _snapshot(model: nn.Module) -> dict:
    return {n: (m, type(m)) for n, m in model.named_modules()}


def _ids(b: int, s: int) -> torch.Tensor:
    return torch.randint(3, V, (b, s))


# ---------------------------------------------------------------------------------------------
# Hugging Face Llama
# ---------------------------------------------------------------------------------------------
ATTN = [f"model.layers.{i}.self_attn.{p}_proj" for i in range(L) for p in "qkvo"]
MLP = [f"model.layers.{i}.mlp.{p}_proj" for i in range(L) for p in ("gate", "up", "down")]


def test_llama_candidates_outputs_and_revert():
    model = llama(tied=True)
    ref, base = copy.deepcopy(model).double(), copy.deepcopy(model)
    before = _snapshot(model)
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    report = fuseformer.optimize(model, include=["linear"])
    # Every linear, the tied LM head included (its weight is the embedding's Parameter).
    assert sorted(_kinds(report, "linear")) == sorted(ATTN + MLP + ["lm_head"]), report
    assert report.counts() == {"linear": 2 * 7 + 1}
    for path in ATTN + MLP + ["lm_head"]:
        m = model.get_submodule(path)
        assert m is before[path][0] and type(m) is Linear and isinstance(m, nn.Linear)
    assert list(model.state_dict()) == keys and model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p is params[n] for n, p in model.named_parameters())
    with torch.no_grad():
        for x in (_ids(2, 13), _ids(1, 1), _ids(1, 3)):  # prefill; decode-sized: cpu_linear's GEMM form
            assert_close("logits", model(x).logits, ref(x).logits, base(x).logits)
    assert fuseformer.optimize(model, include=["linear"]) is report  # a second optimize is a no-op
    assert type(model.lm_head) is Linear
    report.revert()
    assert _snapshot(model) == before  # the same module objects, of their original classes
    assert all(p is params[n] for n, p in model.named_parameters())
    assert fuseformer.revert(model) is False


def test_llama_other_kinds_keep_their_linears():
    """Inference: the "mlp" fusion reads gate/up/down's weights (fused_mlp), so those stay nn.Linear;
    training: the fused loss reads the LM head's weight, so that stays too."""
    model = llama()
    report = fuseformer.optimize(model, training=False)
    assert sorted(_kinds(report, "linear")) == sorted(ATTN + ["lm_head"]), report
    assert report.counts() == {"norm": 2 * L + 1, "mlp": L, "attention": L, "linear": 4 * L + 1}
    assert all(type(model.get_submodule(p)) is nn.Linear for p in MLP)
    report.revert()

    report = fuseformer.optimize(model, training=True)
    assert sorted(_kinds(report, "linear")) == sorted(ATTN), report
    assert type(model.lm_head) is nn.Linear and report.counts()["loss"] == 1
    rows = [r for r in report.kept if r.kind == "linear"]
    assert all(r.grad_error is not None and r.grad_error <= r.grad_tolerance for r in rows), report
    report.revert()
    assert all(type(m) is not Linear for m in model.modules())


def test_llama_training_gradients_at_decode_rows():
    """layers.Linear is autograd-transparent: gradients through cpu_linear's GEMM form (3 rows) as
    through nn.Linear, §3 against fp64."""
    model = llama()
    ref, base = copy.deepcopy(model).double(), copy.deepcopy(model)
    report = fuseformer.optimize(model, training=True, include=["linear"], sample_inputs={"input_ids": _ids(1, 3)})
    assert report.counts() == {"linear": 2 * 7 + 1} and all(r.grad_error is not None for r in report.kept)
    x = _ids(1, 3)
    for m in (model, ref, base):
        m.train()
        m(input_ids=x, labels=x).loss.backward()
    for (name, p), p_ref, p_base in zip(model.named_parameters(), ref.parameters(), base.parameters(), strict=True):
        assert_close(f"grad {name}", p.grad, p_ref.grad, p_base.grad)


def test_include_exclude():
    model = llama()
    report = fuseformer.optimize(model, exclude=["linear"], include=["linear", "norm"])
    assert set(report.counts()) == {"norm"} and not any(type(m) is Linear for m in model.modules())
    report.revert()
    report = fuseformer.optimize(model, include=["linear"])
    assert set(report.counts()) == {"linear"} and not report.skipped


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_no_candidates_off_fp32(dtype):
    model = llama().to(dtype)
    report = fuseformer.optimize(model, include=["linear"])
    assert report.replacements == []
    (skip,) = [s for s in report.skipped if s.kind == "linear"]  # one line, not one per linear
    assert skip.path == "" and str(dtype) in skip.reason and "float32 on the CPU" in skip.reason
    assert not any(type(m) is Linear for m in model.modules())


def test_generate_same_greedy_tokens_and_the_gemm_form_taken(monkeypatch):
    model = llama()
    original = copy.deepcopy(model)
    report = fuseformer.optimize(model)
    assert "linear" in report.counts() and not report.reverted, report
    head_rows = []  # rows of x in F.linear calls with the LM head's weight (cpu_linear's fallback)
    real = tnf.linear

    def counting(x, w, b=None):
        if w.shape == (V, H):
            head_rows.append(x.numel() // H)
        return real(x, w, b)

    monkeypatch.setattr(tnf, "linear", counting)
    ids = torch.tensor([[5, 17, 33, 9, 71, 4]])
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    with torch.no_grad():
        want = original.generate(ids, **kw)
        # generate asks for the last position's logits only (logits_to_keep=1): 12 one-row products.
        assert head_rows == [1] * 12
        head_rows.clear()
        got = model.generate(ids, **kw)
    assert got.tolist() == want.tolist()
    assert len(set(want[0, ids.shape[1] :].tolist())) > 3  # a real sequence, not one token repeated
    assert head_rows == []  # every one ran cpu_linear's GEMM form


# ---------------------------------------------------------------------------------------------
# Any other module (FX pass)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("training", [False, True])
def test_plain_module(training):
    model = GeluMLP()
    ref, base = copy.deepcopy(model).double(), copy.deepcopy(model)
    before = _snapshot(model)
    report = fuseformer.optimize(model, training=training, sample_inputs=torch.randn(3, 24))
    assert sorted(_kinds(report, "linear")) == ["down", "up"] and not report.reverted, report
    assert type(model.up) is Linear and model.up is before["up"][0]
    for x in (torch.randn(1, 24), torch.randn(2, 5, 24)):
        x_ref = x.double()
        outs = []
        for m, inp in ((model, x), (ref, x_ref), (base, x)):
            inp = inp.clone().requires_grad_(training)
            y = m(inp)
            if training:
                y.backward(torch.ones_like(y))
            outs.append(y.detach())
        assert_close("y", *outs)
        if training:
            for (n, p), p_ref, p_base in zip(
                model.named_parameters(), ref.parameters(), base.parameters(), strict=True
            ):
                assert_close(f"grad {n}", p.grad, p_ref.grad, p_base.grad)
                p.grad = p_ref.grad = p_base.grad = None
    fuseformer.revert(model)
    assert _snapshot(model) == before


def test_fx_glu_keeps_its_linears_as_candidates():
    model = SwiGLU()
    ref, base = copy.deepcopy(model).double(), copy.deepcopy(model)
    x = torch.randn(2, 5, 24)
    report = fuseformer.optimize(model, sample_inputs=x)
    assert report.counts() == {"mlp": 1, "linear": 3}, report
    with torch.no_grad():
        for xi in (x, x[:1, :1]):  # the sample's shape; one row (cpu_linear's GEMM form)
            assert_close("y", model(xi), ref(xi.double()), base(xi))
    fuseformer.revert(model)
    assert all(type(m) is nn.Linear for m in (model.gate, model.up, model.down))


def test_what_is_left():
    class Sub(nn.Linear):
        pass

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.shared = nn.Linear(8, 8)
            self.again = self.shared  # one module at two paths
            self.sub = Sub(8, 8)  # a subclass: not ours to change
            self.t = nn.Linear(8, 8)
            self.t.weight = nn.Parameter(torch.randn(8, 8).t())  # a transposed weight
            self.w = nn.Linear(8, 8)
            self.w.forward = types.MethodType(nn.Linear.forward, self.w)  # an instance forward (a wrapper)

        def forward(self, x):
            return self.w(self.t(self.sub(self.again(self.shared(self.a(x))))))

    net = Net()
    report = fuseformer.optimize(net, include=["linear"], sample_inputs=torch.randn(2, 8))
    assert sorted(_kinds(report, "linear")) == ["a", "shared"]
    assert type(net.again) is Linear  # the same object
    skipped = {s.path: s.reason for s in report.skipped}
    assert "contiguous" in skipped["t"] and "instance" in skipped["w"] and "sub" not in skipped
    assert type(net.sub) is Sub


def test_a_failing_linear_is_reverted_alone(monkeypatch):
    """The verdict of one linear undoes that one only; every other replacement stays, whatever the order."""
    model = llama()
    ref, base = copy.deepcopy(model).double(), copy.deepcopy(model)
    target = model.model.layers[1].self_attn.o_proj
    good = Linear.forward
    monkeypatch.setattr(Linear, "forward", lambda self, x: good(self, x) * (1.5 if self is target else 1.0))
    report = fuseformer.optimize(model, include=["linear", "norm", "attention"])
    (bad,) = report.reverted
    assert bad.path == "model.layers.1.self_attn.o_proj" and type(target) is nn.Linear
    assert len(_kinds(report, "linear")) == 2 * 7 and report.counts()["norm"] == 2 * L + 1
    x = _ids(2, 9)
    with torch.no_grad():
        assert_close("logits", model(x).logits, ref(x).logits, base(x).logits)


def test_candidates_commute_with_the_other_kinds():
    """Each linear candidate touches its own instance's class only: applied and undone in any order
    against the HF pass's candidates, the model ends exactly as it was."""
    model = llama()
    before = _snapshot(model)
    from fuseformer.fusion import hf

    result = hf.find_candidates(model, training=False, kinds=frozenset({"norm", "attention"}))
    linear_pass.add_candidates(model, result)
    cands: list[Candidate] = result.candidates
    assert any(c.kind == "linear" for c in cands)
    for c in cands:
        c.apply()
    for c in cands[::2] + cands[1::2]:  # undo out of order
        c.undo()
        c.undo()  # idempotent
    assert _snapshot(model) == before
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_fp8_and_mlp_candidates_take_their_linears():
    model = llama()
    from fuseformer.fusion import fp8 as fp8_pass
    from fuseformer.fusion import hf

    result = hf.find_candidates(model, training=False, kinds=frozenset({"mlp"}))
    fp8_pass.add_candidates(model, result)  # the MLPs (Fp8GatedMLP) and q/k/v/o become FP8
    linear_pass.add_candidates(model, result)
    assert [c.path for c in result.candidates if c.kind == "linear"] == ["lm_head"]

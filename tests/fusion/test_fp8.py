"""``fuseformer.optimize(model, fp8=True)`` (fusion/fp8.py, the FP8 criterion of fusion/verify.py) on tiny
random models: Hugging Face Llama, Qwen2, Phi-3, GPT-2 and BERT built from configs, and modules written
in plain PyTorch. Most cases run the FP8 ops on their PyTorch reference (the interpreter is slow); the
first runs the default backend (the Triton interpreter on the CPU, the kernels on a GPU)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as tnf
from torch import nn

transformers = pytest.importorskip("transformers")

import fuseformer  # noqa: E402
from fuseformer.fusion import fp8 as fp8_pass  # noqa: E402
from fuseformer.layers import Linear  # noqa: E402
from fuseformer.layers.fp8 import FP8_DTYPE, Fp8GatedMLP, Fp8Linear  # noqa: E402
from fuseformer.ops import quantize_fp8_ref  # noqa: E402

COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=128,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def make(model_type: str = "llama", seed: int = 0, **extra) -> nn.Module:
    """A tiny causal LM whose blocks add to the residual stream a fraction of it (their weights 0.5 /
    sqrt(fan_in)), as in trained models, and whose logits are O(1)-O(10) (LM head 4 / sqrt(fan_in)), so
    that greedy choices are decisive rather than near-ties. (With the blocks at 1.5 / sqrt(fan_in) FP8
    moves these logits by ~14% and greedy tokens part ways within a few steps.)"""
    cfg = transformers.AutoConfig.for_model(model_type, **{**COMMON, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:
                std = 1.0 if "embed" in name else (4.0 if "lm_head" in name else 0.5) / math.sqrt(p.shape[1])
                p.copy_(torch.randn(p.shape) * std)
            elif "norm" not in name:
                p.copy_(0.3 * torch.randn(p.shape))
    return model.eval()


def ids(b: int, s: int) -> torch.Tensor:
    return torch.randint(3, 128, (b, s))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def fp8_rows(report) -> list:
    return [r for r in report.replacements if r.kind == "fp8"]


def test_llama_linears_fp8_lm_head_kept_outputs_within_bound():
    """Default backend: every projection of the blocks in e4m3, the MLP fusion kept as Fp8GatedMLP, the LM
    head and embeddings untouched; each FP8 layer within its documented tolerance; logits near the original."""
    model = make("llama")
    base = copy.deepcopy(model)
    head, embed = model.lm_head, model.model.embed_tokens
    # 66 tokens: past the 64 up to which CUDA runs the weight-only decode path, so W8A8 is judged there too.
    report = fuseformer.optimize(model, fp8=True, sample_inputs={"input_ids": ids(2, 33)})
    for layer in model.model.layers:
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            lin = getattr(layer.self_attn, name)
            assert isinstance(lin, Fp8Linear) and lin.weight.dtype == FP8_DTYPE
            assert lin.weight_scale.shape == (lin.out_features,) and lin.weight_scale.dtype == torch.float32
        mlp = layer.mlp
        assert isinstance(mlp, Fp8GatedMLP) and mlp.act == "silu"
        assert mlp.gate_up_proj.weight.shape == (192, 64) and mlp.gate_up_proj.weight.dtype == FP8_DTYPE
    # The head stays fp32 (on this CPU model the "linear" kind's layers.Linear, the same object: not FP8).
    assert model.lm_head is head and type(head) is Linear and head.weight.dtype == torch.float32
    assert model.model.embed_tokens is embed
    # Within the FP8 criterion, and each a real replacement (an error above the fp32 floor: FP8 rounding).
    rows = fp8_rows(report)
    assert len(rows) == 10 and all(r.status == "kept" for r in rows), report
    assert all(1e-5 < r.max_error <= r.tolerance for r in rows), report
    assert report.counts() == {"norm": 5, "attention": 2, "fp8": 10, "linear": 1}  # the MLPs are FP8, not "mlp"
    assert [r.path for r in report.replacements if r.kind == "linear"] == ["lm_head"]
    reasons = {s.path: s.reason for s in report.skipped if s.kind == "fp8"}
    assert "LM head" in reasons["lm_head"] and "lookup" in reasons["model.embed_tokens"]
    # What FP8 cost: about 1% of the logits, against the original's ~1e-7.
    assert 1e-3 < report.output_error < 0.05 and report.baseline_output_error < 1e-5
    text = str(report)
    assert "inference, fp8" in text and "Fp8GatedMLP (silu)" in text and "final output vs the float64" in text
    # The optimized model is the original computing W8A8 as written out here in PyTorch: each block
    # linear's weight rounded to e4m3 per output channel, its input to e4m3 per token.
    sim = copy.deepcopy(base)
    with torch.no_grad():
        for m in sim.model.layers.modules():
            if isinstance(m, nn.Linear):
                q, scale = quantize_fp8_ref(m.weight)  # (N, K), (N, 1)
                m.weight.copy_(q.float() * scale)
                m.register_forward_pre_hook(_round_input)
    x = ids(2, 20)
    with fuseformer.use_backend("reference"), torch.no_grad():
        got, want, simulated = model(x).logits, base(x).logits, sim(x).logits
    assert 1e-3 < rel(got, want) < 0.05
    assert rel(got, simulated) < 1e-5


def _round_input(module, args):
    q, scale = quantize_fp8_ref(args[0])
    return (q.float() * scale,)


@pytest.mark.parametrize("bug", ["output", "weight", "activation"])
def test_wrong_fp8_layer_is_reverted(monkeypatch, bug):
    """The criterion can fail: an FP8 layer 10% off, weights that are not the e4m3 rounding of the
    originals, or an Fp8GatedMLP with the wrong activation is reverted; the others are kept."""
    bad = "model.layers.0.mlp" if bug == "activation" else "model.layers.1.self_attn.q_proj"
    if bug == "activation":
        made = []

        def mlp(hidden, inter, act, **kw):  # the first MLP made (layer 0's) gets GELU instead of SiLU
            made.append(act)
            return Fp8GatedMLP(hidden, inter, "gelu" if len(made) == 1 else act, **kw)

        monkeypatch.setattr(fp8_pass, "Fp8GatedMLP", mlp)
    else:
        make_linear = fp8_pass._linear_candidate

        def linear_candidate(model, path, m, names):
            c = make_linear(model, path, m, names)
            if path == bad:
                c.apply()
                new = model.get_submodule(path)
                c.undo()
                if bug == "output":
                    new.forward = lambda x, f=new.forward: f(x) * 1.1
                else:
                    new.weight_scale.mul_(1.05)
            return c

        monkeypatch.setattr(fp8_pass, "_linear_candidate", linear_candidate)
    model = make("llama")
    original = model.get_submodule(bad)
    with fuseformer.use_backend("reference"):
        report = fuseformer.optimize(model, fp8=True)
    rows = {r.path: r for r in fp8_rows(report)}
    assert rows[bad].status == "reverted", report
    assert all(r.status == "kept" for p, r in rows.items() if p != bad), report
    assert model.get_submodule(bad) is original
    if bug == "weight":
        assert "not the e4m3 rounding" in rows[bad].note
    else:
        assert rows[bad].max_error > rows[bad].tolerance


def test_generate_after_fp8_mostly_matches():
    model = make("llama")
    base = copy.deepcopy(model)
    x = ids(4, 7)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    with fuseformer.use_backend("reference"):
        fuseformer.optimize(model, fp8=True, verify=False)
        got, want = model.generate(x, **kw)[:, 7:], base.generate(x, **kw)[:, 7:]
    assert got.shape == want.shape == (4, 12)
    # Greedy decoding parts ways after the first flip of a near tie; until then the tokens agree.
    assert torch.equal(got[:, 0], want[:, 0])
    assert (got == want).float().mean() >= 0.75, (got, want)


def test_revert_restores_modules_and_outputs_exactly():
    model = make("llama")
    x = ids(2, 11)
    layer = model.model.layers[0]
    q, mlp, gate = layer.self_attn.q_proj, layer.mlp, layer.mlp.gate_proj.weight
    with torch.no_grad():
        want = model(x).logits
    with fuseformer.use_backend("reference"):
        report = fuseformer.optimize(model, fp8=True)
        assert fuseformer.optimize(model, fp8=True) is report  # a second call changes nothing
        assert isinstance(model.model.layers[0].self_attn.q_proj, Fp8Linear)
        with pytest.raises(ValueError, match="already optimized with fp8=True"):
            fuseformer.optimize(model)
    assert fuseformer.revert(model) is True
    assert layer.self_attn.q_proj is q and layer.mlp is mlp and mlp.gate_proj.weight is gate
    assert not any(isinstance(m, (Fp8Linear, Fp8GatedMLP)) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(x).logits, want)
    assert fuseformer.revert(model) is False


def test_two_models_one_fp8_one_not():
    a, b = make("llama"), make("llama")
    base = copy.deepcopy(a)
    x = ids(2, 13)
    with fuseformer.use_backend("reference"):
        ra = fuseformer.optimize(a, fp8=True, verify=False)
        rb = fuseformer.optimize(b, verify=False)
        with torch.no_grad():
            la, lb, want = a(x).logits, b(x).logits, base(x).logits
    assert ra.fp8 and not rb.fp8 and "fp8" not in rb.counts()
    assert isinstance(a.model.layers[0].self_attn.q_proj, Fp8Linear)
    assert type(b.model.layers[0].self_attn.q_proj) is Linear  # not FP8: the "linear" kind (fp32 CPU model)
    assert "forward" in b.model.layers[0].mlp.__dict__  # b's MLP: fused_mlp (bf16 path), not FP8
    assert rel(lb, want) < 1e-5 < 1e-3 < rel(la, want) < 0.05


def test_fp8_argument_errors_leave_the_model_untouched():
    model = make("llama")
    before = list(model.named_modules())
    with pytest.raises(ValueError, match=r"fp8=True is for inference.*TrainConfig\(fp8=True\)"):
        fuseformer.optimize(model, fp8=True, training=True)
    model.train()
    with pytest.raises(ValueError, match=r"fp8.*train mode.*TrainConfig\(fp8=True\)"):
        fuseformer.optimize(model, fp8=True)
    for value in ("yes", 1, None):
        with pytest.raises(TypeError, match="fp8 must be a bool"):
            fuseformer.optimize(model, fp8=value, training=False)
    with pytest.raises(ValueError, match="include names 'fp8' but fp8 is False"):
        fuseformer.optimize(model, include=["fp8"], training=False)
    assert list(model.named_modules()) == before and fuseformer.revert(model) is False


@pytest.mark.parametrize("model_type", ["qwen2", "phi3"])
def test_bias_and_packed_forms(model_type):
    """Qwen2's q/k/v biases stay shared Parameters of the Fp8Linears; Phi-3's packed qkv_proj is one
    Fp8Linear and its MLP (gate_up_proj already packed, activation read from activation_fn) one
    Fp8GatedMLP."""
    model = make(model_type)
    attn = model.model.layers[0].self_attn
    bias = attn.q_proj.bias if model_type == "qwen2" else None
    with fuseformer.use_backend("reference"):
        report = fuseformer.optimize(model, fp8=True)
    assert all(r.status == "kept" for r in report.replacements), report
    if model_type == "qwen2":
        assert isinstance(attn.q_proj, Fp8Linear) and attn.q_proj.bias is bias
    else:
        assert isinstance(attn.qkv_proj, Fp8Linear) and attn.qkv_proj.weight.shape == (128, 64)
        mlp = model.model.layers[0].mlp
        assert isinstance(mlp, Fp8GatedMLP) and mlp.act == "silu"
    assert 1e-3 < report.output_error < 0.05


def test_not_multiple_of_16_skipped_and_mlp_fusion_kept():
    """intermediate 72: the MLP's linears cannot be FP8, so the MLP keeps its bf16 fusion ("mlp"); the
    attention projections (64 and 32 wide) are FP8."""
    model = make("llama", intermediate_size=72)
    with fuseformer.use_backend("reference"):
        report = fuseformer.optimize(model, fp8=True)
    skipped = {s.path: s.reason for s in report.skipped if s.kind == "fp8"}
    assert "not multiples of 16" in skipped["model.layers.0.mlp"]
    assert report.counts() == {"norm": 5, "mlp": 2, "attention": 2, "fp8": 8, "linear": 1}  # linear: lm_head
    assert type(model.model.layers[0].mlp.down_proj) is nn.Linear  # the "mlp" fusion's, not "linear"


def test_gpt2_conv1d_and_bert():
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=64)
    ).eval()
    bert = transformers.BertModel(
        transformers.BertConfig(
            hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128, vocab_size=128
        ),
        add_pooling_layer=True,
    ).eval()
    x = ids(2, 24)
    with fuseformer.use_backend("reference"), torch.no_grad():
        want = gpt2(x).logits
        rg = fuseformer.optimize(gpt2, fp8=True)
        rb = fuseformer.optimize(bert, fp8=True)
        got = gpt2(x).logits
    block = gpt2.transformer.h[0]
    for m in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
        assert isinstance(m, Fp8Linear) and m.weight.dtype == FP8_DTYPE
    assert block.attn.c_attn.weight.shape == (192, 64)  # Conv1D's (in, out) weight as (out, in)
    # Not FP8; on this fp32 CPU model the "linear" kind's layers.Linear.
    assert type(gpt2.lm_head) is Linear and gpt2.lm_head.weight is gpt2.transformer.wte.weight
    assert rg.counts()["linear"] == 1 and rb.counts()["linear"] == 1  # GPT-2's head, BERT's pooler.dense
    assert all(r.status == "kept" for r in rg.replacements + rb.replacements), (rg, rb)
    assert rg.counts()["fp8"] == 8 and 1e-3 < rel(got, want) < 0.05
    layer = bert.encoder.layer[0]
    for m in (layer.attention.self.query, layer.attention.output.dense, layer.intermediate.dense):
        assert isinstance(m, Fp8Linear)
    assert rb.counts()["fp8"] == 6
    # GPT-2's MLP fusion (c_fc into cuBLASLt's GELU epilogue) gives way to its FP8 c_fc, reported; BERT's erf
    # GELU has no MLP fusion.
    assert "mlp" not in rg.counts() and "mlp" not in rb.counts()
    assert {s.path: s.reason for s in rg.skipped if s.kind == "mlp"} == {
        f"transformer.h.{i}.mlp": f"transformer.h.{i}.mlp.c_fc is FP8 (fp8=True)" for i in range(2)
    }
    assert "outside the transformer blocks" in {s.path: s.reason for s in rb.skipped}["pooler.dense"]
    rg.revert()
    with torch.no_grad():
        assert torch.equal(gpt2(x).logits, want)


class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.side = nn.Linear(dim, 40)  # 40 wide: not a multiple of 16

    def forward(self, x):
        h = self.norm(x)
        return x + self.down(tnf.silu(self.gate(h)) * self.up(h)) + self.side(h).mean(-1, keepdim=True)


class _TinyLM(nn.Module):
    """A model in plain PyTorch (the FX pass): embedding, gated-MLP blocks, a norm, an LM head."""

    def __init__(self, vocab: int = 96, dim: int = 64, hidden: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(_Block(dim, hidden) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.embed(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def test_custom_modules_get_fp8_linears_through_the_generic_path():
    torch.manual_seed(0)
    lm = _TinyLM().eval()
    stack = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 48), nn.ReLU(), nn.Linear(48, 10)).eval()
    idx, x = torch.randint(0, 96, (2, 40)), torch.randn(3, 32, 32)
    with torch.no_grad():
        want_lm, want_stack = lm(idx), stack(x)
    with fuseformer.use_backend("reference"):
        r_lm = fuseformer.optimize(lm, fp8=True)
        r_stack = fuseformer.optimize(stack, fp8=True)
        with torch.no_grad():
            got_lm, got_stack = lm(idx), stack(x)
    for b in lm.blocks:
        assert all(isinstance(m, Fp8Linear) for m in (b.gate, b.up, b.down))
        assert type(b.side) is Linear  # not FP8; the "linear" kind's (an fp32 CPU model)
    assert type(lm.head) is Linear
    assert r_lm.counts()["fp8"] == 6 and r_lm.counts().get("mlp") == 2  # swiglu between the FP8 linears
    assert r_lm.counts()["linear"] == 3 and r_stack.counts()["linear"] == 1
    reasons = {s.path: s.reason for s in r_lm.skipped if s.kind == "fp8"}
    assert "vocabulary" in reasons["head"] and "not multiples of 16" in reasons["blocks.0.side"]
    assert isinstance(stack[0], Fp8Linear) and isinstance(stack[2], Fp8Linear) and type(stack[4]) is Linear
    assert all(r.status == "kept" for r in r_lm.replacements + r_stack.replacements), (r_lm, r_stack)
    assert 1e-3 < rel(got_lm, want_lm) < 0.05 and 1e-3 < rel(got_stack, want_stack) < 0.05
    r_lm.revert(), r_stack.revert()
    with torch.no_grad():
        assert torch.equal(lm(idx), want_lm) and torch.equal(stack(x), want_stack)


def test_cli_validate_fp8(tmp_path, capsys):
    from fuseformer.cli import main

    model = make("llama")
    model.config.architectures = ["LlamaForCausalLM"]
    model.save_pretrained(tmp_path)
    with fuseformer.use_backend("reference"):
        code = main(["validate", str(tmp_path), "--device", "cpu", "--fp8", "--max-new-tokens", "4"])
    text = capsys.readouterr().out
    assert code == 0, text
    assert "inference, fp8" in text and "Fp8GatedMLP" in text and "greedy generation, 4 tokens" in text

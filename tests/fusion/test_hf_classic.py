"""The GPT-2 / BERT / RoBERTa fusion pass (fusion/hf_classic.py) on tiny random transformers models:
outputs and gradients match the original under DESIGN.md §3, greedy generation gives the same
tokens (KV cache, left and right padding), padded encoder batches take the varlen path, the report
counts the expected replacements, state-dict names stay, and revert restores."""

import copy

import pytest
import torch

pytest.importorskip("transformers")

import torch.nn.functional as tnf  # noqa: E402
import transformers  # noqa: E402
from transformers import (  # noqa: E402
    BertConfig,
    BertForMaskedLM,
    BertModel,
    GPT2Config,
    GPT2LMHeadModel,
    RobertaConfig,
    RobertaModel,
)

import fuseformer  # noqa: E402
import fuseformer.ops as F  # noqa: E402
from fuseformer.fusion import hf_classic  # noqa: E402
from fuseformer.testing import assert_close  # noqa: E402

V, H, L, NH = 128, 64, 2, 4


def _gpt2(dropout: float = 0.0, **kw) -> GPT2LMHeadModel:
    cfg = GPT2Config(
        vocab_size=V, n_embd=H, n_layer=L, n_head=NH, n_positions=64, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, **kw,
    )  # fmt: skip
    return GPT2LMHeadModel(cfg).eval()


def _bert_config(cls, dropout: float = 0.0, **kw):
    return cls(
        vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=NH, intermediate_size=2 * H,
        max_position_embeddings=64, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout, pad_token_id=1,
        **kw,
    )  # fmt: skip


def _encoder(kind: str, dropout: float = 0.0, **kw):
    if kind == "bert":
        return BertModel(_bert_config(BertConfig, dropout, **kw)).eval()
    if kind == "bert_mlm":
        return BertForMaskedLM(_bert_config(BertConfig, dropout, **kw)).eval()
    return RobertaModel(_bert_config(RobertaConfig, dropout, **kw)).eval()


def _padded(b: int = 3, s: int = 11, left: bool = False):
    """Token ids (B, S) and a padding mask: row 0 full, the others 3 and 6 short (right or left)."""
    ids = torch.randint(3, V, (b, s))
    mask = torch.ones(b, s, dtype=torch.long)
    for i in range(1, b):
        n = 3 * i
        if left:
            mask[i, :n] = 0
        else:
            mask[i, s - n :] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def _out(o):
    return o.logits if hasattr(o, "logits") and o.logits is not None else o.last_hidden_state


def _check(original, fused, kwargs, keep=None, grads=True):
    """Fused output and parameter gradients against the fp64 copy, with the original fp32 model as
    the §3 baseline. ``keep`` (B, S) bool: the positions compared (padding is unspecified)."""
    ref = copy.deepcopy(original).double()
    probe = None
    results = []
    for m in (fused, original, ref):
        m.zero_grad(set_to_none=True)
        out = _out(m(**kwargs))
        if probe is None:
            probe = torch.randn(out.shape, dtype=torch.float64)
            if keep is not None:
                probe = probe * keep[..., None]
        if grads:
            (out.double() * probe).sum().backward()
        sel = out if keep is None else out[keep]
        results.append((sel.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (out, g), (base, gb), (r, gr) = results
    assert_close("output", out, r, base)
    if grads:
        assert g.keys() == gb.keys() and g
        for n in g:
            assert_close(f"grad {n}", g[n], gr[n], gb[n])


def _optimized(model, **kw):
    fused = copy.deepcopy(model)
    report = fuseformer.optimize(fused, **kw)
    return fused, report


def _count(report, kind, status="kept"):
    return sum(r.kind == kind and r.status == status for r in report.replacements)


# ---------------------------------------------------------------------------------------------
# GPT-2
# ---------------------------------------------------------------------------------------------
def test_gpt2_report_and_logits_grads():
    model = _gpt2()
    fused, report = _optimized(model)
    # ln_2 + add per block, ln_1 per block, ln_f; one attention and one MLP (c_fc + gelu_new) per block.
    assert _count(report, "norm") == 2 * L + 1
    assert _count(report, "attention") == L
    assert _count(report, "mlp") == L
    assert not [r for r in report.replacements if r.status != "kept"]
    assert not [s for s in report.skipped if s.kind == "mlp"]
    assert "GELU (tanh) epilogue" in [r for r in report.replacements if r.kind == "mlp"][0].replacement
    block = fused.transformer.h[0]
    assert "forward" in block.__dict__ and isinstance(fused.transformer.ln_f, fuseformer.layers.LayerNorm)
    assert block.attn.config is not fused.config and block.attn.config._attn_implementation == "fuseformer"
    ids, mask = _padded(left=True)
    _check(model, fused, {"input_ids": ids, "attention_mask": mask}, keep=mask.bool())
    ids = torch.randint(0, V, (2, 13))
    _check(model, fused, {"input_ids": ids})


def test_gpt2_training_loss_and_grads():
    model = _gpt2()
    fused, report = _optimized(model, training=True)
    assert _count(report, "loss") == 1 and _count(report, "attention") == L and _count(report, "norm") == 2 * L + 1
    ids = torch.randint(0, V, (2, 12))
    losses, grads = [], []
    for m in (fused, model, copy.deepcopy(model).double()):
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert_close("loss", losses[0], losses[2], losses[1])
    for n in grads[1]:
        assert_close(f"grad {n}", grads[0][n], grads[2][n], grads[1][n])


def test_gpt2_training_skips_attention_with_dropout():
    report = fuseformer.optimize(_gpt2(dropout=0.1), training=True)
    assert _count(report, "attention") == 0
    assert sum(s.kind == "attention" and "dropout" in s.reason for s in report.skipped) == L


@pytest.mark.parametrize("left", [True, False], ids=["left_pad", "right_pad"])
def test_gpt2_generate_same_tokens(left):
    model = _gpt2()
    fused, _ = _optimized(model)
    ids, mask = _padded(s=7, left=left)
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0, use_cache=True)
    want = model.generate(ids, **kw)
    got = fused.generate(ids, **kw)
    assert torch.equal(got, want)


def test_gpt2_dropout_keeps_its_meaning():
    """In train mode (dropout on) the fused blocks consume the RNG as the original does."""
    model = _gpt2(dropout=0.2)
    fused, _ = _optimized(model)  # inference replacements, then trained: attention falls back
    model.train(), fused.train()
    ids = torch.randint(0, V, (2, 9))
    torch.manual_seed(5)
    want = model(input_ids=ids).logits
    torch.manual_seed(5)
    got = fused(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# BERT / RoBERTa
# ---------------------------------------------------------------------------------------------
def _spy_flash(monkeypatch):
    calls = []
    real = F.flash_attention

    def spy(*args, **kwargs):
        calls.append("varlen" if kwargs.get("cu_seqlens_q") is not None else "dense")
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_classic.F, "flash_attention", spy)
    return calls


@pytest.mark.parametrize("kind", ["bert", "bert_mlm", "roberta"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_encoder_padded_outputs_and_grads(kind, impl, monkeypatch):
    model = _encoder(kind)
    model.config._attn_implementation = impl  # the mask the model builds: sdpa's bool or eager's float
    fused, report = _optimized(model)
    heads = 1 if kind == "bert_mlm" else 0  # the MLM head's transform.LayerNorm
    assert _count(report, "norm") == 2 * L + 1 + heads  # two post-LN adds a layer, embeddings
    assert _count(report, "attention") == L
    # erf GELU: no fused form faster than cuBLAS + GELU; the MLPs stay, with the reason.
    assert _count(report, "mlp") == 0
    assert sum(s.kind == "mlp" and "no fused form" in s.reason for s in report.skipped) == L
    assert not [r for r in report.replacements if r.status != "kept"]
    last_attention = [r for r in report.replacements if r.kind == "attention"][-1]
    assert isinstance(fused.get_submodule(last_attention.path).config, type(model.config))
    calls = _spy_flash(monkeypatch)
    ids, mask = _padded()
    _check(model, fused, {"input_ids": ids, "attention_mask": mask}, keep=mask.bool())
    assert calls and set(calls) == {"varlen"}
    calls.clear()
    _check(model, fused, {"input_ids": ids[:, :5]})  # no padding: the batched kernel
    assert calls and set(calls) == {"dense"}


def test_encoder_pad_positions_match_too():
    """Pad queries attend to the real tokens, as transformers' sdpa gives them."""
    model = _encoder("bert")
    fused, _ = _optimized(model)
    ids, mask = _padded(left=True)
    with torch.no_grad():
        torch.testing.assert_close(
            fused(input_ids=ids, attention_mask=mask).last_hidden_state,
            model(input_ids=ids, attention_mask=mask).last_hidden_state,
            rtol=1e-4,
            atol=1e-4,
        )


def test_encoder_training_report():
    report = fuseformer.optimize(_encoder("bert", dropout=0.1), training=True)
    assert _count(report, "norm") == 2 * L + 1 and _count(report, "attention") == 0
    assert _count(report, "loss") == 0 and _count(report, "mlp") == 0
    assert {s.kind for s in report.skipped} == {"mlp", "attention", "loss"}


def test_encoder_dropout_keeps_its_meaning():
    model = _encoder("bert", dropout=0.2)
    fused, _ = _optimized(model)
    model.train(), fused.train()
    ids, mask = _padded()
    torch.manual_seed(3)
    want = model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.manual_seed(3)
    got = fused(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_encoder_attention_mask_that_is_not_padding_falls_back():
    """A 4D mask whose rows differ is no padding mask: transformers' sdpa runs it."""
    b, h, s, d = 2, 2, 6, 8
    q, k, v = (torch.randn(b, h, s, d) for _ in range(3))
    mask = torch.rand(b, 1, s, s) > 0.3
    mask[..., 0] = True
    module = torch.nn.Module()
    module.is_causal = False
    out, _ = hf_classic.encoder_attention(module, q, k, v, mask, scaling=d**-0.5)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(out, want)
    bias = torch.randn(b, 1, 1, s)  # an additive float mask that is not 0 / -inf: not padding either
    out, _ = hf_classic.encoder_attention(module, q, k, v, bias, scaling=d**-0.5)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_encoder_attention_varlen_kernel(dtype):
    """The attention function on its own, fp16 through the Triton kernel (the interpreter on CPU):
    padded keys drop out, every query (pads included) sees the real keys."""
    b, h, s, d = 3, 2, 9, 16
    q, k, v = (torch.randn(b, h, s, d, dtype=torch.float64) for _ in range(3))
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[1, 6:] = False
    keep[2, :4] = False
    mask4 = keep[:, None, None, :].expand(b, 1, s, s)
    module = torch.nn.Module()
    module.is_causal = False
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask4).transpose(1, 2)
    base = torch.nn.functional.scaled_dot_product_attention(
        q.to(dtype).float(), k.to(dtype).float(), v.to(dtype).float(), attn_mask=mask4
    ).to(dtype)
    for mask in (mask4, keep.long()):  # sdpa's 4D form and flash-attention-2's 2D form
        out, _ = hf_classic.encoder_attention(module, q.to(dtype), k.to(dtype), v.to(dtype), mask, scaling=d**-0.5)
        assert out.dtype == dtype
        assert_close("attention", out, ref, base.transpose(1, 2))


# ---------------------------------------------------------------------------------------------
# State dict, revert, what is left
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gpt2", "bert_mlm"])
def test_save_pretrained_keeps_names(kind, tmp_path):
    model = _gpt2() if kind == "gpt2" else _encoder(kind)
    fused, report = _optimized(model)
    assert report.replacements
    assert list(fused.state_dict()) == list(model.state_dict())
    fused.save_pretrained(tmp_path / "fused")
    model.save_pretrained(tmp_path / "orig")
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "fused" / "model.safetensors"), load_file(tmp_path / "orig" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    loaded = type(model).from_pretrained(tmp_path / "fused").eval()
    ids = torch.randint(3, V, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(_out(loaded(input_ids=ids)), _out(model(input_ids=ids)))


@pytest.mark.parametrize("kind", ["gpt2", "roberta"])
def test_revert_restores(kind):
    model = _gpt2() if kind == "gpt2" else _encoder(kind)
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    report = fuseformer.optimize(model)
    assert report.replacements
    assert fuseformer.optimize(model) is report  # a second optimize is a no-op
    report.revert()
    assert dict(model.named_modules()).keys() == modules.keys()
    assert all(m is modules[n] for n, m in model.named_modules())
    assert all(p is params[n] for n, p in model.named_parameters())
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert all(getattr(m, "config", model.config) is model.config for m in model.modules())


def test_include_kinds_and_two_models():
    a, b = _encoder("bert"), _encoder("bert")
    ra = fuseformer.optimize(a, include=["norm"])
    rb = fuseformer.optimize(b, include=["attention"])
    assert {r.kind for r in ra.replacements} == {"norm"} and {r.kind for r in rb.replacements} == {"attention"}
    assert a.encoder.layer[0].attention.self.config is a.config
    assert "forward" not in b.encoder.layer[0].output.__dict__


def test_other_model_type_is_skipped_not_fatal():
    model = torch.nn.Linear(4, 4)
    model.config = transformers.PretrainedConfig()
    result = hf_classic.find_candidates(model, training=False, kinds=frozenset({"norm"}))
    assert not result.candidates and result.skipped


@pytest.mark.parametrize("act", ["gelu_new", "gelu", "silu", "relu"])
def test_encoder_mlp_activations(act, monkeypatch):
    """A *Intermediate with GELU's tanh form becomes one GEMM with the bias + GELU epilogue where that applies
    (CUDA fp16/bf16 inference: forced here, torch._addmm_activation spied); other activations stay, with the
    reason; training leaves them all."""
    model = _encoder("bert", hidden_act=act)
    fused, report = _optimized(model)
    mlps = [r for r in report.replacements if r.kind == "mlp"]
    if act != "gelu_new":
        assert not mlps
        assert all("no fused form" in s.reason for s in report.skipped if s.kind == "mlp")
        return
    assert [r.status for r in mlps] == ["kept"] * L
    calls = []

    def addmm_activation(bias, x, w, use_gelu=False):
        calls.append((tuple(x.shape), tuple(w.shape), use_gelu))
        return tnf.gelu(torch.addmm(bias, x, w), approximate="tanh")

    monkeypatch.setattr(hf_classic, "_epilogue_applies", lambda x, *p: True)
    monkeypatch.setattr(torch, "_addmm_activation", addmm_activation)
    ids, mask = _padded()
    _check(model, fused, {"input_ids": ids, "attention_mask": mask}, keep=mask.bool(), grads=False)
    assert calls and {c[1:] for c in calls} == {((H, 2 * H), True)} and calls[0][0] == (ids.numel(), H)
    training = fuseformer.optimize(_encoder("bert", hidden_act=act), training=True)
    assert "no backward" in next(s.reason for s in training.skipped if s.kind == "mlp")


def test_epilogue_applies_only_to_cuda_half_inference():
    x = torch.randn(2, 4)
    w = torch.randn(4, 3, requires_grad=True)
    assert not hf_classic._epilogue_applies(x, w)  # CPU (where _addmm_activation computes erf GELU)
    if torch.cuda.is_available():
        xc, wc = x.cuda().half(), w.detach().cuda().half()
        assert hf_classic._epilogue_applies(xc, wc)
        assert not hf_classic._epilogue_applies(xc.float(), wc)
        assert not hf_classic._epilogue_applies(xc, wc.requires_grad_())
        with torch.no_grad():
            assert hf_classic._epilogue_applies(xc, wc)


def test_encoder_unpadded_runs_sdpa_where_faster(monkeypatch):
    """Where SDPA's kernel is the faster for an unpadded batch (_sdpa_faster: CUDA at head dim <= 64, here
    forced on the CPU), the encoder's attention runs transformers' SDPA; padded batches stay varlen."""
    model = _encoder("bert")
    fused, _ = _optimized(model)
    monkeypatch.setattr(hf_classic, "_sdpa_faster", lambda q: True)
    calls = _spy_flash(monkeypatch)
    ids, mask = _padded()
    _check(model, fused, {"input_ids": ids[:, :5]})
    assert not calls
    _check(model, fused, {"input_ids": ids, "attention_mask": mask}, keep=mask.bool())
    assert calls and set(calls) == {"varlen"}

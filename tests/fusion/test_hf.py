"""The Hugging Face pass (fusion/hf.py, hf_attention.py) on tiny random models of each architecture.

Models are built from configs by ``model_type`` (AutoConfig.for_model), so no model class is
imported by name. Numbers are judged by DESIGN.md §3 (fuseformer.testing.assert_close): the
optimized fp32 model against a float64 copy of the original, with the original fp32 as baseline.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fuseformer  # noqa: E402
from fuseformer.fusion import hf, hf_attention  # noqa: E402
from fuseformer.testing import assert_close, max_err, tolerance  # noqa: E402

ALL = frozenset({"norm", "mlp", "attention", "loss"})
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
# model_type -> extra config; sliding windows of 8 so that the windows bite at these lengths.
ARCHS = {
    "llama": {},
    "mistral": {"sliding_window": 8},
    "qwen2": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    "qwen3": {},
    "gemma": {},
    "gemma2": {"sliding_window": 8},
    "gemma3_text": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    "phi3": {},
}
# Per model (2 layers): norms (2 fused residual layers + 2 input norms + final norm, + q/k norms,
# + Gemma 2/3's post-attention and post-feedforward norms), MLPs, attention modules.
EXPECTED = {
    "llama": (5, 2, 2),
    "mistral": (5, 2, 2),
    "qwen2": (5, 2, 2),
    "qwen3": (9, 2, 2),
    "gemma": (5, 2, 2),
    "gemma2": (9, 2, 2),
    "gemma3_text": (13, 2, 2),
    "phi3": (5, 2, 2),
}


def make(model_type: str, **extra) -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(model_type, **{**COMMON, **ARCHS[model_type], **extra})
    torch.manual_seed(0)
    # Gemma 2 has no sdpa path: eager, whose additive float masks hf_attention reads too.
    impl = "eager" if model_type == "gemma2" else "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).float()
    with torch.no_grad():  # Gemma norms start at 0 (scale 1): make every weight count
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(0.0, 0.2).add_(0.0 if model_type.startswith("gemma") else 1.0)
    return model.eval()


def fuse(model, training: bool, kinds=ALL):
    result = hf.find_candidates(model, training=training, kinds=kinds)
    for c in result.candidates:
        c.apply()
    return result


def counts(result) -> tuple[int, int, int]:
    return tuple(sum(c.kind == k for c in result.candidates) for k in ("norm", "mlp", "attention"))


def ids(b: int, s: int) -> torch.Tensor:
    return torch.randint(3, 128, (b, s))


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_logits_and_grads(model_type):
    model = make(model_type)
    ref = copy.deepcopy(model).double()
    base = copy.deepcopy(model)
    result = fuse(model, training=True)
    assert counts(result) == EXPECTED[model_type], result.skipped
    x = ids(2, 13)
    labels = x.clone()
    labels[0, :4] = -100
    for m in (model, ref, base):
        m.train()
        out = m(input_ids=x, labels=labels)
        out.loss.backward()
        m.out = out
    if any(c.kind == "loss" for c in result.candidates):
        assert model.out.logits is None  # fused loss: no full logits
    assert_close("loss", model.out.loss, ref.out.loss, base.out.loss)
    for (name, p), p_ref, p_base in zip(model.named_parameters(), ref.parameters(), base.parameters()):
        assert_close(f"grad {name}", p.grad, p_ref.grad, p_base.grad)
    model.eval(), ref.eval(), base.eval()
    with torch.no_grad():
        assert_close("logits", model(x).logits, ref(x).logits, base(x).logits)


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_inference_packing_and_padding(model_type):
    model = make(model_type)
    ref = copy.deepcopy(model).double()
    base = copy.deepcopy(model)
    names = list(model.state_dict())
    result = fuse(model, training=False)
    assert counts(result) == EXPECTED[model_type]
    assert list(model.state_dict()) == names
    if model_type != "phi3":  # gate/up are views of one packed storage
        mlp = model.model.layers[0].mlp
        assert mlp.gate_proj.weight.untyped_storage().data_ptr() == mlp.up_proj.weight.untyped_storage().data_ptr()
    x = ids(3, 17)
    mask = torch.ones_like(x)
    mask[0, :5] = 0  # left padding
    mask[1, 12:] = 0  # right padding
    with torch.no_grad():
        out = model(x, attention_mask=mask).logits
        r = ref(x, attention_mask=mask).logits
        bl = base(x, attention_mask=mask).logits
    real = mask.bool()
    assert_close("logits (padded)", out[real], r[real], bl[real])


@pytest.mark.parametrize("model_type", list(ARCHS))
def test_generate(model_type):
    """Masks, padding and the KV cache are hf_attention's logic; the kernels run on the reference here
    (the interpreter makes 12 decode steps of every norm and MLP slow) and are judged above."""
    model = make(model_type)
    base = copy.deepcopy(model)
    fuse(model, training=False)
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    with fuseformer.use_backend("reference"):
        _generate_cases(model, base, kw)


def _generate_cases(model, base, kw):
    x = ids(3, 9)
    # One sequence with the KV cache (12 steps pass the sliding window of 8).
    assert torch.equal(model.generate(x[:1], **kw), base.generate(x[:1], **kw))
    left = torch.ones_like(x)
    left[0, :4] = 0
    left[1, :2] = 0
    xl = x.masked_fill(left == 0, 0)
    assert torch.equal(model.generate(xl, attention_mask=left, **kw), base.generate(xl, attention_mask=left, **kw))
    # Right padding: transformers appends after the pads; the same tokens must come out.
    right = torch.ones_like(x)
    right[0, 6:] = 0
    xr = x.masked_fill(right == 0, 0)
    assert torch.equal(model.generate(xr, attention_mask=right, **kw), base.generate(xr, attention_mask=right, **kw))


# The "linear" kind on these fp32 CPU models (fusion/linear.py): the attention projections (q/k/v/o, or
# Phi-3's qkv/o) of the 2 layers and the LM head; the MLPs' linears are the "mlp" fusion's.
LINEARS = {"llama": 2 * 4 + 1, "gemma3_text": 2 * 4 + 1, "phi3": 2 * 2 + 1}


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "phi3"])
def test_optimize_report_and_revert(model_type):
    model = make(model_type)
    base = copy.deepcopy(model)
    x = ids(2, 16)
    report = fuseformer.optimize(model, training=False, sample_inputs={"input_ids": x})
    kept = [r for r in report.replacements if r.status == "kept"]
    n_norm, n_mlp, n_attn = EXPECTED[model_type]
    assert len(kept) == n_norm + n_mlp + n_attn + LINEARS[model_type], report
    assert report.counts()["linear"] == LINEARS[model_type]
    assert any(s.kind == "loss" for s in report.skipped)
    report.revert()
    with torch.no_grad():
        assert torch.equal(model(x).logits, base(x).logits)
    assert "forward" not in model.model.layers[0].__dict__
    assert model.model.layers[0].self_attn.config is model.config
    assert all(type(m) is not fuseformer.layers.Linear for m in model.modules())


def test_gemma2_soft_caps_skip_nothing():
    model = make("gemma2")
    assert model.config.attn_logit_softcapping and model.config.final_logit_softcapping
    result = hf.find_candidates(model, training=True, kinds=ALL)
    assert not result.skipped and {c.kind for c in result.candidates} == {"norm", "mlp", "attention", "loss"}


def test_gemma2_attention_softcap_fused():
    """An attention cap of 1 (it bites: without it the logits move far past the tolerance) through our
    kernel, forward and backward, and a final cap of 0.2 through the fused loss; greedy generate over a
    left-padded batch (the varlen path, then soft-capped decode steps) gives HF's tokens. Padding's own
    numbers: test_inference_packing_and_padding."""
    model, uncapped = (make("gemma2", attn_logit_softcapping=c, final_logit_softcapping=0.2) for c in (1.0, None))
    with torch.no_grad():  # scores of several units (the init's are ~0.01, where tanh changes nothing)
        for m in (model, uncapped):
            for name, p in m.named_parameters():
                if name.endswith(("q_proj.weight", "k_proj.weight")):
                    p.mul_(30.0)
    ref, base = copy.deepcopy(model).double(), copy.deepcopy(model)
    assert counts(fuse(model, training=True)) == (9, 2, 2)
    x = ids(2, 13)
    for m in (model, ref, base):
        m.train()
        m.loss = m(input_ids=x, labels=x).loss
        m.loss.backward()
    assert_close("loss", model.loss, ref.loss, base.loss)
    for (name, p), p_ref, p_base in zip(model.named_parameters(), ref.parameters(), base.parameters()):
        assert_close(f"grad {name}", p.grad, p_ref.grad, p_base.grad)
    mask = torch.ones_like(x)
    mask[0, :5] = 0
    with torch.no_grad():
        for m in (model, ref, base, uncapped):
            m.eval()
            m.out = m(input_ids=x).logits
        gen = [m.generate(x, attention_mask=mask, max_new_tokens=4, do_sample=False) for m in (model, base)]
    assert_close("logits", model.out, ref.out, base.out)
    assert max_err(uncapped.out, ref.out) > 100 * tolerance(ref.out, base.out, torch.float32)
    assert torch.equal(gen[0], gen[1])


def test_only_requested_kinds_and_instance_only():
    a, b = make("llama"), make("llama")
    result = fuse(a, training=False, kinds=frozenset({"attention"}))
    assert {c.kind for c in result.candidates} == {"attention"}
    assert a.model.layers[0].self_attn.config._attn_implementation == "fuseformer"
    assert a.config._attn_implementation == "sdpa"
    assert b.model.layers[0].self_attn.config._attn_implementation == "sdpa"
    assert "forward" not in b.model.layers[0].mlp.__dict__


def test_not_ours():
    assert hf.find_candidates(torch.nn.Linear(2, 2), training=False, kinds=ALL) is None


def test_num_items_in_batch():
    model = make("llama")
    base = copy.deepcopy(model)
    fuse(model, training=True)
    x = ids(2, 10)
    labels = x.clone()
    labels[1, 5:] = -100
    n = torch.tensor(23)
    out = model(input_ids=x, labels=labels, num_items_in_batch=n)
    want = base(input_ids=x, labels=labels, num_items_in_batch=n)
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert out.logits is None
    # return_dict=False gives a tuple with the loss first, as transformers does.
    assert torch.allclose(
        model(input_ids=x, labels=labels, return_dict=False)[0], base(input_ids=x, labels=labels).loss
    )
    assert model(input_ids=x).logits.shape == (2, 10, 128)  # no labels: the class's forward


def test_gradient_checkpointing():
    model = make("llama")
    base = copy.deepcopy(model)
    fuse(model, training=True)
    for m in (model, base):
        # 5.25 renamed it activation_checkpointing_enable; 5.17 has only the old name.
        getattr(m, "activation_checkpointing_enable", m.gradient_checkpointing_enable)()
        m.train()
    x = ids(2, 12)
    lm, lb = model(input_ids=x, labels=x).loss, base(input_ids=x, labels=x).loss
    lm.backward(), lb.backward()
    torch.testing.assert_close(lm, lb, rtol=1e-4, atol=1e-5)
    for p, q in zip(model.parameters(), base.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-3, atol=1e-5)


def test_save_pretrained_names(tmp_path):
    model = make("qwen3")
    names = set(model.state_dict())
    fuse(model, training=False)
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "model.safetensors"))
    assert set(saved) == names
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    x = ids(1, 8)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, rtol=1e-4, atol=1e-5)


def test_torch_compile():
    model = make("llama")
    fuse(model, training=False)
    x = ids(2, 12)
    with torch.no_grad():
        want = model(x).logits
        compiled = torch.compile(model, backend="aot_eager", fullgraph=False)
        torch.testing.assert_close(compiled(x).logits, want, rtol=1e-4, atol=1e-5)
        explained = torch._dynamo.explain(model)(x)
    # No break at our ops. transformers 5.25 passes no mask here (unpadded, causal): one graph.
    # 5.17 passes a 4D causal mask under compile, whose reduction (hf_attention._plan_4d) reads it.
    for r in explained.break_reasons:
        frames = [f.name for f in r.user_stack]
        assert any("_plan" in name for name in frames), (str(r.reason), frames)


def test_attention_function_masks():
    """hf_attention reads sdpa's boolean and eager's additive masks: causal, windowed, padded on
    either side, a cache (Sq < Sk); a mask of another shape (bidirectional) takes the exact
    reference. Against torch's SDPA with the same mask, on real rows."""
    from fuseformer.fusion.hf_attention import fuseformer_attention

    module = torch.nn.Module()
    module.is_causal = True
    b, hq, hkv, d, sk = 3, 4, 2, 16, 11
    module.num_key_value_groups = hq // hkv  # as HF attention modules have it (its SDPA path reads it)
    for sq, window, kind in [(11, None, "pad"), (11, 4, "pad"), (3, None, "pad"), (1, 4, "pad"), (11, None, "bidir")]:
        q = torch.randn(b, hq, sq, d)
        k, v = torch.randn(b, hkv, sk, d), torch.randn(b, hkv, sk, d)
        pos_q = torch.arange(sk - sq, sk)[:, None]
        pos_k = torch.arange(sk)[None, :]
        keys = torch.ones(b, sk, dtype=torch.bool)
        keys[0, :3] = False  # left padding
        keys[1, 8:] = False  # right padding
        allowed = pos_k <= pos_q if kind == "pad" else torch.ones(sq, sk, dtype=torch.bool)
        if window:
            allowed = allowed & (pos_k > pos_q - window)
        mask = allowed[None, None] & keys[:, None, None, :]  # (B, 1, Sq, Sk)
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=mask
        ).transpose(1, 2)
        rows = mask.any(-1)[:, 0]  # (B, Sq) rows that see a key
        for m in (mask, torch.where(mask, 0.0, torch.finfo(torch.float32).min)):
            out, _ = fuseformer_attention(module, q, k, v, m, scaling=d**-0.5, sliding_window=window)
            torch.testing.assert_close(out[rows], want[rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3"])
def test_rotary_fused_into_llama_family_attention(model_type, training):
    """Llama, Mistral, Qwen2 and Qwen3 attention modules get the rotary + attention forward (RoPE in one
    kernel per q and k), for inference and training alike; undo gives the class's own forward back."""
    model = make(model_type)
    result = hf.find_candidates(model, training=training, kinds=frozenset({"attention"}))
    attn = [c for c in result.candidates if c.kind == "attention"]
    assert attn and all(c.replacement.endswith("+ rotary") for c in attn)
    layer = model.model.layers[0].self_attn
    for c in attn:
        c.apply()
    assert layer.forward.__func__ is hf_attention.rotary_attention_forward
    for c in attn:
        c.undo()
    assert "forward" not in layer.__dict__ and "_fuseformer_rotary" not in layer.__dict__

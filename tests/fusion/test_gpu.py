"""optimize on a CUDA GPU, where the Triton kernels run in bf16 and fp16 at layer sizes of real
models (head dim 128, hidden 1024): every replacement passes verification, the optimized model's
logits and greedy tokens agree with the original's, and training gradients pass too."""

import copy

import pytest
import torch

import fuseformer
from fuseformer.testing import max_err, tolerance

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu


def _llama(dtype, **over):
    torch.manual_seed(0)
    cfg = dict(
        vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=2048, attn_implementation="sdpa",
    ) | over  # fmt: skip
    with torch.device("cuda"):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_llama_inference_all_kept_and_logits_within_tolerance(dtype):
    model = _llama(dtype).eval()
    ref = copy.deepcopy(model).double()
    ids = torch.randint(0, 1024, (2, 300), device="cuda")
    with torch.no_grad():
        base = model(input_ids=ids).logits
        want = ref(input_ids=ids).logits
    report = fuseformer.optimize(model)
    assert not report.reverted, str(report)
    assert {"norm", "mlp", "attention"} <= set(report.counts()), str(report)
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert max_err(got, want) <= tolerance(want, base, dtype)


def _stepwise_logits(m, ids, mask, tokens):
    """Last-position logits of a left-padded prefill, then of one cached decode step per token of
    ``tokens`` (teacher-forced: every model sees the same inputs), stacked (steps, B, V) in fp32."""
    out = m(input_ids=ids, attention_mask=mask, use_cache=True)
    steps, cache = [out.logits[:, -1].float()], out.past_key_values
    for t in range(tokens.shape[1] - 1):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
        out = m(input_ids=tokens[:, t : t + 1], attention_mask=mask, past_key_values=cache, use_cache=True)
        steps.append(out.logits[:, -1].float())
        cache = out.past_key_values
    return torch.stack(steps)


def test_llama_greedy_generate_with_left_padding():
    """generate() runs through the fused forward (rotary + attention, the cache update, HF's decode
    steps) and the first tokens agree; then the prefill and every cached decode step, teacher-forced on
    the original's tokens, give logits within DESIGN.md §3 of a float64 copy. Exact greedy tokens
    all the way are not the criterion: a random bf16 model's logits are nearly flat, and fp32 RoPE
    (HF rounds it in bf16) may part a near-tie."""
    model = _llama(torch.bfloat16).eval()
    original = copy.deepcopy(model)
    ref = copy.deepcopy(model).double()
    ids = torch.randint(3, 1024, (2, 40), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # left padding on the second row
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        want = original.generate(ids, **kw)
    report = fuseformer.optimize(model)
    assert any("rotary" in r.replacement for r in report.kept if r.kind == "attention"), str(report)
    with torch.no_grad():
        got = model.generate(ids, **kw)
        assert torch.equal(got[:, 40:42], want[:, 40:42])
        tokens = want[:, 40:]
        base = _stepwise_logits(original, ids, mask, tokens)
        exact = _stepwise_logits(ref, ids, mask, tokens)
        fused = _stepwise_logits(model, ids, mask, tokens)
    assert max_err(fused, exact) <= tolerance(exact, base, torch.bfloat16)


def test_llama_training_gradients_kept():
    model = _llama(torch.bfloat16).train()
    report = fuseformer.optimize(model, training=True)
    assert not report.reverted, str(report)
    assert "loss" in report.counts() and all(r.grad_error is not None for r in report.kept if r.kind != "loss")
    ids = torch.randint(0, 1024, (2, 256), device="cuda")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_bert_inference_with_padding_all_kept():
    torch.manual_seed(0)
    cfg = transformers.BertConfig(hidden_size=768, num_hidden_layers=2, num_attention_heads=12, intermediate_size=3072)
    with torch.device("cuda"):
        model = transformers.BertModel(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (4, 128), device="cuda")
    mask = torch.ones_like(ids)
    mask[2, 100:] = 0
    report = fuseformer.optimize(model, sample_inputs={"input_ids": ids, "attention_mask": mask})
    assert not report.reverted, str(report)
    assert report.counts().get("norm", 0) >= 4, str(report)


def test_gpt2_inference_mlp_epilogue_kept():
    """GPT-2's MLPs (gelu_new) in bf16 on CUDA: c_fc's GEMM with cuBLASLt's bias + GELU epilogue passes
    optimize's layer-by-layer check, and generation matches the original's first tokens."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=768, n_layer=2, n_head=12, vocab_size=1024, n_positions=256)
    with torch.device("cuda"):
        model = transformers.GPT2LMHeadModel(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, 1024, (2, 96), device="cuda")
    with torch.no_grad():
        want = model(input_ids=ids).logits
    report = fuseformer.optimize(model, sample_inputs={"input_ids": ids})
    assert not report.reverted and report.counts().get("mlp") == 2, str(report)
    calls = []
    real = torch._addmm_activation
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "_addmm_activation", lambda *a, **k: calls.append(1) or real(*a, **k))
        got = model(input_ids=ids).logits
    assert len(calls) == 2
    assert (got.float() - want.float()).abs().max() < 0.25 * want.float().abs().max()


@pytest.mark.parametrize("training", [False, True])
def test_gemma2_softcapped_attention_kept(training):
    """Gemma 2 at head dim 256 (its real one) with a cap that bites (q/k scaled up so the scores reach
    several units): the attention layers go through flash_attention's softcap, forward and backward, and
    pass optimize's check in bf16; the logits are within §3 of a float64 copy."""
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(
        vocab_size=1024, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=256, sliding_window=64, attn_logit_softcapping=5.0,
        attn_implementation="eager",
    )  # fmt: skip
    with torch.device("cuda"):
        model = transformers.Gemma2ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
    model.train(training)
    ref = copy.deepcopy(model).double().eval()
    ids = torch.randint(0, 1024, (2, 200), device="cuda")
    with torch.no_grad():
        base, want = model.eval()(input_ids=ids).logits, ref(input_ids=ids).logits
    model.train(training)
    report = fuseformer.optimize(model, training=training)
    assert not report.reverted, str(report)
    assert report.counts().get("attention") == 2, str(report)
    with torch.no_grad():
        got = model.eval()(input_ids=ids).logits
    assert max_err(got, want) <= tolerance(want, base, torch.bfloat16)

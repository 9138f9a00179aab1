"""Gemma and Gemma2 against transformers 5.25 on tiny random checkpoints (tests/models/conftest.py):
logits within the DESIGN.md §3 criterion (reference: the HF model in fp64; baseline: the HF model in
fp32), without cache and over the paged KV cache (prefill chunks, then decodes), gradients, and
greedy tokens equal to HF's ``generate``, by hand and through ``fuseformer.LLM``.

The Gemma2 checkpoint has 3 layers, a sliding window of 4 in layers 0 and 2, query_pre_attn_scalar
24 (not head_dim 16), and soft-caps low enough that they change the logits: sequences here are longer
than the window, and a test checks that each of these features moves the logits past the tolerance
(so a model that ignored one would fail)."""

import copy
import json
import shutil

import pytest
import torch

import fuseformer
from fuseformer.models.attention_metadata import AttentionMetadata
from fuseformer.models.loader import load_model
from fuseformer.testing import (
    assert_close,
    greedy_paged,
    hf_logits,
    hf_packed_grads,
    max_err,
    packed_logits,
    tolerance,
)

ARCHS = ["gemma", "gemma2"]


@pytest.mark.parametrize("name", ARCHS)
def test_logits_match_transformers(name, hf_checkpoint):
    path, hf = hf_checkpoint(name)
    model, config = load_model(path)
    assert type(model).__name__ == "GemmaForCausalLM" and config.hidden_act == "gelu_tanh"
    seqs = [torch.randint(0, config.vocab_size, (n,)) for n in (15, 7, 1)]  # 15 and 7: past the window
    for i, (ids, out) in enumerate(zip(seqs, packed_logits(model, seqs))):  # one varlen batch
        ref, base = hf_logits(hf, ids)
        assert_close(f"{name} logits of sequence {i}", out, ref, base)


@pytest.mark.parametrize(
    "change",
    [
        {"sliding_window": 1000},  # the window ignored
        {"attn_logit_softcapping": None},  # null turns a cap off (transformers reads it so too)
        {"final_logit_softcapping": None},
        {"query_pre_attn_scalar": 16},  # the head_dim scale
    ],
    ids=lambda c: next(iter(c)),
)
def test_each_gemma2_feature_changes_the_logits(change, hf_checkpoint, tmp_path):
    """The checkpoint exercises every Gemma2 feature: a model without one misses HF's logits by far
    more than the §3 tolerance the model above meets."""
    path, hf = hf_checkpoint("gemma2")
    changed = shutil.copytree(path, tmp_path / "changed")
    hf_config = json.loads((path / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps(hf_config | change))
    model, config = load_model(changed)
    key = next(iter(change))
    assert getattr(config, key) == (change[key] if key != "sliding_window" else 1000)
    ids = torch.randint(0, config.vocab_size, (15,))
    (out,) = packed_logits(model, [ids])
    ref, base = hf_logits(hf, ids)
    assert max_err(out, ref) > 100 * tolerance(ref, base, torch.float32), key


@pytest.mark.parametrize("name", ARCHS)
def test_paged_cache_logits_match_transformers(name, hf_checkpoint):
    """Every token's logits over the paged KV cache: prompts of 11 and 6 tokens prefilled in chunks of
    4 (each chunk attends to its cached prefix, past the window), a 1-token prompt, then 5 decode steps
    each; against HF on the whole sequence."""
    path, hf = hf_checkpoint(name)
    model, config = load_model(path)
    prompts = [torch.randint(0, config.vocab_size, (n,)).tolist() for n in (11, 6, 1)]
    outputs, logits = greedy_paged(model, prompts, 5, all_logits=True)
    for prompt, out, got in zip(prompts, outputs, logits):
        ids = torch.tensor(prompt + out[:-1])  # every token whose logits were computed
        ref, base = hf_logits(hf, ids)
        assert_close(f"{name} paged logits (prompt of {len(prompt)})", got, ref, base)


def _hf_greedy(hf, prompt, steps):
    hf.generation_config.eos_token_id = None  # decode all steps, as ours does
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


# The Triton kernels run interpreted on the CPU (~1 s a step): Gemma2 takes them (window, soft-caps).
@pytest.mark.parametrize("name, backend", [("gemma", "reference"), ("gemma2", "reference"), ("gemma2", "triton")])
def test_greedy_decoding_with_paged_cache_matches_generate(name, backend, hf_checkpoint):
    path, hf = hf_checkpoint(name)
    model, config = load_model(path)
    prompts = [torch.randint(0, config.vocab_size, (n,)).tolist() for n in (6, 9, 1)]
    with fuseformer.use_backend(backend):
        ours = greedy_paged(model, prompts, 6)
    for prompt, got in zip(prompts, ours):
        assert got == _hf_greedy(hf, prompt, 6), f"{name}: prompt {prompt}"


def test_llm_greedy_generate_matches_transformers(hf_checkpoint):
    """The engine end to end (scheduler, paged cache, sampler) on the Gemma2 checkpoint."""
    path, hf = hf_checkpoint("gemma2")
    prompts = [torch.randint(0, 128, (n,)).tolist() for n in (5, 11, 1)]
    params = fuseformer.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with fuseformer.use_backend("reference"):
        llm = fuseformer.LLM(path, num_kv_blocks=64, block_size=4, max_model_len=64)
        outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, 8), f"prompt {prompt}"


@pytest.mark.parametrize("name", ARCHS)
def test_gradients_match_transformers(name, hf_checkpoint):
    """Training path (no cache): every parameter's gradient (the four norms, tied or untied head, the
    gradients through both tanh caps) of a cross-entropy loss, §3 criterion."""
    path, hf = hf_checkpoint(name)
    model, config = load_model(path)
    model.train()
    ids = torch.randint(0, config.vocab_size, (11,))
    target = torch.randint(0, config.vocab_size, (11,))
    hidden = model(ids, torch.arange(11), AttentionMetadata.varlen([11]))
    torch.nn.functional.cross_entropy(model.compute_logits(hidden), target).backward()
    base = hf_packed_grads(hf, ids, target)
    ref = hf_packed_grads(copy.deepcopy(hf).double(), ids, target)
    hf.zero_grad()
    ours = {n: p.grad for n, p in model.named_parameters()}
    assert set(ours) == set(base), set(ours) ^ set(base)
    for n, g in ours.items():
        assert_close(f"{name} grad {n}", g, ref[n], base[n])


def test_bf16_embedding_scale_is_rounded_as_transformers_rounds_it(hf_checkpoint):
    """sqrt(hidden_size) is cast to the embedding's dtype before the product, as HF does (sqrt(3072) =
    55.4256 is 55.5 in bf16): the bf16 model's input hidden states equal HF's bit for bit."""
    path, hf = hf_checkpoint("gemma2")
    model, config = load_model(path, dtype=torch.bfloat16)
    ids = torch.arange(config.vocab_size)
    with torch.no_grad():
        expected = copy.deepcopy(hf.model.embed_tokens).to(torch.bfloat16)(ids[None])[0]
        got = model.model.embed(ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert model.model.embed_scale[torch.bfloat16] == 8.0 and 3072**0.5 != 55.5  # 64 is exact; 3072 is not
    assert torch.tensor(3072**0.5).to(torch.bfloat16).item() == 55.5


def test_paged_step_compiles_fullgraph(hf_checkpoint, compile_backend):
    """A Gemma2 step over the paged cache (prefill chunk + decode) traces whole: what CUDA graphs need."""
    path, _ = hf_checkpoint("gemma2")
    model, config = load_model(path)
    shape = (8, 4, config.num_key_value_heads, config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)]
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, 3, 4], dtype=torch.int32),
        max_seqlen_q=3,
        kv_caches=caches,
        context_lens=torch.tensor([3, 6], dtype=torch.int32),
        slot_mapping=torch.tensor([0, 1, 2, 21]),
        block_tables=torch.tensor([[0, 1], [4, 5]], dtype=torch.int32),
    )
    ids, positions = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 2, 5])

    def step(ids, positions, meta):
        return model.compute_logits(model(ids, positions, meta), torch.tensor([2, 3]))

    with torch.no_grad():
        eager = step(ids, positions, meta)
        compiled = torch.compile(step, fullgraph=True, backend=compile_backend)(ids, positions, meta)
    torch.testing.assert_close(compiled, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logits_gpu_half(name, dtype, hf_checkpoint):
    """On the GPU in half precision (the Triton kernels: flash_attention and paged_attention with the
    soft-cap): our logits against HF in fp64 on the same rounded weights, baseline HF in the same
    dtype; without cache and over the paged cache."""
    path, hf = hf_checkpoint(name)
    model, config = load_model(path, dtype=dtype, device="cuda")
    hf_half = copy.deepcopy(hf).to("cuda", dtype)
    hf64 = copy.deepcopy(hf_half).to(torch.float64)
    prompts = [torch.randint(0, config.vocab_size, (n,)).tolist() for n in (40, 97, 1)]
    outs = packed_logits(model, [torch.tensor(p, device="cuda") for p in prompts])
    _, paged = greedy_paged(model, prompts, 4, chunk=16, num_blocks=128, device="cuda", all_logits=True)
    for prompt, out, got in zip(prompts, outs, paged):
        ids = torch.tensor(prompt, device="cuda")
        with torch.no_grad():
            base, ref = hf_half(ids[None]).logits[0], hf64(ids[None]).logits[0]
        assert_close(f"{name} {dtype} logits", out, ref, base)
        n = len(prompt)  # the paged run's first n rows are the prompt's (its decodes follow)
        assert_close(f"{name} {dtype} paged logits", got[:n].cuda(), ref, base)

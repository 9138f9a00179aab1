"""The Llama-family model against transformers: logits within the DESIGN.md §3 criterion (reference:
the HF model in fp64; baseline: the HF model in fp32) and greedy decoding over a paged KV cache."""

import copy
import random

import pytest
import torch

import fuseformer
from fuseformer.models.llama import AttentionMetadata, rope_inv_freq
from fuseformer.models.loader import load_model
from fuseformer.testing import assert_close

ARCHS = ["llama3", "llama_linear_tied", "llama_dynamic", "mistral", "qwen2", "qwen3"]


def _hf_logits(hf, ids):
    """HF logits of one sequence: (reference in fp64, baseline in fp32), each (S, V)."""
    with torch.no_grad():
        base = hf(ids[None]).logits[0]
        hf.double()
        try:
            ref = hf(ids[None]).logits[0]
        finally:
            hf.float()
    return ref, base


def _ours(model, seqs):
    """Our logits for every token of the packed sequences ``seqs`` (no cache): list of (S_i, V)."""
    ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.no_grad():
        hidden = model(ids, positions, AttentionMetadata.varlen([len(s) for s in seqs]))
        logits = model.compute_logits(hidden)
    return list(logits.split([len(s) for s in seqs]))


@pytest.mark.parametrize("name", ARCHS)
def test_logits_match_transformers_single_sequence(name, hf_checkpoint):
    path, hf = hf_checkpoint(name)
    model, config = load_model(path)
    ids = torch.randint(0, config.vocab_size, (15,))  # past every window and the dynamic-rope length
    (out,) = _ours(model, [ids])
    ref, base = _hf_logits(hf, ids)
    assert_close(f"{name} logits", out, ref, base)


@pytest.mark.parametrize("name", ["llama3", "mistral", "qwen2", "qwen3"])
def test_logits_match_transformers_varlen_batch(name, hf_checkpoint):
    path, hf = hf_checkpoint(name)
    model, config = load_model(path)
    seqs = [torch.randint(0, config.vocab_size, (n,)) for n in (7, 13)]
    outs = _ours(model, seqs)
    for i, (ids, out) in enumerate(zip(seqs, outs)):
        ref, base = _hf_logits(hf, ids)
        assert_close(f"{name} logits of sequence {i}", out, ref, base)
    # compute_logits on the last rows only gives the same rows.
    ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.no_grad():
        hidden = model(ids, positions, AttentionMetadata.varlen([7, 13]))
        last = model.compute_logits(hidden, torch.tensor([6, 19]))
    torch.testing.assert_close(last, torch.stack([outs[0][-1], outs[1][-1]]))


def test_sharded_checkpoint_loads_the_same_model(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3", sharded=True)
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 2
    sharded, _ = load_model(path)
    single, _ = load_model(hf_checkpoint("qwen3")[0])
    for (name, a), (_, b) in zip(sharded.state_dict().items(), single.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def _greedy_paged(model, prompts, steps, *, block_size=4, chunk=4, num_blocks=24):
    """Greedy decoding of several prompts in one varlen batch per step, over a paged KV cache with a
    hand-managed block table: each step computes up to ``chunk`` new tokens per sequence, so steps
    mix prefill chunks (with a cached prefix) and single-token decodes. Returns the new tokens."""
    cfg = model.config
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    # NaN-filled: a read of a slot nobody wrote would poison the logits.
    caches = [(torch.full(shape, float("nan")), torch.full(shape, float("nan"))) for _ in range(cfg.num_hidden_layers)]
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    seqs = [list(p) for p in prompts]
    tables = [[] for _ in prompts]
    done = [0] * len(prompts)  # tokens whose K/V are in the cache
    outputs = [[] for _ in prompts]
    while any(len(o) < steps for o in outputs):
        active = [b for b in range(len(prompts)) if len(outputs[b]) < steps]
        ids, positions, slots, cu, ctx, rows, sampled = [], [], [], [0], [], [], []
        for b in active:
            n = min(chunk, len(seqs[b]) - done[b])
            for p in range(done[b], done[b] + n):
                if p // block_size == len(tables[b]):
                    tables[b].append(free.pop())
                ids.append(seqs[b][p])
                positions.append(p)
                slots.append(tables[b][p // block_size] * block_size + p % block_size)
            cu.append(cu[-1] + n)
            ctx.append(done[b] + n)
            done[b] += n
            if done[b] == len(seqs[b]):  # the whole sequence is in: its last token's logits sample
                rows.append(cu[-1] - 1)
                sampled.append(b)
        width = max(len(tables[b]) for b in active)
        block_tables = torch.tensor([tables[b] + [0] * (width - len(tables[b])) for b in active], dtype=torch.int32)
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
            max_seqlen_q=max(b - a for a, b in zip(cu, cu[1:])),
            kv_caches=caches,
            context_lens=torch.tensor(ctx, dtype=torch.int32),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=block_tables,
        )
        with torch.no_grad():
            hidden = model(torch.tensor(ids), torch.tensor(positions), meta)
            next_tokens = model.compute_logits(hidden, torch.tensor(rows)).argmax(-1).tolist()
        for b, token in zip(sampled, next_tokens):
            seqs[b].append(token)
            outputs[b].append(token)
    return outputs


# The Triton kernels run interpreted on the CPU (~1 s a step): two architectures take them (GQA with
# Llama-3 rope; bias, tied embeddings and a sliding window in layer 1 only), all take the references.
GREEDY_CASES = [(name, "reference") for name in ARCHS] + [("llama3", "triton"), ("qwen2", "triton")]


@pytest.mark.parametrize("name, backend", GREEDY_CASES)
def test_greedy_decoding_with_paged_cache_matches_generate(name, backend, hf_checkpoint):
    path, hf = hf_checkpoint(name)
    model, config = load_model(path)
    prompts = [torch.randint(0, config.vocab_size, (n,)) for n in (6, 9, 1)]
    steps = 6
    with fuseformer.use_backend(backend):
        ours = _greedy_paged(model, [p.tolist() for p in prompts], steps)
    hf.generation_config.eos_token_id = None  # decode all steps, as ours does
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            out = hf.generate(prompt[None], max_new_tokens=steps, do_sample=False, pad_token_id=0)
        assert got == out[0, len(prompt) :].tolist(), f"{name}: prompt {prompt.tolist()}"


def _hf_grads(hf, ids, target):
    """Gradients of the mean cross-entropy over the HF model's parameters, named as ours are (q/k/v and
    gate/up concatenated into the packed parameters)."""
    hf.zero_grad()
    loss = torch.nn.functional.cross_entropy(hf(ids[None]).logits[0], target)
    loss.backward()
    grads = {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
    for n in [n for n in grads if ".q_proj." in n]:
        parts = [grads.pop(n.replace("q_proj", x)) for x in ("q_proj", "k_proj", "v_proj")]
        grads[n.replace("q_proj", "qkv_proj")] = torch.cat(parts)
    for n in [n for n in grads if ".gate_proj." in n]:
        grads[n.replace("gate_proj", "gate_up_proj")] = torch.cat([grads.pop(n), grads.pop(n.replace("gate", "up"))])
    return grads


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3"])
def test_gradients_match_transformers(name, hf_checkpoint):
    """Training path (no cache): every parameter's gradient of a cross-entropy loss, §3 criterion."""
    path, hf = hf_checkpoint(name)
    model, config = load_model(path)
    model.train()
    ids = torch.randint(0, config.vocab_size, (11,))
    target = torch.randint(0, config.vocab_size, (11,))
    hidden = model(ids, torch.arange(11), AttentionMetadata.varlen([11]))
    torch.nn.functional.cross_entropy(model.compute_logits(hidden), target).backward()
    base = _hf_grads(hf, ids, target)
    ref = _hf_grads(copy.deepcopy(hf).double(), ids, target)
    hf.zero_grad()
    ours = {n: p.grad for n, p in model.named_parameters()}
    assert set(ours) == set(base), set(ours) ^ set(base)
    for n, g in ours.items():
        assert_close(f"{name} grad {n}", g, ref[n], base[n])


def test_paged_step_compiles_fullgraph(hf_checkpoint, compile_backend):
    """A step over the paged cache (prefill chunk + decode) traces whole: what CUDA graphs need."""
    path, _ = hf_checkpoint("qwen3")
    model, config = load_model(path)
    shape = (8, 4, config.num_key_value_heads, config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)]
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, 3, 4], dtype=torch.int32),
        max_seqlen_q=3,
        kv_caches=caches,
        context_lens=torch.tensor([3, 5], dtype=torch.int32),
        slot_mapping=torch.tensor([0, 1, 2, 20]),
        block_tables=torch.tensor([[0, 1], [4, 5]], dtype=torch.int32),
    )
    ids, positions = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1, 2, 4])

    def step(ids, positions, meta):
        return model.compute_logits(model(ids, positions, meta), torch.tensor([2, 3]))

    with torch.no_grad():
        eager = step(ids, positions, meta)
        compiled = torch.compile(step, fullgraph=True, backend=compile_backend)(ids, positions, meta)
    torch.testing.assert_close(compiled, eager)


def test_reference_backend_gives_the_same_logits(hf_checkpoint):
    """The CPU path without the interpreter (every op on its PyTorch reference) matches too."""
    path, hf = hf_checkpoint("qwen2")
    model, config = load_model(path)
    ids = torch.randint(0, config.vocab_size, (9,))
    with fuseformer.use_backend("reference"):
        (out,) = _ours(model, [ids])
    ref, base = _hf_logits(hf, ids)
    assert_close("logits", out, ref, base)


def test_rope_inv_freq_matches_transformers(hf_checkpoint):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for name in ("llama3", "llama_linear_tied", "llama_dynamic"):
        path, hf = hf_checkpoint(name)
        _, config = load_model(path)
        rope_type = config.rope_scaling["rope_type"]
        expected, _ = ROPE_INIT_FUNCTIONS[rope_type](hf.config, "cpu")
        torch.testing.assert_close(rope_inv_freq(config), expected, rtol=0, atol=0)
        if rope_type == "dynamic":
            expected, _ = ROPE_INIT_FUNCTIONS[rope_type](hf.config, "cpu", seq_len=40)
            torch.testing.assert_close(rope_inv_freq(config, torch.tensor(40)), expected, rtol=1e-6, atol=0)


def test_bf16_model_keeps_fp32_rotary_frequencies(hf_checkpoint):
    path, _ = hf_checkpoint("llama3")
    model, config = load_model(path, dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.inv_freq.dtype == torch.float32
    torch.testing.assert_close(model.model.inv_freq, rope_inv_freq(config), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_logits_gpu_half(name, dtype, hf_checkpoint):
    """On the GPU in half precision: our logits against HF fp64, baseline HF in the same dtype."""
    path, hf = hf_checkpoint(name)
    model, config = load_model(path, dtype=dtype, device="cuda")
    seqs = [torch.randint(0, config.vocab_size, (n,)) for n in (40, 97, 1)]
    outs = _ours(model, [s.cuda() for s in seqs])
    for ids, out in zip(seqs, outs):
        with torch.no_grad():
            base = hf.to("cuda", dtype)(ids[None].cuda()).logits[0]
            ref = hf.to("cuda", torch.float64)(ids[None].cuda()).logits[0]
        hf.to("cpu", torch.float32)
        assert_close(f"{name} logits", out, ref, base)

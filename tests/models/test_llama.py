"""The Llama-family model against transformers: logits within the DESIGN.md §3 criterion (reference:
the HF model in fp64; baseline: the HF model in fp32) and greedy decoding over a paged KV cache."""

import copy

import pytest
import torch

import fuseformer
from fuseformer.models.attention_metadata import AttentionMetadata
from fuseformer.models.llama import rope_inv_freq
from fuseformer.models.loader import load_model
from fuseformer.testing import assert_close, greedy_paged, hf_logits, hf_packed_grads, packed_logits

ARCHS = ["llama3", "llama_linear_tied", "llama_dynamic", "mistral", "qwen2", "qwen3"]


@pytest.mark.parametrize("name", ARCHS)
def test_logits_match_transformers_single_sequence(name, hf_checkpoint):
    path, hf = hf_checkpoint(name)
    model, config = load_model(path)
    ids = torch.randint(0, config.vocab_size, (15,))  # past every window and the dynamic-rope length
    (out,) = packed_logits(model, [ids])
    ref, base = hf_logits(hf, ids)
    assert_close(f"{name} logits", out, ref, base)


@pytest.mark.parametrize("name", ["llama3", "qwen2", "qwen3"])
def test_logits_match_transformers_varlen_batch(name, hf_checkpoint):
    path, hf = hf_checkpoint(name)
    model, config = load_model(path)
    seqs = [torch.randint(0, config.vocab_size, (n,)) for n in (7, 13)]
    outs = packed_logits(model, seqs)
    for i, (ids, out) in enumerate(zip(seqs, outs)):
        ref, base = hf_logits(hf, ids)
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


# The Triton kernels run interpreted on the CPU (~1 s a step): one architecture takes them (GQA, bias,
# tied embeddings, a sliding window in layer 1 only); all take the references.
GREEDY_CASES = [(name, "reference") for name in ARCHS] + [("qwen2", "triton")]


def _prompt_lengths(name, lengths, steps):
    """Dynamic NTK rope past max_position_embeddings (12) has no cached reference: cached keys keep
    the frequencies of the length they were written at, a full forward re-rotates them all. So its
    greedy runs stay within 12 positions (its logits test covers the scaled range)."""
    return [min(n, 12 - steps) for n in lengths] if name == "llama_dynamic" else lengths


def _hf_greedy(hf, prompt, steps, name):
    """HF's greedy continuation of ``prompt`` (1-D tensor): ``generate``; for dynamic NTK rope, a loop
    of full forwards instead. (transformers 5.24's generate on that checkpoint picks tokens its own
    forward on the same prefix does not, even below max_position_embeddings where the rope is the
    plain one; the forward is the semantics we match.)"""
    if name == "llama_dynamic":
        seq = prompt[None]
        for _ in range(steps):
            with torch.no_grad():
                seq = torch.cat([seq, hf(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
        return seq[0, len(prompt) :].tolist()
    hf.generation_config.eos_token_id = None  # decode all steps, as ours does
    with torch.no_grad():
        out = hf.generate(prompt[None], max_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name, backend", GREEDY_CASES)
def test_greedy_decoding_with_paged_cache_matches_generate(name, backend, hf_checkpoint):
    path, hf = hf_checkpoint(name)
    model, config = load_model(path)
    steps = 6
    prompts = [torch.randint(0, config.vocab_size, (n,)) for n in _prompt_lengths(name, (6, 9, 1), steps)]
    with fuseformer.use_backend(backend):
        ours = greedy_paged(model, [p.tolist() for p in prompts], steps)
    for prompt, got in zip(prompts, ours):
        assert got == _hf_greedy(hf, prompt, steps, name), f"{name}: prompt {prompt.tolist()}"


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
    base = hf_packed_grads(hf, ids, target)
    ref = hf_packed_grads(copy.deepcopy(hf).double(), ids, target)
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
        (out,) = packed_logits(model, [ids])
    ref, base = hf_logits(hf, ids)
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
    """On the GPU in half precision (the Triton kernels, flash_attention included): our logits against
    HF in fp64 on the same rounded weights, baseline HF in the same dtype."""
    path, hf = hf_checkpoint(name)
    model, config = load_model(path, dtype=dtype, device="cuda")
    hf_half = copy.deepcopy(hf).to("cuda", dtype)
    hf64 = copy.deepcopy(hf_half).to(torch.float64)
    seqs = [torch.randint(0, config.vocab_size, (n,), device="cuda") for n in (40, 97, 1)]
    outs = packed_logits(model, seqs)
    for ids, out in zip(seqs, outs):
        with torch.no_grad():
            base, ref = hf_half(ids[None]).logits[0], hf64(ids[None]).logits[0]
        assert_close(f"{name} logits", out, ref, base)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ARCHS)
def test_greedy_decoding_gpu(name, hf_checkpoint):
    """fp32 on the GPU (true-fp32 dots): the paged Triton kernels decode what HF generate does."""
    path, hf = hf_checkpoint(name)
    model, config = load_model(path, device="cuda")
    hf = copy.deepcopy(hf).cuda()
    prompts = [torch.randint(0, config.vocab_size, (n,)) for n in _prompt_lengths(name, (6, 9, 1, 20), 8)]
    ours = greedy_paged(model, [p.tolist() for p in prompts], 8, chunk=5, num_blocks=64, device="cuda")
    for prompt, got in zip(prompts, ours):
        assert got == _hf_greedy(hf, prompt.cuda(), 8, name), f"{name}: prompt {prompt.tolist()}"


def _medium_checkpoint(tmp_path, arch):
    """A model of real layer sizes (hidden 1024, head dim 128, GQA 8/2), 3 layers, random weights."""
    import transformers

    common = dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, vocab_size=4096, max_position_embeddings=8192,
    )  # fmt: skip
    if arch == "llama":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512, "rope_theta": 500000.0}  # fmt: skip
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_parameters=rope))
    else:
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, tie_word_embeddings=True))
    with torch.no_grad():  # O(1) activations: unit-variance embeddings, fan-in scaled matrices
        for n, p in hf.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 1.0 if "embed" in n else p.shape[1] ** -0.5)
            else:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    hf.eval().save_pretrained(tmp_path)
    return tmp_path, hf


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_real_sizes_gpu(arch, dtype, tmp_path):
    """Real layer sizes in half precision: prompts of 1000 and 517 tokens prefilled in chunks of 384
    over the paged cache (chunks with cached prefixes next to decodes), then decoded; the logits of
    every token computed against HF on the whole sequence (fp64 reference, baseline HF in dtype)."""
    path, hf = _medium_checkpoint(tmp_path, arch)
    model, config = load_model(path, dtype=dtype, device="cuda")
    hf_half = copy.deepcopy(hf).to("cuda", dtype)
    hf64 = copy.deepcopy(hf_half).to(torch.float64)
    prompts = [torch.randint(0, config.vocab_size, (n,)).tolist() for n in (1000, 517, 3)]
    outputs, logits = greedy_paged(
        model, prompts, 6, block_size=16, chunk=384, num_blocks=200, device="cuda", all_logits=True
    )
    for prompt, out, got in zip(prompts, outputs, logits):
        seq = torch.tensor(prompt + out[:-1], device="cuda")  # every token whose logits were computed
        with torch.no_grad():
            base, ref = hf_half(seq[None]).logits[0], hf64(seq[None]).logits[0]
        assert_close(f"{arch} {dtype} logits (len {len(prompt)})", got.cuda(), ref, base)
    # And the no-cache path (flash_attention) on the same prompts.
    outs = packed_logits(model, [torch.tensor(p, device="cuda") for p in prompts])
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor(prompt, device="cuda")[None]
        with torch.no_grad():
            base, ref = hf_half(ids).logits[0], hf64(ids).logits[0]
        assert_close(f"{arch} {dtype} logits, no cache (len {len(prompt)})", out, ref, base)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("tokens", [1, 8, 80])  # decode steps (the decode GEMMs on a GPU) and a prefill
def test_fused_mlp_in_the_model_matches_the_unfused_mlp(act, tokens, device):
    """The model's MLP (fused_mlp: gate-up GEMM with act * mul, then down) against nn.Linear + the
    activation + nn.Linear: reference in fp64, baseline the unfused MLP in the kernels' dtype (fp32 and
    fp16 under the CPU interpreter, whose bf16 dot is wrong; bf16 too on a GPU)."""
    from fuseformer.models.config import ModelConfig
    from fuseformer.models.llama import MLP

    config = ModelConfig(architecture="LlamaForCausalLM", hidden_size=64, intermediate_size=96, hidden_act=act,
                         num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, vocab_size=32)  # fmt: skip
    mlp = MLP(config).to(device)

    def unfused(m: MLP, x: torch.Tensor) -> torch.Tensor:
        gate, up = m.gate_up_proj(x).chunk(2, dim=-1)
        a = torch.nn.functional.silu(gate) if act == "silu" else torch.nn.functional.gelu(gate, approximate="tanh")
        return m.down_proj(a * up)

    dtypes = [torch.float32, torch.float16] + ([torch.bfloat16] if device == "cuda" else [])
    for dtype in dtypes:
        ours = copy.deepcopy(mlp).to(dtype)
        x = torch.randn(tokens, 64, device=device, dtype=dtype)
        with torch.no_grad(), fuseformer.use_backend("triton"):
            out = ours(x)
        with torch.no_grad():
            ref = unfused(copy.deepcopy(mlp).double(), x.double())
            base = unfused(ours, x)
        assert_close(f"MLP {act} T {tokens} {dtype}", out, ref, base)

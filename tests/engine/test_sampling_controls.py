"""The sampling controls end to end through LLM.generate (issue 29 item 2): logit_bias, allowed_token_ids,
min_tokens, bad_words, prompt_logprobs, truncate_prompt_tokens. Each has its effect in greedy and
random rows batched with rows that do not use it, and with async scheduling the outputs are those of
synchronous steps (those whose sampling reads the output so far are scheduled ahead with their sampling
deferred). A tiny Llama with a byte-level BPE tokenizer trained here; ops on their PyTorch references."""

import math

import pytest
import torch
import transformers

import fuseformer
from fuseformer.engine.llm import LLM
from fuseformer.engine.sampling_params import SamplingParams
from fuseformer.testing import save_tiny_tokenizer

CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog. Say hello to the engine.",
    "Continuous batching, paged attention and prefix caching make serving fast.",
] * 3
KW = dict(num_kv_blocks=64, block_size=4, max_model_len=64, max_num_batched_tokens=64)
PROMPT = "Hello world"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """(checkpoint directory, its transformers model): logits O(1)-O(10), so greedy text is decisive."""
    path = tmp_path_factory.mktemp("controls")
    eos = save_tiny_tokenizer(path, CORPUS, "{{ messages }}")
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=320, bos_token_id=0, eos_token_id=eos,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            if p.dim() == 1:
                p.copy_(1 + 0.3 * r)
            elif "embed_tokens" in name:
                p.copy_(r)
            else:
                p.copy_(r * (2.0 if "lm_head" in name else 1.0) / math.sqrt(p.shape[1]))
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module")
def llms(model_dir):
    """{async_scheduling: LLM}: the same engine twice, to compare the two step loops."""
    with fuseformer.use_backend("reference"):
        return {a: LLM(model_dir[0], async_scheduling=a, **KW) for a in (False, True)}


def _run(llms, prompts, params):
    """Outputs of both LLMs (equal: the token controls are the same with scheduling ahead) and how many
    steps the async one scheduled ahead."""
    with fuseformer.use_backend("reference"):
        ahead = llms[True].core.num_steps_ahead
        sync, fast = (llms[a].generate(prompts, params, use_tqdm=False) for a in (False, True))
    assert [[c.token_ids for c in o.outputs] for o in fast] == [[c.token_ids for c in o.outputs] for o in sync]
    assert [[c.text for c in o.outputs] for o in fast] == [[c.text for c in o.outputs] for o in sync]
    for llm in llms.values():
        assert llm.core.scheduler.kv.pool.num_free_blocks == 63
    return sync, llms[True].core.num_steps_ahead - ahead


def _greedy(llms, prompt=PROMPT, n=12):
    with fuseformer.use_backend("reference"):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return llms[False].generate(prompt, params, use_tqdm=False)[0].outputs[0]


def test_logit_bias_and_allowed_token_ids_in_a_mixed_batch_scheduled_ahead(llms):
    """-100 removes greedy's token from greedy and random rows, +100 forces one, allowed_token_ids
    restricts every token; a row without controls in the batch keeps its greedy text. Neither reads the
    output, so steps are scheduled ahead."""
    greedy = _greedy(llms).token_ids
    banned, forced, allowed = greedy[0], greedy[1], sorted(set(greedy[2:6]))
    base = dict(max_tokens=12, ignore_eos=True)
    params = [
        SamplingParams(temperature=0, logit_bias={banned: -100}, **base),
        SamplingParams(temperature=1.5, seed=3, logit_bias={banned: -100}, **base),
        SamplingParams(temperature=0, logit_bias={forced: 100}, **base),
        SamplingParams(temperature=1.5, seed=4, logit_bias={forced: 100}, **base),
        SamplingParams(temperature=0, allowed_token_ids=allowed, **base),
        SamplingParams(temperature=2.0, seed=5, allowed_token_ids=allowed, **base),
        SamplingParams(temperature=0, **base),
    ]
    outs, ahead = _run(llms, [PROMPT] * len(params), params)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert banned not in tokens[0] and banned not in tokens[1] and tokens[0] != greedy
    assert set(tokens[2]) == {forced} and set(tokens[3]) == {forced}
    assert set(tokens[4]) <= set(allowed) and set(tokens[5]) <= set(allowed) and len(set(tokens[5])) > 1
    assert tokens[6] == greedy
    assert ahead > 0


def test_min_tokens_holds_off_eos_stop_ids_and_stop_strings(llms):
    """EOS (here greedy's first token), a stop token id and a stop string would each end the request
    at once; min_tokens holds them off that many tokens, in greedy and random rows (vLLM's rule: a
    stop string in text before then does not stop it). Scheduling ahead starts once it is reached."""
    greedy = _greedy(llms)
    first = greedy.token_ids[0]
    first_text = llms[False].tokenizer.decode(greedy.token_ids[:1])
    assert first_text
    for llm in llms.values():
        llm.eos_token_ids = [first]
    try:
        stop_now = SamplingParams(temperature=0, max_tokens=12)
        outs, _ = _run(llms, [PROMPT], [stop_now])
        assert outs[0].outputs[0].token_ids == [first] and outs[0].outputs[0].finish_reason == "stop"
        params = [
            SamplingParams(temperature=0, max_tokens=12, min_tokens=5),
            SamplingParams(temperature=1.5, seed=9, max_tokens=12, min_tokens=5, logit_bias={first: 8}),
            SamplingParams(temperature=0, max_tokens=12, min_tokens=5, ignore_eos=True, stop_token_ids=[first]),
            SamplingParams(temperature=0, max_tokens=12, min_tokens=3, ignore_eos=True, stop=[first_text]),
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[first_text]),
        ]
        outs, ahead = _run(llms, [PROMPT] * len(params), params)
    finally:
        for llm in llms.values():
            llm.eos_token_ids = llm.tokenizer.eos_token_ids
    for o in outs[:3]:
        c = o.outputs[0]
        assert len(c.token_ids) > 5 and first not in c.token_ids[:5], c.token_ids
        assert c.finish_reason == "length" or c.token_ids[-1] == first
    assert outs[2].outputs[0].stop_reason in (None, first)
    held, cut = outs[3].outputs[0], outs[4].outputs[0]
    assert (cut.text, cut.finish_reason, cut.stop_reason) == ("", "stop", first_text)
    assert held.text.startswith(first_text) and len(held.token_ids) > 3
    assert ahead > 0


def test_bad_words_single_and_multi_token(llms):
    """A one-token word is never generated; a word of two tokens never appears as those two tokens in a
    row (its first token may). The multi-token word reads the output: its steps scheduled ahead defer
    their sampling, and the outputs still equal the synchronous ones."""
    llm = llms[False]
    greedy = _greedy(llms, n=16).token_ids
    pair = None
    for a, b in zip(greedy[2:], greedy[3:]):  # past the first decode step: later ones are scheduled ahead
        word = llm.tokenizer.decode([a, b])
        if [a, b] in llm.output_processor.bad_words_token_ids([word]) and word.strip():
            pair = (word, [a, b])
            break
    assert pair is not None, "no two greedy tokens tokenize back to themselves"
    single = llm.tokenizer.decode([greedy[0]])
    assert [greedy[0]] in llm.output_processor.bad_words_token_ids([single])
    base = dict(max_tokens=16, ignore_eos=True)
    params = [
        SamplingParams(temperature=0, bad_words=[single], **base),
        SamplingParams(temperature=1.0, seed=2, bad_words=[single], **base),
        SamplingParams(temperature=0, bad_words=[pair[0]], **base),
        SamplingParams(temperature=0, **base),
    ]
    outs, _ = _run(llms, [PROMPT] * len(params), params)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert greedy[0] not in tokens[0] and greedy[0] not in tokens[1]
    a, b = pair[1]
    assert not any(x == a and y == b for x, y in zip(tokens[2], tokens[2][1:])) and tokens[2] != greedy
    assert tokens[3] == greedy


def test_prompt_logprobs_match_teacher_forcing(llms, model_dir):
    """Per prompt token (the first None): its logprob and rank and the top k, as transformers' logits
    give them; the prompt computed in chunks of 8 and again in full on a second request (prefix cache
    not read); with n=2; and from the step API once, in the first output."""
    _, hf = model_dir
    tokenizer = llms[False].tokenizer
    prompt = "The quick brown fox jumps over the lazy dog. Say hello"
    ids = tokenizer.encode(prompt)
    assert len(ids) > 16
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].double().log_softmax(-1)  # (P, V)
    with fuseformer.use_backend("reference"):
        chunked = LLM(model_dir[0], **(KW | dict(max_num_batched_tokens=8)))
        params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3, n=2)
        first, again = (chunked.generate(prompt, params, use_tqdm=False)[0] for _ in range(2))
    for out in (first, again):
        lps = out.prompt_logprobs
        assert len(lps) == len(ids) and lps[0] is None and out.num_cached_tokens == 0
        for i in range(1, len(ids)):
            position, row = lps[i], ref[i - 1]
            assert list(position)[0] == ids[i]
            assert set(row.topk(3).indices.tolist()) <= set(position) and len(position) in (3, 4)
            for t, lp in position.items():
                assert abs(lp.logprob - row[t].item()) < 1e-4
                assert lp.decoded_token == tokenizer.decode([t], skip_special_tokens=False)
            assert position[ids[i]].rank == 1 + int((row > row[ids[i]]).sum())
    with fuseformer.use_backend("reference"):
        llm = llms[True]
        llm.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=0))
        streamed = []
        while llm.has_unfinished_requests():
            streamed += [o.prompt_logprobs for o in llm.step() if o.prompt_logprobs is not None]
    assert len(streamed) == 1 and [list(p) if p else p for p in streamed[0]] == [None] + [[t] for t in ids[1:]]


def test_truncate_prompt_tokens_keeps_the_last_k(llms):
    ids = llms[False].tokenizer.encode("The quick brown fox jumps over the lazy dog. Say hello")
    plain = dict(temperature=0, max_tokens=6, ignore_eos=True)
    params = [SamplingParams(truncate_prompt_tokens=5, **plain), SamplingParams(**plain), SamplingParams(**plain)]
    (cut, last5, full), _ = _run(llms, [ids, ids[-5:], ids], params)
    assert cut.prompt_token_ids == ids[-5:] and cut.outputs[0].token_ids == last5.outputs[0].token_ids
    assert cut.outputs[0].token_ids != full.outputs[0].token_ids  # the cut prompt changed the text
    with pytest.raises(ValueError, match="64 tokens; max_model_len 64"):
        llms[False].generate([[5] * 64], SamplingParams(), use_tqdm=False)
    with fuseformer.use_backend("reference"):
        out = llms[False].generate([[5] * 100], SamplingParams(max_tokens=1, truncate_prompt_tokens=-1), use_tqdm=False)
    assert out[0].prompt_token_ids == [5] * 63  # -1: as many as leave room for one output token

"""The server end to end, driven by the official ``openai`` client (and raw HTTP for what the client
will not send): completions and chat, streaming and not, equal to the offline engine's output; the
sampling fields reach the engine; bad requests get 400 in OpenAI's shape naming the field, and the
server keeps serving; wrong routes 404/405; the API key; /v1/models, /health, /metrics."""

import httpx
import openai
import pytest

import fuseformer
from fuseformer.engine.llm import LLM
from fuseformer.engine.sampling_params import SamplingParams

MODEL = "tiny-llama"  # the name tests/serve/conftest.py serves the model as


@pytest.fixture(scope="module")
def server(checkpoint, start_server):
    with start_server(checkpoint) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def offline(checkpoint, llm_kwargs):
    """The offline engine on the same checkpoint: what the server must return."""
    with fuseformer.use_backend("reference"):
        yield LLM(checkpoint, **llm_kwargs)


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=60)


def _offline(offline, prompt, **kwargs):
    with fuseformer.use_backend("reference"):
        return offline.generate(prompt, SamplingParams(**kwargs), use_tqdm=False)[0]


def test_completion_equals_the_offline_engine(client, offline):
    r = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=12, temperature=0)
    (expected,) = _offline(offline, "Hello world", max_tokens=12, temperature=0).outputs
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    (choice,) = r.choices
    assert choice.text == expected.text and choice.index == 0
    assert choice.finish_reason == expected.finish_reason
    prompt_tokens = len(offline.tokenizer.encode("Hello world"))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (prompt_tokens, len(expected.token_ids))
    assert r.usage.total_tokens == prompt_tokens + len(expected.token_ids)


def test_chat_equals_the_offline_engine(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0)
    with fuseformer.use_backend("reference"):
        (expected,) = offline.chat(messages, SamplingParams(max_tokens=10, temperature=0), use_tqdm=False)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content == expected.outputs[0].text
    assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert r.usage.completion_tokens == len(expected.outputs[0].token_ids)


@pytest.mark.parametrize("n", [1, 3])
def test_streamed_completion_equals_non_streamed(client, n):
    """Sampled (temperature 1) with a seed: the same text streamed or not; usage in the last chunk only."""
    kwargs = dict(model=MODEL, prompt="The quick brown", max_tokens=16, temperature=1.0, seed=11, n=n)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    texts, finishes = [""] * n, [[] for _ in range(n)]
    for chunk in chunks[:-1]:
        assert chunk.usage is None and len(chunk.choices) == 1 and chunk.id == chunks[0].id
        c = chunk.choices[0]
        texts[c.index] += c.text
        if c.finish_reason is not None:
            finishes[c.index].append(c.finish_reason)
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # cached_tokens: the second one hits the cache
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump(include=set(counts)) == whole.usage.model_dump(
        include=set(counts)
    )
    assert texts == [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert finishes == [[c.finish_reason] for c in sorted(whole.choices, key=lambda c: c.index)]
    if n > 1:
        assert len(set(texts)) > 1  # seeds seed, seed+1, ...: not n copies of one draw


def test_streamed_chat_equals_non_streamed(client):
    kwargs = dict(
        model=MODEL, messages=[{"role": "user", "content": "fox"}], max_tokens=14, temperature=0.8, seed=5, n=2
    )
    whole = client.chat.completions.create(**kwargs)
    texts, roles, finishes = ["", ""], [None, None], [None, None]
    stream = client.chat.completions.create(**kwargs, stream=True)
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            if c.delta.role:
                assert roles[c.index] is None and texts[c.index] == ""  # the role comes first, once
                roles[c.index] = c.delta.role
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                assert finishes[c.index] is None
                finishes[c.index] = c.finish_reason
    assert roles == ["assistant", "assistant"]
    assert texts == [c.message.content for c in whole.choices]
    assert finishes == [c.finish_reason for c in whole.choices]


def test_sampling_fields_reach_the_engine(client, offline):
    """stop, top_k, top_p, penalties and seed: the server's text is the offline engine's with the same params."""
    fields = dict(temperature=0.9, top_p=0.8, seed=3, presence_penalty=0.5, frequency_penalty=-0.4)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=12, extra_body=dict(top_k=20), **fields)
    expected = _offline(offline, "Hello", max_tokens=12, top_k=20, **fields).outputs[0]
    assert r.choices[0].text == expected.text
    greedy = _offline(offline, "Hello", max_tokens=16, temperature=0, ignore_eos=True).outputs[0].text
    assert len(greedy) >= 6, greedy
    stop = greedy[3:6]
    r = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=16, temperature=0, stop=[stop], extra_body=dict(ignore_eos=True)
    )
    assert (r.choices[0].text, r.choices[0].finish_reason) == (greedy[: greedy.index(stop)], "stop")


def test_logprobs(client, offline):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    expected = _offline(offline, "Hello", max_tokens=4, temperature=0, logprobs=2).outputs[0]
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(expected.token_ids)
    for i, (t, d) in enumerate(zip(expected.token_ids, expected.logprobs)):
        assert lp.token_logprobs[i] == pytest.approx(d[t].logprob, abs=1e-5)
        assert lp.tokens[i] == offline.tokenizer.decode([t], skip_special_tokens=False) == d[t].decoded_token
        assert max(lp.top_logprobs[i].values()) == pytest.approx(max(v.logprob for v in d.values()), abs=1e-5)

    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and entry.logprob <= values[0] + 1e-6


def test_batched_prompts_and_token_ids(client, offline):
    """A list of prompts (text, or token ids): choice prompt_index * n + i; the prompts' tokens in usage."""
    ids = offline.tokenizer.encode("Hello world")
    first = _offline(offline, "The quick", max_tokens=5, temperature=0).outputs[0].text
    second = _offline(offline, ids, max_tokens=5, temperature=0).outputs[0].text
    assert first != second
    for prompt in (["The quick", "Hello world"], [offline.tokenizer.encode("The quick"), ids]):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, n=2)
        by_index = {c.index: c.text for c in r.choices}
        assert [by_index[i] for i in range(4)] == [first, first, second, second] and len(r.choices) == 4
        assert r.usage.prompt_tokens == len(ids) + len(offline.tokenizer.encode("The quick"))
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert r.choices[0].text == second


def test_models_health_metrics(server, client, read_metric):
    url, _ = server
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(f"{url}/health").status_code == 200
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    text = httpx.get(f"{url}/metrics").text
    for name in (
        "fuseformer_num_requests_running",
        "fuseformer_num_requests_waiting",
        "fuseformer_kv_cache_usage_perc",
        "fuseformer_prefix_cache_hit_rate",
        "fuseformer_time_to_first_token_seconds_bucket",
        "fuseformer_inter_token_latency_seconds_bucket",
        "fuseformer_prompt_tokens_total",
        "fuseformer_generation_tokens_total",
    ):
        assert name in text, name
    assert read_metric(url, "fuseformer_generation_tokens_total") >= 3
    assert read_metric(url, "fuseformer_time_to_first_token_seconds_count") >= 1
    assert read_metric(url, "fuseformer_kv_cache_usage_perc") == 0.0


_LONG = "hello " * 80  # over 64 tokens
_HI = {"role": "user", "content": "hi"}

BAD_REQUESTS = [
    # (path, body, param expected in the error; None: no field to name)
    ("/v1/completions", dict(prompt="hi", temperature=-1), "temperature"),
    ("/v1/completions", dict(prompt="hi", temperature="hot"), "temperature"),
    ("/v1/completions", dict(prompt="hi", top_p=1.5), "top_p"),
    ("/v1/completions", dict(prompt="hi", top_p=0), "top_p"),
    ("/v1/completions", dict(prompt="hi", top_k=-2), "top_k"),
    ("/v1/completions", dict(prompt="hi", n=0), "n"),
    ("/v1/completions", dict(prompt="hi", n=100000), "n"),
    ("/v1/completions", dict(prompt="hi", max_tokens=0), "max_tokens"),
    ("/v1/completions", dict(prompt="hi", max_tokens=1000), "max_tokens"),
    ("/v1/completions", dict(prompt="hi", presence_penalty=3), "presence_penalty"),
    ("/v1/completions", dict(prompt="hi", frequency_penalty=-2.5), "frequency_penalty"),
    ("/v1/completions", dict(prompt="hi", logprobs=-1), "logprobs"),
    ("/v1/completions", dict(prompt="hi", logprobs=50), "logprobs"),
    ("/v1/completions", dict(prompt="hi", stop=[""]), "stop"),
    ("/v1/completions", dict(prompt="hi", seed="x"), "seed"),
    ("/v1/completions", dict(prompt="hi", seed=2**70), "seed"),  # would fail the engine's step
    ("/v1/completions", dict(prompt="hi", stream="maybe"), "stream"),
    ("/v1/completions", dict(prompt=_LONG), "prompt"),
    ("/v1/completions", dict(prompt=[]), "prompt"),
    ("/v1/completions", dict(prompt=[5, 100000]), "prompt"),
    ("/v1/completions", dict(prompt={"a": 1}), "prompt"),
    ("/v1/completions", dict(), "prompt"),
    ("/v1/completions", dict(prompt=[1] * 64), "prompt"),  # token ids: refused before anything is tokenized
    ("/v1/completions", dict(prompt=["hi", _LONG, "there"]), "prompt"),
    # Values that pass the ranges but not fp32 (the sampler's): empty completions, or sampled at 1.
    ("/v1/completions", dict(prompt="hi", temperature=1e-40), "temperature"),
    ("/v1/completions", dict(prompt="hi", temperature=1e-50), "temperature"),
    ("/v1/completions", dict(prompt="hi", top_p=1e-50), "top_p"),
    ("/v1/completions", dict(prompt="hi", repetition_penalty=1e-300), "repetition_penalty"),
    ("/v1/completions", dict(prompt="hi", stop=[f"s{i}" for i in range(17)]), "stop"),
    ("/v1/completions", dict(prompt="hi", stop="x" * 257), "stop"),
    ("/v1/completions", dict(prompt="hi", stop_token_ids=list(range(65))), "stop_token_ids"),
    ("/v1/completions", dict(prompt="hi", suffix="end"), "suffix"),
    ("/v1/chat/completions", dict(messages=[]), "messages"),
    ("/v1/chat/completions", dict(messages=[{"content": "no role"}]), "messages.0.role"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": _LONG}]), "messages"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], max_tokens=60), "max_tokens"),
    (
        "/v1/chat/completions",
        dict(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=60),
        "max_completion_tokens",
    ),
    (
        "/v1/chat/completions",
        dict(messages=[{"role": "user", "content": "hi"}], max_completion_tokens=0),
        "max_completion_tokens",
    ),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], top_logprobs=2), "top_logprobs"),
    (
        "/v1/chat/completions",
        dict(messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=21),
        "top_logprobs",
    ),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": [{"type": "image"}]}]), "messages"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], temperature=1e-40), "temperature"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], stop=["a"] * 17), "stop"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi"}], temperature=None, n=-1), "n"),
]


@pytest.mark.parametrize("path, body, param", BAD_REQUESTS, ids=[f"{p[4:]}-{b}"[:60] for p, b, _ in BAD_REQUESTS])
def test_bad_request_is_400_naming_the_field_and_the_server_keeps_serving(server, client, path, body, param):
    url, engine = server
    body = {"model": MODEL} | body
    if body.get("model") is None:
        del body["model"]
    for stream in (False, True):
        r = httpx.post(f"{url}{path}", json=body | ({"stream": True} if stream and "stream" not in body else {}))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error" and error["param"] == param, error
        assert param.split(".")[0] in error["message"] or param == "model", error
    ok = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2
    assert engine.num_unfinished_requests == 0 and engine.get_stats().kv_cache_usage == 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_unknown_model_is_404_model_not_found(server, client, path):
    """As OpenAI and vLLM answer (it was a 400)."""
    url, _ = server
    body = dict(model="gpt-4") | (dict(prompt="hi") if path == "/v1/completions" else dict(messages=[_HI]))
    for stream in (False, True):
        r = httpx.post(f"{url}{path}", json=body | dict(stream=stream))
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "model_not_found", error
        assert error["param"] == "model" and "gpt-4" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)


# Raw bodies: JSON's "\ud800" escape is a lone surrogate in Python, which httpx will not encode.
LONE_SURROGATES = [
    ("/v1/completions", b'{"prompt": "abc\\ud800def"}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "\\udfff"]}', "prompt"),
    ("/v1/completions", b'{"prompt": "hi", "stop": ["\\ud800"], "model": "\\ud800"}', "model"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "\\udc00", "content": "a"}]}', "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages"),
]  # fmt: skip


@pytest.mark.parametrize("path, content, param", LONE_SURROGATES)
def test_lone_surrogate_is_4xx_not_500(server, client, path, content, param):
    url, engine = server
    for stream in (b"false", b"true"):
        body = content[:-1] + b', "max_tokens": 2, "stream": ' + stream + b"}"
        r = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"})
        assert r.status_code == (404 if param == "model" else 400), r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert client.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.completion_tokens == 2
    assert engine.num_unfinished_requests == 0


@pytest.mark.parametrize("content", [b"{not json", b"", b"[1, 2]", b'"text"', b"\xff\xfe"])
def test_malformed_json_is_400(server, content):
    url, _ = server
    r = httpx.post(f"{url}/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{url}/health").status_code == 200


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", top_p=7)
    assert info.value.status_code == 400 and info.value.body["param"] == "top_p"


@pytest.mark.parametrize(
    "method, path, status",
    [("GET", "/v1/nothing", 404), ("POST", "/v2/completions", 404), ("GET", "/v1/completions", 405),
     ("DELETE", "/v1/chat/completions", 405), ("POST", "/health", 405)],
)  # fmt: skip
def test_wrong_route_is_404_or_405_in_openai_shape(server, method, path, status):
    url, _ = server
    r = httpx.request(method, f"{url}{path}")
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and path in error["message"]


def test_api_key(checkpoint, start_server):
    with start_server(checkpoint, api_key="sekrit") as (url, _):
        for key in ("wrong", "Bearer sekrit"):
            bad = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                bad.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
        r = httpx.post(f"{url}/v1/chat/completions", json=dict(model=MODEL, messages=[]))
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"  # before the body's checks
        assert httpx.get(f"{url}/v1/models").status_code == 401
        good = openai.OpenAI(base_url=f"{url}/v1", api_key="sekrit", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="Hello", max_tokens=2).usage.completion_tokens == 2
        assert [m.id for m in good.models.list().data] == [MODEL]
        # The scheme in any case (RFC 9110); the key exactly.
        body = dict(model=MODEL, prompt="Hello", max_tokens=2)
        for header in ("bearer sekrit", "BEARER sekrit", "Bearer  sekrit"):
            r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": header})
            assert r.status_code == 200, (header, r.text)
        for header in ("Basic sekrit", "Bearer sekri", "Bearer sekrit2", "Bearer SEKRIT", "sekrit", "Bearer"):
            r = httpx.post(f"{url}/v1/completions", json=body, headers={"Authorization": header})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", header
        assert httpx.get(f"{url}/v1/nothing").status_code == 401  # every /v1 path, as OpenAI's
        # Probes and scrapers stay open.
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200


@pytest.mark.parametrize("include_usage", [False, True])
def test_sse_templates_equal_the_dict_encoding(include_usage):
    """The streamed chunk templates give what json.dumps of the chunk dict gives, for any text."""
    from fuseformer.serve.streaming import Events, sse

    head = dict(id="cmpl-ab12", object="text_completion", created=1764460800, model="tiny-llama")
    usage = {"usage": None} if include_usage else {}
    events = Events(head, include_usage)
    for text in ["", "hello", 'a "quote" \\ back\nslash\t', "é中😀", "\u2028\x00"]:
        choice = dict(index=3, text=text, logprobs=None, finish_reason=None, stop_reason=None)
        assert events.text(3, text) == sse(head | dict(choices=[choice]) | usage)
        choice = dict(index=1, delta=dict(content=text), logprobs=None, finish_reason=None, stop_reason=None)
        assert events.content(1, text) == sse(head | dict(choices=[choice]) | usage)
        choice = dict(index=0, text=text, logprobs=None, finish_reason="stop")
        assert events.choice(choice) == sse(head | dict(choices=[choice]) | usage)


def test_latency_histograms_count_every_token():
    """ServerMetrics' lock-free histograms: n tokens arriving together count n inter-token latencies of
    seconds / n each, in Prometheus' cumulative buckets."""
    from fuseformer.engine.scheduler import SchedulerStats
    from fuseformer.serve.metrics import ServerMetrics

    m = ServerMetrics("m")
    m.observe_first_token(0.03)
    m.observe_inter_token(0.012, 3)  # 3 tokens, 4 ms each
    m.observe_inter_token(0.5)
    m.observe_prompt(7)
    m.count_tokens(4)
    stats = SchedulerStats(
        num_running=0, num_waiting=0, kv_cache_usage=0.0, prefix_cache_hit_rate=0.0, num_preemptions=0
    )
    lines = dict(line.rsplit(" ", 1) for line in m.render(stats).decode().splitlines() if not line.startswith("#"))
    itl = "fuseformer_inter_token_latency_seconds"
    assert float(lines[f'{itl}_bucket{{le="0.0025",model_name="m"}}']) == 0
    assert float(lines[f'{itl}_bucket{{le="0.005",model_name="m"}}']) == 3
    assert float(lines[f'{itl}_bucket{{le="0.5",model_name="m"}}']) == 4
    assert float(lines[f'{itl}_bucket{{le="+Inf",model_name="m"}}']) == 4
    assert float(lines[f'{itl}_count{{model_name="m"}}']) == 4
    assert float(lines[f'{itl}_sum{{model_name="m"}}']) == pytest.approx(0.512)
    assert float(lines['fuseformer_time_to_first_token_seconds_count{model_name="m"}']) == 1
    assert float(lines['fuseformer_generation_tokens_total{model_name="m"}']) == 4
    assert float(lines['fuseformer_prompt_tokens_total{model_name="m"}']) == 7

"""The server's other endpoints and metadata, with the official ``openai`` client where it has them:
``GET /v1/models/{id}``, vLLM's ``/tokenize`` and ``/detokenize``, ``/version``, ``/ping``, ``X-Request-Id``,
``usage.prompt_tokens_details.cached_tokens``, and ``/metrics`` under vLLM's names with the end-to-end
and queue-time histograms."""

import httpx
import openai
import pytest

import fuseformer
from fuseformer.engine.outputs import RequestMetrics, RequestOutput
from fuseformer.models.tokenizer import Tokenizer

MODEL = "tiny-llama"  # the name tests/serve/conftest.py serves the model as
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(checkpoint, start_server):
    with start_server(checkpoint) as (url, engine):
        yield url, engine


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(checkpoint):
    return Tokenizer(checkpoint)


def test_retrieve_model(server, client):
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "fuseformer")
    assert card.max_model_len == 64
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    r = httpx.get(f"{server[0]}/v1/models/org/some-model")  # ids with a slash reach the route
    assert r.status_code == 404 and "org/some-model" in r.json()["error"]["message"]


def test_tokenize_a_prompt(server, tok):
    url, _ = server
    r = httpx.post(f"{url}/tokenize", json=dict(model=MODEL, prompt="Hello world"))
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tok.encode("Hello world")
    assert body == dict(count=len(ids), max_model_len=64, tokens=ids, token_strs=None)
    body = httpx.post(f"{url}/tokenize", json=dict(prompt="Hello world", return_token_strs=True)).json()
    assert body["token_strs"] == [tok.id_to_token(t) for t in ids] and "".join(body["token_strs"]) == "HelloĠworld"


def test_tokenize_messages_as_chat_renders_them(server, tok):
    url, _ = server
    for add in (True, False):
        r = httpx.post(f"{url}/tokenize", json=dict(messages=HI, add_generation_prompt=add))
        assert r.status_code == 200, r.text
        expected = tok.encode(tok.apply_chat_template(HI, add_generation_prompt=add), add_special_tokens=False)
        assert r.json()["tokens"] == expected
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model=MODEL, messages=HI, max_tokens=1)
    assert chat.usage.prompt_tokens == httpx.post(f"{url}/tokenize", json=dict(messages=HI)).json()["count"]


@pytest.mark.parametrize(
    "body, param",
    [
        (dict(), "prompt"),
        (dict(prompt="a", messages=HI), "messages"),
        (dict(prompt="a", add_generation_prompt=False), "add_generation_prompt"),
        (dict(prompt="a", tools=[{"type": "function"}]), "tools"),
        (dict(prompt="a", unknown=1), "unknown"),
        (dict(prompt=5), "prompt"),
        (dict(model="gpt-4", prompt="a"), "model"),
    ],
)
def test_tokenize_refusals(server, body, param):
    r = httpx.post(f"{server[0]}/tokenize", json=body)
    assert r.status_code == (404 if param == "model" else 400), r.text
    assert r.json()["error"]["param"] == param


def test_detokenize(server, tok):
    url, _ = server
    ids = tok.encode("Hello world")
    r = httpx.post(f"{url}/detokenize", json=dict(model=MODEL, tokens=ids))
    assert r.status_code == 200 and r.json() == dict(prompt="Hello world")
    eos = tok.eos_token_id
    assert httpx.post(f"{url}/detokenize", json=dict(tokens=[*ids, eos])).json()["prompt"] == "Hello world</s>"
    for tokens in ([5, 10**6], [-1]):
        r = httpx.post(f"{url}/detokenize", json=dict(tokens=tokens))
        assert r.status_code == 400 and r.json()["error"]["param"] == "tokens", r.text


def test_version_ping_health(server):
    url, _ = server
    assert httpx.get(f"{url}/version").json() == {"version": fuseformer.__version__}
    for method in ("GET", "POST"):
        assert httpx.request(method, f"{url}/ping").status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200


def test_tokenizer_endpoints_need_the_api_key(checkpoint, start_server):
    with start_server(checkpoint, api_key="sekrit") as (url, _):
        for path, body in (("/tokenize", dict(prompt="hi")), ("/detokenize", dict(tokens=[5]))):
            assert httpx.post(f"{url}{path}", json=body).status_code == 401
            auth = {"Authorization": "Bearer sekrit"}
            assert httpx.post(f"{url}{path}", json=body, headers=auth).status_code == 200
        for path in ("/version", "/ping", "/health", "/metrics"):
            assert httpx.get(f"{url}{path}").status_code == 200


def test_x_request_id_is_echoed_and_names_the_response(server, client):
    url, _ = server
    headers = {"X-Request-Id": "trace-123"}
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="Hello", max_tokens=2, extra_headers=headers)
    assert raw.headers["x-request-id"] == "trace-123" and raw.parse().id == "cmpl-trace-123"
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=HI, max_tokens=2, extra_headers=headers
    )
    assert raw.headers["x-request-id"] == "trace-123" and raw.parse().id == "chatcmpl-trace-123"
    with client.chat.completions.with_streaming_response.create(
        model=MODEL, messages=HI, max_tokens=2, stream=True, extra_headers=headers
    ) as stream:
        assert stream.headers["x-request-id"] == "trace-123"
        ids = {chunk.id for chunk in stream.parse()}
    assert ids == {"chatcmpl-trace-123"}
    # Errors, wrong routes and probes echo it too; the header wins over the body's request_id.
    r = httpx.post(f"{url}/v1/completions", json=dict(prompt="hi", best_of=3), headers=headers)
    assert r.status_code == 400 and r.headers["x-request-id"] == "trace-123"
    assert httpx.get(f"{url}/v1/nothing", headers=headers).headers["x-request-id"] == "trace-123"
    assert httpx.get(f"{url}/health", headers=headers).headers["x-request-id"] == "trace-123"
    r = httpx.post(f"{url}/v1/completions", json=dict(prompt="hi", max_tokens=1, request_id="body"), headers=headers)
    assert r.json()["id"] == "cmpl-trace-123"
    assert "x-request-id" not in httpx.get(f"{url}/health").headers


def test_the_same_x_request_id_twice_at_once(server):
    """Two concurrent requests with one X-Request-Id both complete (the engine's ids stay distinct)."""
    import concurrent.futures

    url, engine = server
    body = dict(model=MODEL, prompt="Hello", max_tokens=8, ignore_eos=True)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(httpx.post, f"{url}/v1/completions", json=body, headers={"X-Request-Id": "same"}, timeout=60)
            for _ in range(2)
        ]
        results = [f.result() for f in futures]
    assert [r.status_code for r in results] == [200, 200]
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in results)
    assert engine.num_unfinished_requests == 0


VLLM_NAMES = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:request_queue_time_seconds_bucket",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_generation_tokens_bucket",
    "fuseformer_e2e_request_latency_seconds_bucket",
    "fuseformer_request_queue_time_seconds_bucket",
]


def test_metrics_under_vllms_names(checkpoint, start_server, read_metric):
    with start_server(checkpoint) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=3, temperature=0, extra_body=dict(ignore_eos=True)
        )
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, n=2, extra_body=dict(ignore_eos=True))
        text = httpx.get(f"{url}/metrics").text
        for name in VLLM_NAMES:
            assert name in text, name
        assert 'vllm:request_success_total{finished_reason="length",model_name="tiny-llama"} 3.0' in text
        for prefix in ("vllm:", "fuseformer_"):
            assert read_metric(url, f"{prefix}generation_tokens_total") == 11
            assert read_metric(url, f"{prefix}prompt_tokens_total") == 2 * len(Tokenizer(checkpoint).encode("Hello"))
            assert read_metric(url, f"{prefix}e2e_request_latency_seconds_count") == 3  # one per completion
            assert read_metric(url, f"{prefix}request_generation_tokens_sum") == 11
            assert read_metric(url, f"{prefix}time_to_first_token_seconds_count") == 3
            assert read_metric(url, f"{prefix}kv_cache_usage_perc") == 0.0
        assert read_metric(url, "vllm:e2e_request_latency_seconds_sum") > 0
        if "first_scheduled_time" in RequestMetrics.__dataclass_fields__:  # once the engine reports it
            assert read_metric(url, "vllm:request_queue_time_seconds_count") == 2


def test_cached_tokens_after_a_prefix_hit(server, client):
    """usage.prompt_tokens_details.cached_tokens: the engine's prefix-cache hit, once it reports it
    (RequestOutput.num_cached_tokens); until then the details are null, never a wrong 0."""
    prompt = "The quick brown fox jumps over the lazy dog. Say hello"
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    if "num_cached_tokens" not in RequestOutput.__dataclass_fields__:
        assert first.usage.prompt_tokens_details is None and second.usage.prompt_tokens_details is None
        pytest.skip("the engine does not report RequestOutput.num_cached_tokens yet")
    assert second.usage.prompt_tokens_details.cached_tokens >= 4  # at least one block of 4 tokens
    assert second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens

"""The server against the faults issue 30's probe found: a large prompt must not stop other clients;
bodies over the limit get 413; the API key is checked from the headers alone; a chat template that
fails on the messages, or an unexpected error, answers in OpenAI's shape and keeps the connection;
requests still running at the shutdown timeout get an error (a stream: an error event, then [DONE]);
idle and slow-header connections are closed; a generation_config.json of the wrong type fails at load."""

import http.client
import json
import random
import shutil
import socket
import threading
import time

import httpx
import pytest

import fuseformer
from fuseformer.engine.llm import LLM

MODEL = "tiny-llama"  # the name tests/serve/conftest.py serves the model as


def _variant(checkpoint, tmp_path, tokenizer_config=None, generation_config=None):
    """A copy of the test checkpoint with tokenizer_config.json fields replaced, or a generation_config.json."""
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint, path)
    if tokenizer_config is not None:
        config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps(config | tokenizer_config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


def _fresh_text(num_words, seed=0):
    """Words unlike each other (the tokenizer caches words it has seen): ~1 us a character to tokenize."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join("".join(rng.choice(letters) for _ in range(rng.randint(6, 12))) for _ in range(num_words))


def _port(url):
    return int(url.rsplit(":", 1)[1])


# ---- item 3: large prompts, the body limit ---------------------------------------------------------


def test_a_large_prompt_does_not_stop_other_clients(checkpoint, start_server):
    """A ~2 MB prompt (~2 s to tokenize) is tokenized off the event loop with the GIL released: /health
    answers throughout, never 1 s apart (the whole process stopped for the tokenization before, this
    test's thread with it), and the prompt still gets its 400."""
    text = _fresh_text(220_000)
    with start_server(checkpoint) as (url, _):
        result = {}

        def big():
            start = time.monotonic()
            result["response"] = httpx.post(f"{url}/v1/completions", json=dict(prompt=text), timeout=120)
            result["seconds"] = time.monotonic() - start

        thread = threading.Thread(target=big)
        thread.start()
        answered = [time.monotonic()]
        while thread.is_alive():
            assert httpx.get(f"{url}/health", timeout=30).status_code == 200
            answered.append(time.monotonic())
            time.sleep(0.05)
        thread.join()
        r = result["response"]
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert result["seconds"] > 1.0, "the prompt tokenized too fast to tell"
        gaps = [b - a for a, b in zip(answered, answered[1:])]
        assert len(gaps) >= 5 and max(gaps) < 1.0, gaps


def test_a_list_of_prompts_stops_at_the_first_that_is_too_long(checkpoint, start_server):
    """The huge text after a prompt over the context length is never tokenized (it takes seconds)."""
    text = _fresh_text(220_000, seed=1)
    with start_server(checkpoint) as (url, _):
        start = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json=dict(prompt=["hi", "hello " * 80, text]), timeout=120)
        seconds = time.monotonic() - start
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        assert seconds < 1.0


def test_a_body_over_the_limit_is_413(checkpoint, start_server):
    with start_server(checkpoint, app_kwargs=dict(max_body_bytes=1000)) as (url, engine):
        small = dict(model=MODEL, prompt="Hello", max_tokens=2)
        big = dict(model=MODEL, prompt="x " * 600, max_tokens=2)

        def chunks():  # no Content-Length: the limit applies as the body arrives
            body = json.dumps(big).encode()
            for i in range(0, len(body), 100):
                yield body[i : i + 100]

        for kwargs in (dict(json=big), dict(content=chunks(), headers={"content-type": "application/json"})):
            r = httpx.post(f"{url}/v1/completions", **kwargs)
            assert r.status_code == 413, r.text
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and "1000 bytes" in error["message"]
        assert httpx.post(f"{url}/v1/completions", json=small).status_code == 200
        assert engine.num_unfinished_requests == 0
    with pytest.raises(ValueError, match="max_body_bytes"):
        from fuseformer.serve.app import create_app

        create_app(engine, MODEL, max_body_bytes=0)


# ---- item 8: the API key -----------------------------------------------------------------------


def test_the_api_key_is_checked_before_the_body_is_read(checkpoint, start_server):
    """Headers that announce a 100 MB body, and no body: 401 at once (413 with the key), not a wait."""
    with start_server(checkpoint, api_key="sekrit") as (url, _):
        for auth, status in (
            (b"", 401),
            (b"Authorization: Bearer wrong\r\n", 401),
            (b"Authorization: bearer sekrit\r\n", 413),
        ):
            with socket.create_connection(("127.0.0.1", _port(url)), timeout=5) as sock:
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + auth
                    + b"Content-Length: 100000000\r\n\r\n"
                )
                head = sock.recv(65536).split(b"\r\n", 1)[0]  # a timeout here: the server waited for the body
                assert head.startswith(b"HTTP/1.1 %d" % status), head


def test_the_api_key_is_compared_as_digests(checkpoint, start_server, monkeypatch):
    """hmac.compare_digest on SHA-256 digests: equal lengths whatever is sent, so the time taken does
    not tell the key's length."""
    import hmac

    from fuseformer.serve import app as app_module

    seen, real = [], hmac.compare_digest

    def compare(a, b):
        seen.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", compare)
    with start_server(checkpoint, api_key="sekrit") as (url, _):
        for key in ("s", "sekrit", "x" * 1000):
            httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert seen == [(32, 32)] * 3


@pytest.mark.parametrize("key", ["", " sekrit", "sek rit", "sekrit\n", "ключ", "k\x00", "k\x7f"])
def test_an_api_key_no_client_can_send_is_refused(key, checkpoint, capsys):
    from fuseformer.serve import cli
    from fuseformer.serve.app import check_api_key

    with pytest.raises(ValueError, match="API key"):
        check_api_key(key)
    assert cli.main(["serve", "--model", str(checkpoint), "--api-key", key]) == 2
    assert "--api-key" in capsys.readouterr().err


# ---- items 4 and 7: templates and unexpected errors keep the connection ---------------------------------


def _two_requests(url, first, second=("GET", "/health", None)):
    """Two requests on one keep-alive connection: (status, body) of each; the second fails if the server
    closed the connection after the first."""
    conn = http.client.HTTPConnection("127.0.0.1", _port(url), timeout=60)
    results = []
    try:
        for method, path, body in (first, second):
            headers = {"Content-Type": "application/json"}
            conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
            r = conn.getresponse()
            results.append((r.status, r.read(), r.getheader("connection")))
            sock = conn.sock
            assert sock is not None, "the server closed the connection"
        return results
    finally:
        conn.close()


def test_a_chat_template_over_jinja_range_limit_is_400_and_keeps_the_connection(checkpoint, tmp_path, start_server):
    template = "{% for i in range(messages|length * 200000) %}x{% endfor %}"  # the sandbox allows 100,000
    path = _variant(checkpoint, tmp_path, tokenizer_config=dict(chat_template=template))
    with start_server(path) as (url, _):
        body = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}])
        for stream in (False, True):
            (status, raw, _), (health, _, _) = _two_requests(
                url, ("POST", "/v1/chat/completions", body | dict(stream=stream))
            )
            error = json.loads(raw)["error"]
            assert status == 400 and error["param"] == "messages" and "OverflowError" in error["message"], raw
            assert health == 200


def test_an_unexpected_error_is_500_in_openai_shape_and_keeps_the_connection(checkpoint, start_server, monkeypatch):
    with start_server(checkpoint) as (url, engine):

        async def broken(*args, **kwargs):
            raise RuntimeError("boom")

        monkeypatch.setattr(engine, "add_request", broken)
        body = dict(model=MODEL, prompt="Hello", max_tokens=2)
        for stream in (False, True):
            (status, raw, _), (health, _, _) = _two_requests(
                url, ("POST", "/v1/completions", body | dict(stream=stream))
            )
            error = json.loads(raw)["error"]
            assert status == 500 and set(error) == {"message", "type", "param", "code"}, raw
            assert error["type"] == "internal_server_error" and "RuntimeError: boom" in error["message"]
            assert health == 200
        monkeypatch.undo()

        # Raised while a response streams: an error event, then [DONE].
        from fuseformer.engine.async_engine import RequestStream

        async def failing(self):
            raise RuntimeError("mid-stream")

        monkeypatch.setattr(RequestStream, "get_batch", failing)
        lines = [
            line
            for line in httpx.post(f"{url}/v1/completions", json=body | dict(stream=True)).text.splitlines()
            if line.startswith("data: ")
        ]
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert error["type"] == "internal_server_error" and "mid-stream" in error["message"]


# ---- item 5: the shutdown timeout ----------------------------------------------------------------


def test_requests_running_at_the_shutdown_timeout_get_an_error(checkpoint, start_server, monkeypatch):
    """Each step slowed to 50 ms, 40 tokens each: neither request finishes within the 0.5 s timeout.
    Non-streaming: a 503 in OpenAI's shape (it was uvicorn's plain-text 500); streaming: an error event
    and [DONE] (the stream was cut)."""
    results = {}
    body = dict(model=MODEL, prompt="Hello", max_tokens=40, ignore_eos=True)
    with start_server(checkpoint, server_kwargs=dict(shutdown_timeout=0.5)) as (url, engine):
        step = engine.core.step

        def slow_step(output_processor):
            time.sleep(0.05)
            return step(output_processor)

        monkeypatch.setattr(engine.core, "step", slow_step)

        def whole():
            results["whole"] = httpx.post(f"{url}/v1/completions", json=body, timeout=60)

        def streamed():
            chat = {k: v for k, v in body.items() if k != "prompt"}  # chat takes messages (unknown names: 400)
            with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=60, json=chat | dict(
                stream=True, messages=[{"role": "user", "content": "hi"}])) as r:  # fmt: skip
                results["stream"] = [line for line in r.iter_lines() if line.startswith("data: ")]

        threads = [threading.Thread(target=whole), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while engine.num_unfinished_requests < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        start = time.monotonic()
    for t in threads:
        t.join(30)
    assert time.monotonic() - start < 5
    r = results["whole"]
    assert r.status_code == 503, r.text
    error = r.json()["error"]
    assert error["code"] == "server_shutdown" and "shutdown-timeout" in error["message"]
    lines = results["stream"]
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert json.loads(lines[-2][6:])["error"]["code"] == "server_shutdown"


# ---- item 7: connections -------------------------------------------------------------------------


def _closed_within(sock, seconds):
    """True once the server closes ``sock`` (reads b"" or a reset) within ``seconds``."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_and_slow_header_connections_are_closed(checkpoint, start_server):
    kwargs = dict(header_timeout=0.5, timeout_keep_alive=0.5)
    with start_server(checkpoint, server_kwargs=kwargs) as (url, _):
        address = ("127.0.0.1", _port(url))
        # Connects and sends nothing.
        with socket.create_connection(address) as sock:
            start = time.monotonic()
            assert _closed_within(sock, 5) and time.monotonic() - start < 3
        # Sends its headers a byte every 0.1 s: closed about 0.5 s after the first.
        with socket.create_connection(address) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\n")
            start = time.monotonic()
            try:
                while time.monotonic() - start < 5:
                    sock.sendall(b"X")
                    time.sleep(0.1)
            except (BrokenPipeError, ConnectionResetError):
                pass
            assert time.monotonic() - start < 3
        # Idle after a response (uvicorn's keep-alive timeout); a second request before it is served.
        with socket.create_connection(address) as sock:
            for _ in range(2):
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                assert sock.recv(65536).startswith(b"HTTP/1.1 200")
                time.sleep(0.2)
            assert _closed_within(sock, 5)
        # A request whose headers take longer than the timeout in total, each part in time, is served.
        assert httpx.get(f"{url}/health").status_code == 200


# ---- item 6: generation_config.json -------------------------------------------------------------


@pytest.mark.parametrize(
    "config, field",
    [(dict(temperature="hot"), "temperature"), (dict(top_k=2.5), "top_k"), (dict(do_sample="yes"), "do_sample"),
     (dict(eos_token_id="x"), "eos_token_id"), (dict(max_new_tokens="9"), "max_new_tokens")],
)  # fmt: skip
def test_a_wrong_type_in_generation_config_fails_at_load(checkpoint, tmp_path, config, field, capsys):
    """Not a healthy server whose every request fails with 500: LLM (and so serve and generate)
    refuses the model, naming the file and the field."""
    from fuseformer.engine import cli as generate_cli
    from fuseformer.serve import cli

    path = _variant(checkpoint, tmp_path, generation_config=config)
    with pytest.raises(ValueError, match=f"generation_config.json: {field} must be"):
        LLM(path, device="cpu")
    assert cli.main(["serve", "--model", str(path), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "generation_config.json" in err and field in err and "Traceback" not in err
    assert generate_cli.main(["generate", "--model", str(path), "--device", "cpu", "Hello"]) != 0
    err = capsys.readouterr().err
    assert "generation_config.json" in err and field in err and "Traceback" not in err


def test_a_value_out_of_range_in_generation_config_fails_serve_at_start(checkpoint, tmp_path, capsys):
    from fuseformer.serve import cli

    path = _variant(checkpoint, tmp_path, generation_config=dict(temperature=-1.0, top_p=None))
    with fuseformer.use_backend("reference"):
        assert LLM(path, device="cpu").tokenizer.generation_defaults == dict(temperature=-1.0)  # null: unset
    assert cli.main(["serve", "--model", str(path), "--device", "cpu"]) == 1
    err = capsys.readouterr().err
    assert "generation_config.json" in err and "temperature must be" in err


@pytest.mark.parametrize("bos, eos", [(False, False), (True, False), (True, True)])
def test_the_gil_free_encode_equals_tokenizer_encode(checkpoint, bos, eos):
    """The server tokenizes through encode_batch (it releases the GIL); the ids are Tokenizer.encode's."""
    from fuseformer.models.tokenizer import Tokenizer
    from fuseformer.serve.app import _encode_text

    tok = Tokenizer(checkpoint)
    tok.add_bos_token, tok.add_eos_token = bos, eos
    for text in ["", "Hello world", "<s>Hello</s>", "é中😀 fox " * 20]:
        for special in (True, False):
            assert _encode_text(tok, text, special) == tok.encode(text, add_special_tokens=special)

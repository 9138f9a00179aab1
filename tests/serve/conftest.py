"""Server test helpers: a tiny Llama checkpoint with a byte-level BPE tokenizer and a chat template
(built here, as tests/engine/test_llm.py builds its own), and a server on a free loopback port run by
uvicorn on a thread for the length of a ``with`` block (models on their PyTorch references: the point
is the server)."""

import contextlib
import math
import socket
import threading
import time

import httpx
import pytest
import torch
import transformers

import fuseformer
from fuseformer.engine.async_engine import AsyncEngine
from fuseformer.engine.llm import LLM
from fuseformer.testing import save_tiny_tokenizer

CORPUS = [
    "Hello world, this is a tiny corpus for a tiny tokenizer.",
    "The quick brown fox jumps over the lazy dog. Say hello to the server.",
    "Continuous batching, paged attention and prefix caching make serving fast.",
] * 3
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MODEL = "tiny-llama"
LLM_KWARGS = dict(num_kv_blocks=256, block_size=4, max_model_len=64, device="cpu")


def make_checkpoint(path):
    eos = save_tiny_tokenizer(path, CORPUS, CHAT_TEMPLATE)
    hf_config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=320, bos_token_id=0, eos_token_id=eos,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(hf_config).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # logits O(1)-O(10): sampled text varies with the seed, greedy text is decisive
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen)
            if p.dim() == 1:
                p.copy_(1 + 0.3 * r)
            elif "embed_tokens" in name:
                p.copy_(r)
            else:
                p.copy_(r * (2.0 if "lm_head" in name else 1.0) / math.sqrt(p.shape[1]))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("serve_ckpt"))


@contextlib.contextmanager
def running_server(
    checkpoint,
    api_key=None,
    timeout=120.0,
    backend="reference",
    overlap_prefill=False,
    app_kwargs=None,
    server_kwargs=None,
    **llm_kwargs,
):
    """Yield (base URL, AsyncEngine) of a server on 127.0.0.1 (a free port), stopped on exit, built as
    ``fuseformer serve`` builds it (``make_uvicorn_server``). ``checkpoint``: a model directory, or an
    LLM to serve as it is. ``app_kwargs``: more ``create_app`` arguments;
    ``server_kwargs``: ``make_uvicorn_server``'s (shutdown_timeout 5 s unless given)."""
    from fuseformer.serve.app import create_app
    from fuseformer.serve.cli import make_uvicorn_server

    with fuseformer.use_backend(backend):
        llm = checkpoint if isinstance(checkpoint, LLM) else LLM(checkpoint, **(LLM_KWARGS | llm_kwargs))
        engine = AsyncEngine(llm, start=False, overlap_prefill=overlap_prefill)
        app = create_app(engine, MODEL, api_key=api_key, **(app_kwargs or {}))
        # IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets whose proto says TCP (uvicorn's own do);
        # without it a reused connection's first chunk waits ~40 ms for the client's delayed ACK.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        server = make_uvicorn_server(app, **(dict(shutdown_timeout=5, log_level="warning") | (server_kwargs or {})))
        thread = threading.Thread(target=server.run, kwargs=dict(sockets=[sock]), daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        try:
            yield f"http://127.0.0.1:{port}", engine
        finally:
            server.should_exit = True
            thread.join(timeout)
            sock.close()
            assert not thread.is_alive(), "the server did not stop"


def wait_until(predicate, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def metric(base_url, name):
    """The value of an unlabelled-but-for-model_name sample in /metrics."""
    text = httpx.get(f"{base_url}/metrics").text
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics:\n{text}")


# Test files cannot import this module (pytest's importlib mode): they get its helpers as fixtures.
@pytest.fixture(scope="session")
def start_server():
    return running_server


@pytest.fixture(scope="session")
def read_metric():
    return metric


@pytest.fixture
def gpu_staggered(checkpoint):
    """The GPU overlap tests' case (skipped without CUDA): (LLM kwargs: fp32 on CUDA, four prompts, 40
    greedy tokens each, what ``LLM.generate`` returns for them)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from fuseformer.engine.sampling_params import SamplingParams

    kwargs = dict(num_kv_blocks=256, block_size=4, max_model_len=64, device="cuda", dtype="float32")
    prompts = ["Hello world", "The quick brown fox", "Say hello", "Once upon"]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    return kwargs, prompts, params, LLM(checkpoint, **kwargs).generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="session")
def llm_kwargs():
    return dict(LLM_KWARGS)

"""Shared pieces of the trainer tests: a tiny model config, a learnable synthetic corpus, a byte-level
BPE tokenizer trained in the session, and one intra-op thread (the CPU tests are many tiny ops)."""

import numpy as np
import pytest
import torch

from fuseformer.models.config import ModelConfig
from fuseformer.train.data import TokenCorpus
from fuseformer.train.presets import train_tokenizer

VOCAB = 32
EOS = VOCAB - 1


def tiny_model(**overrides) -> ModelConfig:
    args = dict(
        architecture="LlamaForCausalLM",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return ModelConfig(**(args | overrides))


def synthetic_corpus(num_docs: int = 60, seed: int = 0) -> TokenCorpus:
    """Documents that are arithmetic progressions mod 31 (learnable from two tokens of context)."""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(num_docs):
        a, d, n = rng.integers(0, EOS), rng.integers(1, 4), rng.integers(3, 30)
        docs.append([int((a + d * i) % EOS) for i in range(n)])
    return TokenCorpus.from_documents(docs, eos_id=EOS)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SAMPLE_TEXTS = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "import os\nimport sys\n\n\ndef main():\n    print(os.getcwd(), sys.argv)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i * i)\n# squares of the first ten numbers\n",
] * 4


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """A byte-level BPE tokenizer directory (vocab 300) trained on a few Python snippets."""
    return train_tokenizer(SAMPLE_TEXTS, tmp_path_factory.mktemp("tokenizer"), vocab_size=300)


@pytest.fixture
def model_config():
    """model_config(**overrides) -> a tiny Llama ModelConfig (vocab 32, hidden 32, 2 layers, GQA 4/2)."""
    return tiny_model


@pytest.fixture
def corpus():
    """corpus(num_docs=60, seed=0) -> a synthetic TokenCorpus over the tiny vocab (EOS 31)."""
    return synthetic_corpus

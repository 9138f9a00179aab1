"""The byte-level BPE tokenizer the presets train, and the stdlib data of the builtin preset."""

import json

import pytest

from fuseformer.models.tokenizer import Tokenizer
from fuseformer.train.presets import EOS_TOKEN, prepare_preset, stdlib_dir, stdlib_files

CODE = 'def fibonacci(n):\n    """Return the n-th number."""\n    return n if n < 2 else fibonacci(n - 1)  # é ✓\n'


def test_trained_tokenizer_directory(tokenizer_dir):
    tok = Tokenizer(tokenizer_dir)
    assert tok.eos_token == EOS_TOKEN and tok.eos_token_id is not None
    assert tok.eos_token_ids == [tok.eos_token_id]  # generation_config.json agrees
    assert tok.vocab_size <= 300
    ids = tok.encode(CODE)
    assert tok.decode(ids) == CODE  # byte level: any text round-trips, spaces and non-ASCII included
    assert tok.eos_token_id not in ids  # no special tokens added to plain text
    assert len(ids) < len(CODE.encode())  # merges were learned
    assert tok.encode(EOS_TOKEN, add_special_tokens=False) == [tok.eos_token_id]
    cfg = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and cfg["add_bos_token"] is False


def test_transformers_reads_tokenizer(tokenizer_dir):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    ours = Tokenizer(tokenizer_dir)
    assert hf(CODE, add_special_tokens=False)["input_ids"] == ours.encode(CODE)
    assert hf.eos_token == EOS_TOKEN


def test_stdlib_data():
    files = stdlib_files()
    assert len(files) > 100 and all(f.suffix == ".py" for f in files)
    assert not any("site-packages" in f.parts for f in files)
    assert (stdlib_dir() / "os.py") in files
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        prepare_preset("nope")

"""Data: file discovery, UTF-8 handling, the tokenized cache, document split, packing, sampling."""

import json
import warnings

import numpy as np
import pytest
import torch

from fuseformer.models.tokenizer import Tokenizer
from fuseformer.train.data import (
    IGNORE_INDEX,
    PackedRows,
    RowSampler,
    TokenCorpus,
    collate,
    find_files,
    load_corpus,
    micro_batches,
)


def _corpus(lengths, eos=99):
    docs = [[10 * (d + 1) + i for i in range(n)] for d, n in enumerate(lengths)]
    return TokenCorpus.from_documents(docs, eos_id=eos), docs


def test_corpus_layout():
    corpus, docs = _corpus([3, 1, 4])
    assert corpus.tokens.dtype == np.uint16
    assert corpus.doc_starts.tolist() == [0, 4, 6, 11]
    assert corpus.tokens.tolist() == [10, 11, 12, 99, 20, 99, 30, 31, 32, 33, 99]
    big = TokenCorpus.from_documents([[70000, 1]], eos_id=2)
    assert big.tokens.dtype == np.uint32 and big.tokens.tolist() == [70000, 1, 2]


def test_packing_boundaries():
    # stream: [10 11 12 E | 20 E | 30 31 32 33 E | 40 41 E], 15 tokens; S = 4 -> 3 rows
    corpus, _ = _corpus([3, 1, 4, 2])
    rows = PackedRows(corpus, 4)
    assert len(rows) == 3
    ids, targets, pieces = rows.row(0)
    assert ids.tolist() == [10, 11, 12, 99] and pieces == [4]
    # the EOS's next token (20) starts the next document: its target is ignored
    assert targets.tolist() == [11, 12, 99, IGNORE_INDEX]
    ids, targets, pieces = rows.row(1)
    assert ids.tolist() == [20, 99, 30, 31] and pieces == [2, 2]
    assert targets.tolist() == [99, IGNORE_INDEX, 31, 32]
    ids, targets, pieces = rows.row(2)
    assert ids.tolist() == [32, 33, 99, 40] and pieces == [3, 1]
    assert targets.tolist() == [33, 99, IGNORE_INDEX, 41]

    batch = collate([rows.row(1), rows.row(2)])
    assert batch.input_ids.tolist() == [20, 99, 30, 31, 32, 33, 99, 40]
    assert batch.positions.tolist() == [0, 1, 0, 1, 0, 1, 2, 0]
    assert batch.cu_seqlens.tolist() == [0, 2, 4, 7, 8] and batch.cu_seqlens.dtype == torch.int32
    assert batch.max_seqlen == 3
    assert batch.num_targets == 6


@pytest.mark.parametrize("seq_len", [1, 5, 16, 37])
def test_packing_covers_stream(seq_len):
    rng = np.random.default_rng(seq_len)
    corpus, _ = _corpus(rng.integers(1, 20, size=30).tolist())
    rows = PackedRows(corpus, seq_len)
    assert len(rows) == (corpus.num_tokens - 1) // seq_len
    doc_of = np.searchsorted(corpus.doc_starts, np.arange(corpus.num_tokens), side="right") - 1
    for i in range(len(rows)):
        ids, targets, pieces = rows.row(i)
        a = i * seq_len
        assert ids.tolist() == corpus.tokens[a : a + seq_len].tolist()
        assert sum(pieces) == seq_len
        # a piece never spans two documents; a target is kept iff it is in the same document
        edges = np.cumsum([0, *pieces])
        for e0, e1 in zip(edges[:-1], edges[1:]):
            assert len(set(doc_of[a + e0 : a + e1])) == 1
        same = doc_of[a : a + seq_len] == doc_of[a + 1 : a + seq_len + 1]
        assert ((targets != IGNORE_INDEX) == same).all()
        assert (targets[same] == corpus.tokens[a + 1 : a + seq_len + 1][same]).all()


def test_split_by_document():
    corpus, docs = _corpus(list(range(1, 41)))
    train, held = corpus.split(0.1, seed=3)
    assert held.num_docs == 4 and train.num_docs == 36

    def doc_set(c):
        return {tuple(c.tokens[s:e].tolist()) for s, e in zip(c.doc_starts[:-1], c.doc_starts[1:])}

    assert doc_set(train).isdisjoint(doc_set(held))
    assert doc_set(train) | doc_set(held) == doc_set(corpus)
    again, held2 = corpus.split(0.1, seed=3)
    assert held2.tokens.tolist() == held.tokens.tolist()
    _, other = corpus.split(0.1, seed=4)
    assert other.tokens.tolist() != held.tokens.tolist()
    assert corpus.split(0.0, seed=0) == (corpus, None)
    one, _ = _corpus([5])
    with pytest.raises(ValueError, match="eval_split"):
        one.split(0.5, seed=0)


def test_sampler_deterministic_and_resumable():
    a = RowSampler(10, 4, seed=1)
    steps = [a.next_step().tolist() for _ in range(5)]  # 2 steps an epoch (tail of 2 dropped)
    assert [len(s) for s in steps] == [4] * 5
    assert len(set(steps[0] + steps[1])) == 8
    assert a.epoch == 2
    b = RowSampler(10, 4, seed=1)
    assert [b.next_step().tolist() for _ in range(5)] == steps
    c = RowSampler(10, 4, seed=1)
    c.next_step(), c.next_step(), c.next_step()
    state = c.state_dict()
    d = RowSampler(10, 4, seed=1)
    d.load_state_dict(state)
    assert [d.next_step().tolist() for _ in range(2)] == steps[3:]
    assert RowSampler(10, 4, seed=2).next_step().tolist() != steps[0]
    with pytest.raises(ValueError, match="data"):
        d.load_state_dict({**state, "num_rows": 11})
    with pytest.raises(ValueError, match="one step needs 4"):
        RowSampler(3, 4, seed=0)


def test_micro_batches_partition():
    rows = np.arange(12)
    world = [micro_batches(rows, 2, r, 3) for r in range(3)]  # 2 micro-batches per rank
    assert [len(w) for w in world] == [2, 2, 2]
    flat = sorted(int(i) for w in world for mb in w for i in mb)
    assert flat == list(range(12))
    assert world[1][0].tolist() == [2, 3] and world[1][1].tolist() == [8, 9]


def test_find_files(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.py").write_text("x = 1\n")
    (tmp_path / "a" / "y.txt").write_text("hello\n")
    (tmp_path / "a" / "skip.bin").write_bytes(b"\0")
    (tmp_path / "site-packages").mkdir()
    (tmp_path / "site-packages" / "z.py").write_text("z = 1\n")
    found = find_files([tmp_path], (".py", ".txt"), exclude=("site-packages",))
    assert [f.name for f in found] == ["x.py", "y.txt"]
    assert len(find_files([tmp_path], (".py",))) == 2
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no files"):
        find_files([tmp_path / "empty"], (".py",))
    with pytest.raises(ValueError, match="does not exist"):
        find_files([tmp_path / "nope"], (".py",))
    with pytest.raises(ValueError, match="no data paths"):
        find_files([], (".py",))


def test_tokenize_cache_and_non_utf8(tmp_path, tokenizer_dir):
    tok = Tokenizer(tokenizer_dir)
    data = tmp_path / "data"
    data.mkdir()
    texts = {"a.py": "def f(x):\n    return x + 1\n", "b.py": "print('hello')\n", "c.py": ""}
    for name, text in texts.items():
        (data / name).write_text(text)
    (data / "bad.py").write_bytes(b"x = '\xff\xfe'\n")  # latin-1 bytes: not UTF-8
    cache = tmp_path / "cache"
    eos = tok.eos_token_id
    with pytest.warns(UserWarning, match="skipped 1 file"):
        corpus = load_corpus([data], tok, eos, (".py",), cache)
    assert corpus.skipped == (str(data / "bad.py"),)
    assert corpus.num_docs == 2  # the empty file is no document
    expected = [*tok.encode(texts["a.py"], add_special_tokens=False), eos]
    expected += [*tok.encode(texts["b.py"], add_special_tokens=False), eos]
    assert corpus.tokens.tolist() == expected
    entries = list(cache.iterdir())
    assert len(entries) == 1 and json.loads((entries[0] / "index.json").read_text())["num_tokens"] == len(expected)

    # second load: read from the cache (a memmap), same tokens; the skip is still reported
    with pytest.warns(UserWarning, match="not UTF-8"):
        again = load_corpus([data], tok, eos, (".py",), cache)
    assert isinstance(again.tokens, np.memmap) and again.tokens.tolist() == expected
    assert again.skipped == corpus.skipped

    # a changed file is a new cache entry with the new tokens
    (data / "b.py").write_text("print('changed text here')\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        changed = load_corpus([data], tok, eos, (".py",), cache)
    assert len(list(cache.iterdir())) == 2
    assert changed.tokens.tolist() != expected


def test_only_bad_files(tmp_path, tokenizer_dir):
    tok = Tokenizer(tokenizer_dir)
    (tmp_path / "bad.txt").write_bytes(b"\xff\xfe\xfd")
    with pytest.warns(UserWarning), pytest.raises(ValueError, match="no tokens"):
        load_corpus([tmp_path], tok, tok.eos_token_id, (".txt",))

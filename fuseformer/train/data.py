"""Training data: text files -> one token stream -> packed rows with document boundaries.

    files ──tokenize (cached on disk)──> TokenCorpus: tokens (N,) with EOS after every document,
                                         doc_starts (D+1,) offsets
          ──split by document──────────> train / eval corpora
          ──PackedRows(seq_len)────────> row i = tokens[i*S : i*S + S] (+1 for the targets)
          ──RowSampler(seed)───────────> the rows of each optimizer step, shuffled per epoch
          ──collate────────────────────> Batch: flattened (T,) ids/positions/targets + cu_seqlens

A row holds pieces of several documents. Each piece is its own varlen sequence (``cu_seqlens``),
so attention never crosses documents, and its positions restart at 0. The target of a document's
last token (its EOS) would be the next document's first token: it is ignored (-100). A document
longer than a row continues in the next row, as a new piece (positions from 0 again).
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

IGNORE_INDEX = -100
_CACHE_VERSION = 1
_ENCODE_BATCH = 256  # files tokenized per encode_batch call (the tokenizers library parallelizes it)


# --------------------------------------------------------------------------------------------
# Tokenized corpus
# --------------------------------------------------------------------------------------------
@dataclass(slots=True)
class TokenCorpus:
    """Documents back to back, each ending with EOS.

    tokens: (N,) uint16 or uint32 (a numpy memmap when read from the cache).
    doc_starts: (D+1,) int64, document d is tokens[doc_starts[d]:doc_starts[d+1]].
    skipped: files that were not UTF-8 text (skipped with a warning).
    """

    tokens: np.ndarray
    doc_starts: np.ndarray
    skipped: tuple[str, ...] = ()

    @property
    def num_docs(self) -> int:
        return len(self.doc_starts) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.doc_starts[-1])

    @classmethod
    def from_documents(cls, docs: Sequence[Sequence[int]], eos_id: int, skipped: Sequence[str] = ()) -> TokenCorpus:
        """Token id lists (without EOS) -> a corpus; empty documents are dropped."""
        docs = [d for d in docs if len(d)]
        lengths = np.array([len(d) + 1 for d in docs], dtype=np.int64)
        starts = np.zeros(len(docs) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        top = max([eos_id, *(max(d) for d in docs)])
        tokens = np.empty(int(starts[-1]), dtype=_token_dtype(top))
        for d, s in zip(docs, starts[:-1]):
            tokens[s : s + len(d)] = d
            tokens[s + len(d)] = eos_id
        return cls(tokens, starts, tuple(skipped))

    def select(self, docs: np.ndarray) -> TokenCorpus:
        """A corpus of the documents ``docs`` (indices), in that order."""
        lengths = self.doc_starts[docs + 1] - self.doc_starts[docs]
        starts = np.zeros(len(docs) + 1, dtype=np.int64)
        np.cumsum(lengths, out=starts[1:])
        tokens = np.empty(int(starts[-1]), dtype=self.tokens.dtype)
        for d, s, n in zip(docs, starts[:-1], lengths):
            tokens[s : s + n] = self.tokens[self.doc_starts[d] : self.doc_starts[d] + n]
        return TokenCorpus(tokens, starts, self.skipped)

    def split(self, eval_fraction: float, seed: int) -> tuple[TokenCorpus, TokenCorpus | None]:
        """(train, eval) by document: a seeded random ``eval_fraction`` of the documents (at least
        one when the fraction is > 0) is held out. The train documents keep their order."""
        if eval_fraction <= 0:
            return self, None
        if self.num_docs < 2:
            raise ValueError(f"eval_split: {self.num_docs} document(s) cannot be split into train and eval")
        n_eval = min(self.num_docs - 1, max(1, round(eval_fraction * self.num_docs)))
        perm = np.random.default_rng([seed, 0xE7A1]).permutation(self.num_docs)
        eval_docs, train_docs = np.sort(perm[:n_eval]), np.sort(perm[n_eval:])
        return self.select(train_docs), self.select(eval_docs)


def _token_dtype(max_id: int) -> np.dtype:
    return np.dtype(np.uint16) if max_id < 2**16 else np.dtype(np.uint32)


def find_files(paths: Sequence[str | Path], suffixes: Sequence[str], exclude: Sequence[str] = ()) -> list[Path]:
    """Files named in ``paths`` and files under folders in ``paths`` (recursive, by suffix, skipping
    folders named in ``exclude``), sorted."""
    if not paths:
        raise ValueError("data: no data paths given")
    files: list[Path] = []
    exclude_set = set(exclude)
    for p in map(Path, paths):
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            found = sorted(
                f
                for f in p.rglob("*")
                if f.suffix in suffixes and not exclude_set.intersection(f.relative_to(p).parts[:-1]) and f.is_file()
            )
            if not found:
                raise ValueError(f"data: folder {p} holds no files ending in {tuple(suffixes)}")
            files.extend(found)
        else:
            raise ValueError(f"data: {p} does not exist")
    return sorted(dict.fromkeys(files))


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A string that changes when the tokenizer's vocabulary or rules change (for the cache key)."""
    inner = getattr(tokenizer, "_tok", tokenizer)
    to_str = getattr(inner, "to_str", None)
    return to_str() if callable(to_str) else repr(tokenizer)


def _batch_encoder(tokenizer: Any) -> Callable[[list[str]], list[list[int]]]:
    """texts -> token ids without special tokens, for our models.tokenizer.Tokenizer, a
    ``tokenizers.Tokenizer``, or anything with ``encode(text) -> list[int]``."""
    inner = getattr(tokenizer, "_tok", tokenizer)
    if hasattr(inner, "encode_batch"):
        return lambda texts: [e.ids for e in inner.encode_batch(texts, add_special_tokens=False)]
    return lambda texts: [list(tokenizer.encode(t, add_special_tokens=False)) for t in texts]


def tokenize_files(files: Sequence[Path], tokenizer: Any, eos_id: int) -> TokenCorpus:
    """Each file one document; files that are not UTF-8 are skipped with one warning, and counted."""
    encode = _batch_encoder(tokenizer)
    docs: list[list[int]] = []
    skipped: list[str] = []
    for i in range(0, len(files), _ENCODE_BATCH):
        texts = []
        for f in files[i : i + _ENCODE_BATCH]:
            try:
                texts.append(f.read_bytes().decode("utf-8"))
            except UnicodeDecodeError:
                skipped.append(str(f))
        docs.extend(encode([t for t in texts if t]))
    if skipped:
        more = f" and {len(skipped) - 3} more" if len(skipped) > 3 else ""
        warnings.warn(
            f"data: skipped {len(skipped)} file(s) that are not UTF-8 text: {skipped[:3]}{more}", stacklevel=2
        )
    if not any(docs):
        raise ValueError(f"data: no tokens in {len(files)} file(s) ({len(skipped)} skipped as not UTF-8)")
    return TokenCorpus.from_documents(docs, eos_id, skipped)


def load_corpus(
    paths: Sequence[str | Path],
    tokenizer: Any,
    eos_id: int,
    suffixes: Sequence[str],
    cache_dir: str | Path | None = None,
    exclude: Sequence[str] = (),
) -> TokenCorpus:
    """Tokenize the files of ``paths``, or read them from the cache in ``cache_dir``.

    The cache entry is keyed by a hash of the file list (paths, sizes, mtimes), the tokenizer and
    EOS id: tokens.bin (raw uint16/uint32, read back as a memmap) and index.json (doc offsets,
    skipped files). It is written to a temporary name and renamed, so a killed run leaves no half
    entry.
    """
    files = find_files(paths, suffixes, exclude)
    if cache_dir is None:
        return tokenize_files(files, tokenizer, eos_id)
    h = hashlib.sha256()
    h.update(f"v{_CACHE_VERSION} eos={eos_id}\n".encode())
    h.update(tokenizer_fingerprint(tokenizer).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    entry = Path(cache_dir) / h.hexdigest()[:24]
    if (entry / "index.json").is_file():
        index = json.loads((entry / "index.json").read_text())
        tokens = np.memmap(entry / "tokens.bin", dtype=np.dtype(index["dtype"]), mode="r", shape=(index["num_tokens"],))
        skipped = tuple(index["skipped"])
        if skipped:
            warnings.warn(
                f"data: {len(skipped)} file(s) skipped as not UTF-8 (cached): {list(skipped[:3])}", stacklevel=2
            )
        return TokenCorpus(tokens, np.asarray(index["doc_starts"], dtype=np.int64), skipped)
    corpus = tokenize_files(files, tokenizer, eos_id)
    tmp = entry.with_name(f".{entry.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    corpus.tokens.tofile(tmp / "tokens.bin")
    index = {
        "num_tokens": corpus.num_tokens,
        "dtype": corpus.tokens.dtype.name,
        "doc_starts": corpus.doc_starts.tolist(),
        "skipped": list(corpus.skipped),
        "files": [str(f) for f in files],
    }
    (tmp / "index.json").write_text(json.dumps(index))
    try:
        os.replace(tmp, entry)
    except OSError:  # another rank or run wrote the same entry first: theirs is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return corpus


# --------------------------------------------------------------------------------------------
# Packing and batches
# --------------------------------------------------------------------------------------------
class PackedRows:
    """Fixed-length rows over a corpus: row i holds tokens [i*S, i*S + S) and their next tokens."""

    def __init__(self, corpus: TokenCorpus, seq_len: int) -> None:
        self.corpus, self.seq_len = corpus, seq_len
        self.num_rows = max(0, (corpus.num_tokens - 1) // seq_len)

    def __len__(self) -> int:
        return self.num_rows

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """(input ids (S,) int64, targets (S,) int64 with -100 where the next token starts another
        document, the lengths of the document pieces in the row (sum S))."""
        s = self.seq_len
        a = i * s
        span = np.asarray(self.corpus.tokens[a : a + s + 1], dtype=np.int64)
        starts = self.corpus.doc_starts
        # Documents starting inside (a, a + S]: a piece ends before each; the last one may start the
        # next row, and then only the target of this row's last token is cut.
        lo, hi = np.searchsorted(starts, [a + 1, a + s + 1])
        cuts = starts[lo:hi] - a  # in (0, S]
        targets = span[1:].copy()
        targets[cuts - 1] = IGNORE_INDEX
        edges = [0, *cuts[cuts < s].tolist(), s]
        return span[:s], targets, [e1 - e0 for e0, e1 in zip(edges[:-1], edges[1:])]


@dataclass(slots=True)
class Batch:
    """A micro-batch flattened to T = rows * S tokens, as the model's varlen forward takes it.

    input_ids, positions, targets: (T,) int64; cu_seqlens: (pieces+1,) int32; max_seqlen: host int.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    targets: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int

    @property
    def num_targets(self) -> int:
        return int((self.targets != IGNORE_INDEX).sum())

    def to(self, device: torch.device | str) -> Batch:
        nb = torch.device(device).type == "cuda"
        return Batch(
            *(t.to(device, non_blocking=nb) for t in (self.input_ids, self.positions, self.targets, self.cu_seqlens)),
            self.max_seqlen,
        )


def collate(rows: Sequence[tuple[np.ndarray, np.ndarray, list[int]]]) -> Batch:
    """PackedRows.row outputs -> one Batch (pieces of all rows as consecutive varlen sequences)."""
    seqlens = [n for _, _, pieces in rows for n in pieces]
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in seqlens]) if seqlens else np.zeros(0, np.int64)
    cu = np.zeros(len(seqlens) + 1, dtype=np.int32)
    np.cumsum(seqlens, out=cu[1:])
    ids = np.concatenate([r[0] for r in rows]) if rows else np.zeros(0, np.int64)
    targets = np.concatenate([r[1] for r in rows]) if rows else np.zeros(0, np.int64)
    return Batch(
        torch.from_numpy(ids),
        torch.from_numpy(positions),
        torch.from_numpy(targets),
        torch.from_numpy(cu),
        max(seqlens, default=0),
    )


class RowSampler:
    """Which rows each optimizer step uses: a seeded permutation per epoch, walked in order.

    Every rank builds the same list (no communication); ``micro_batches`` hands a rank its share.
    The position (epoch, index) is the state a checkpoint saves, so a resumed run reads on where it
    stopped. A step never straddles epochs: the tail of an epoch shorter than a step is dropped.
    """

    def __init__(self, num_rows: int, rows_per_step: int, seed: int) -> None:
        if num_rows < rows_per_step:
            raise ValueError(
                f"data: {num_rows} packed row(s) but one step needs {rows_per_step} "
                "(micro_batch_size * grad_accum_steps * world size); add data or shrink seq_len or the batch"
            )
        self.num_rows, self.rows_per_step, self.seed = num_rows, rows_per_step, seed
        self.epoch, self.index = 0, 0
        self._perm = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_rows)

    def next_step(self) -> np.ndarray:
        """The rows of the next step ((rows_per_step,) indices), advancing the position."""
        if self.index + self.rows_per_step > self.num_rows:
            self.epoch, self.index = self.epoch + 1, 0
            self._perm = self._permutation(self.epoch)
        rows = self._perm[self.index : self.index + self.rows_per_step]
        self.index += self.rows_per_step
        return rows

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index, "num_rows": self.num_rows, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_rows"] != self.num_rows:
            raise ValueError(
                f"data: the checkpoint's data had {state['num_rows']} rows, this run's has {self.num_rows}; "
                "resume with the same data, seq_len and eval_split"
            )
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._perm = self._permutation(self.epoch)


def micro_batches(step_rows: np.ndarray, micro_batch_size: int, rank: int, world_size: int) -> list[np.ndarray]:
    """This rank's micro-batches of a step: micro-batch m of rank r is block m * world + r."""
    blocks = step_rows.reshape(-1, micro_batch_size)
    return [blocks[m * world_size + rank] for m in range(len(blocks) // world_size)]

"""Grammar libraries for structured outputs, on the CPU (issue 29 item 3): xgrammar, llguidance, outlines-core.

For each library and each tokenizer (the built-in model's 8,192-token byte-level BPE, and byte-level
BPEs of ``--vocab`` sizes trained here in-process on the Python standard library's sources, so that
nothing is downloaded) it measures:

- ``setup``: building the library's tokenizer object from our ``tokenizers.Tokenizer`` (once per model);
- ``compile``: one JSON schema (``SCHEMA``: nested object, array, enum, numbers) and ``json_object``
  (any JSON object), each from scratch (library caches cleared or bypassed);
- ``import``: importing the library in a fresh interpreter;
- ``matcher``: a request's matcher from the compiled grammar (llguidance: ``deep_copy`` of a compiled
  matcher, since its compiled form is the matcher itself);
- per token, over the tokens of a fixed valid output (``SCHEMA_TEXT`` / ``OBJECT_TEXT`` tokenized by
  our tokenizer, so every library walks the same tokens): ``mask``, filling the request's row of a
  (1, ceil(V/32)) int32 CPU bitmask, and ``advance``, accepting the sampled token; medians of
  ``--reps`` walks, the first mask of a walk apart (``first_mask``: lazy state the first mask builds);
- ``batch_fill``: one fill of a (64, ceil(V/32)) bitmask for 64 requests at different places in the
  output, through the library's parallel batch API where it has one (llguidance ``LLExecutor``,
  xgrammar ``BatchGrammarMatcher``, ``--threads`` threads; outlines-core: a loop);
- the mask's application to (N, V) fp32 CPU logits by ``fuseformer.engine.structured_outputs
  .apply_token_bitmask_`` (the library-independent part), when that module imports.

outlines-core compiles a regex to a token-level DFA: ``json_object`` (recursive JSON) has no regex, so
it is reported as n/a. Its vocabulary needs token bytes: built here from the byte-level alphabet.

    python benchmarks/structured_outputs.py [--vocab 32000 128000] [--reps 5] [--threads 1]
        [--out structured_outputs.json]
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from importlib import metadata
from pathlib import Path

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "score", "active", "role", "tags", "address"],
    "additionalProperties": False,
}
SCHEMA_TEXT = json.dumps(
    {
        "name": "Alice Smith",
        "age": 42,
        "email": "alice@example.com",
        "score": 97.5,
        "active": True,
        "role": "admin",
        "tags": ["engineering", "serving", "structured outputs"],
        "address": {"street": "12 Long Road", "city": "Springfield", "zip": "12345"},
    }
)
OBJECT_TEXT = json.dumps(
    {
        "results": [
            {"id": 1, "title": "First entry in the list", "values": [1.5, -2, 3e4], "ok": True},
            {"id": 2, "title": "Second, with a nested object", "meta": {"k": None, "depth": [[], {}]}},
        ],
        "summary": "A plain sentence of ordinary words to make a long string.",
    }
)


# ---- tokenizers ---------------------------------------------------------------------------------


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte (the inverse of the pre-tokenizer's mapping)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def trained_tokenizer_dir(vocab_size: int, root: Path, corpus_bytes: int = 40_000_000) -> Path:
    """A model directory with a byte-level BPE of ``vocab_size`` trained on the standard library's
    sources (~10 s for 40 MB at either 32k or 128k on the 2-core CPU; 20 MB reach only 96k tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    lib = Path(json.__file__).parent.parent
    texts, n = [], 0
    for f in sorted(glob.glob(str(lib / "**" / "*.py"), recursive=True)):
        try:
            s = Path(f).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(s)
        n += len(s)
        if n > corpus_bytes:
            break
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    out = root / f"bpe{vocab_size}"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return out


# ---- the libraries, behind one small interface ---------------------------------------------------


class _Llguidance:
    name = "llguidance"

    def __init__(self, tok) -> None:
        import llguidance

        self.llg = llguidance
        self.vocab = tok.vocab_size
        self.lltok = llguidance.LLTokenizer(tok._tok.to_str(), n_vocab=tok.vocab_size, eos_token=tok.eos_token_id)

    def compile(self, kind: str):
        schema = SCHEMA if kind == "schema" else {"type": "object"}
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        m = self.llg.LLMatcher(self.lltok, grammar)  # construction compiles the grammar
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()  # a request's matcher: a copy of the compiled one's start state

    def fill(self, m, bitmask: torch.Tensor) -> None:
        row = bitmask[0]
        m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)

    def advance(self, m, token: int) -> bool:
        return m.consume_token(token)

    def batch_fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        if not hasattr(self, "executor"):
            self.executor = self.llg.LLExecutor(torch.get_num_threads())
        self.executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
        )


class _Xgrammar:
    name = "xgrammar"

    def __init__(self, tok) -> None:
        import xgrammar

        self.xgr = xgrammar
        vocab = [tok.id_to_token(i) for i in range(tok.vocab_size)]
        info = xgrammar.TokenizerInfo(
            vocab, xgrammar.VocabType.BYTE_LEVEL, vocab_size=tok.vocab_size, stop_token_ids=[tok.eos_token_id]
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=torch.get_num_threads(), cache_enabled=False)

    def compile(self, kind: str):
        if kind == "schema":
            return self.compiler.compile_json_schema(SCHEMA)
        return self.compiler.compile_builtin_json_grammar()

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask: torch.Tensor) -> None:
        m.fill_next_token_bitmask(bitmask, 0)

    def advance(self, m, token: int) -> bool:
        return m.accept_token(token)

    def batch_fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        if not hasattr(self, "batch"):
            self.batch = self.xgr.BatchGrammarMatcher(torch.get_num_threads())
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)


class _OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok) -> None:
        import outlines_core

        self.oc = outlines_core
        decoder = _byte_decoder()
        specials = set(tok.eos_token_ids) | {tok.pad_token_id}
        tokens: dict[bytes, list[int]] = {}
        for i in range(tok.vocab_size):
            if i in specials:
                continue
            tokens.setdefault(bytes(decoder[c] for c in tok.id_to_token(i)), []).append(i)
        self.vocab = outlines_core.Vocabulary(tok.eos_token_id, tokens)

    def compile(self, kind: str):
        if kind != "schema":
            return None  # recursive JSON is not a regular language
        from outlines_core.json_schema import build_regex_from_schema

        return self.oc.Index(build_regex_from_schema(json.dumps(SCHEMA)), self.vocab)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def fill(self, m, bitmask: torch.Tensor) -> None:
        m.write_mask_into(bitmask.data_ptr(), bitmask.numel(), 4)

    def advance(self, m, token: int) -> bool:
        m.advance(token, return_tokens=False)
        return True

    def batch_fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):  # no batch API
            row = bitmask[i]
            m.write_mask_into(row.data_ptr(), row.numel(), 4)


LIBRARIES = {"llguidance": _Llguidance, "xgrammar": _Xgrammar, "outlines-core": _OutlinesCore}
_MODULES = {"outlines-core": "outlines_core"}
BATCH = 64  # requests in the batch-fill measurement


# ---- measurement ----------------------------------------------------------------------------------


def _walk(lib, compiled, ids: list[int], vocab: int) -> tuple[float, list[float], list[float]]:
    """A new matcher, then mask and advance at each of ``ids``: (us to make the matcher, per-token
    mask and advance times in us). Checks each token is allowed and accepted."""
    start = time.perf_counter_ns()
    m = lib.matcher(compiled)
    new_us = (time.perf_counter_ns() - start) / 1e3
    bitmask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    masks, advances = [], []
    for t in ids:
        a = time.perf_counter_ns()
        lib.fill(m, bitmask)
        b = time.perf_counter_ns()
        if not (int(bitmask[0, t // 32]) >> (t % 32)) & 1:
            raise RuntimeError(f"{lib.name}: token {t} of the sample output is masked")
        ok = lib.advance(m, t)
        c = time.perf_counter_ns()
        if not ok:
            raise RuntimeError(f"{lib.name}: token {t} of the sample output was rejected")
        masks.append((b - a) / 1e3)
        advances.append((c - b) / 1e3)
    return new_us, masks, advances


def import_ms(name: str) -> float:
    """Milliseconds to import the library in a fresh interpreter, less the interpreter's own start."""
    module = _MODULES.get(name, name)

    def run(code: str) -> float:
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        return 1e3 * (time.perf_counter() - start)

    return statistics.median(run(f"import {module}") for _ in range(3)) - statistics.median(run("") for _ in range(3))


def measure_library(name: str, tok, reps: int) -> dict:
    row: dict = {"library": name, "version": metadata.version(name)}
    importlib.import_module(_MODULES.get(name, name))  # imported before setup is timed (import_ms apart)
    start = time.perf_counter()
    lib = LIBRARIES[name](tok)
    row["setup_ms"] = 1e3 * (time.perf_counter() - start)
    for kind, text in (("schema", SCHEMA_TEXT), ("json_object", OBJECT_TEXT)):
        compile_ms, compiled = [], None
        for _ in range(reps):
            start = time.perf_counter()
            compiled = lib.compile(kind)
            compile_ms.append(1e3 * (time.perf_counter() - start))
        if compiled is None:
            row[kind] = None
            continue
        ids = tok.encode(text, add_special_tokens=False)
        masks, advances, first, new = [], [], [], []
        for _ in range(reps):
            n, m, a = _walk(lib, compiled, ids, tok.vocab_size)
            new.append(n)
            first.append(m[0])
            masks += m[1:]
            advances += a
        # A batch of BATCH requests at different places in the output: one fill of all their rows.
        matchers = []
        for b in range(BATCH):
            m = lib.matcher(compiled)
            for t in ids[: (b * 7) % len(ids)]:
                lib.advance(m, t)
            matchers.append(m)
        bitmask = torch.full((BATCH, (tok.vocab_size + 31) // 32), -1, dtype=torch.int32)
        batch_us = []
        for _ in range(reps):
            start = time.perf_counter_ns()
            lib.batch_fill(matchers, bitmask)
            batch_us.append((time.perf_counter_ns() - start) / 1e3)
        row[kind] = dict(
            compile_ms=statistics.median(compile_ms),
            tokens=len(ids),
            matcher_us=statistics.median(new),
            first_mask_us=statistics.median(first),
            mask_us_median=statistics.median(masks),
            mask_us_mean=statistics.fmean(masks),
            mask_us_max=max(masks),
            advance_us_median=statistics.median(advances),
            advance_us_mean=statistics.fmean(advances),
            batch_fill_us=statistics.median(batch_us),
        )
    return row


def measure_apply(vocab: int, rows: int, reps: int) -> dict | None:
    """``apply_token_bitmask_`` on (rows, V) fp32 CPU logits, half the rows constrained, ~1% of their tokens allowed."""
    try:
        from fuseformer.engine.structured_outputs import apply_token_bitmask_
    except ImportError:
        return None
    logits = torch.randn(rows, vocab)
    constrained = torch.arange(0, rows, 2)
    # ~1% of the tokens allowed, as a grammar's masks mostly are (a random half-full mask costs ~3x more
    # on the CPU: masked_fill_'s branches mispredict).
    words = (vocab + 31) // 32
    dense = torch.zeros(len(constrained), words * 32, dtype=torch.bool)
    dense.scatter_(1, torch.randint(0, vocab, (len(constrained), max(1, vocab // 100))), True)
    packed = (dense.view(len(constrained), words, 32).long() << torch.arange(32)).sum(-1)  # in [0, 2**32)
    bitmask = (packed - (packed >= 2**31) * 2**32).to(torch.int32)
    times = []
    for _ in range(reps * 4):
        start = time.perf_counter_ns()
        apply_token_bitmask_(logits, bitmask, constrained)
        times.append((time.perf_counter_ns() - start) / 1e3)
    return dict(vocab=vocab, rows=rows, constrained=len(constrained), us_median=statistics.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, nargs="*", default=[32000, 128000], help="trained BPE sizes")
    parser.add_argument("--libraries", nargs="*", default=list(LIBRARIES))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from fuseformer.models.tokenizer import Tokenizer

    builtin = Path(__file__).resolve().parent.parent / "fuseformer" / "assets" / "builtin"
    results = dict(
        date=date.today().isoformat(),
        machine=platform.processor() or platform.machine(),
        python=sys.version.split()[0],
        torch=torch.__version__,
        threads=args.threads,
        tokenizers=[],
        apply=[],
        import_ms={name: import_ms(name) for name in args.libraries},
    )
    for name, ms in results["import_ms"].items():
        print(f"import {name}: {ms:.0f} ms", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        dirs = [("builtin", builtin)]
        for v in args.vocab:
            start = time.perf_counter()
            dirs.append((f"bpe{v}", trained_tokenizer_dir(v, Path(tmp))))
            print(f"trained a {v}-token BPE in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        for label, d in dirs:
            tok = Tokenizer(d)
            entry = dict(tokenizer=label, vocab_size=tok.vocab_size, libraries=[])
            for name in args.libraries:
                row = measure_library(name, tok, args.reps)
                entry["libraries"].append(row)
                print(_format_row(label, tok.vocab_size, row), flush=True)
            results["tokenizers"].append(entry)
            for rows in (1, 32, 256):
                applied = measure_apply(tok.vocab_size, rows, args.reps)
                if applied is not None:
                    results["apply"].append(applied)
                    print(f"apply_token_bitmask_ V={tok.vocab_size} rows={rows}: {applied['us_median']:.0f} us")
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))


def _format_row(label: str, vocab: int, row: dict) -> str:
    parts = [f"{label:9s} V={vocab:6d} {row['library']:13s} setup {row['setup_ms']:7.1f} ms"]
    for kind in ("schema", "json_object"):
        r = row[kind]
        if r is None:
            parts.append(f"{kind}: n/a")
        else:
            parts.append(
                f"{kind}: compile {r['compile_ms']:6.1f} ms, matcher {r['matcher_us']:5.0f} us, first mask {r['first_mask_us']:7.1f} us, "
                f"mask {r['mask_us_median']:6.1f} us "
                f"(mean {r['mask_us_mean']:6.1f}, max {r['mask_us_max']:7.1f}), advance {r['advance_us_median']:5.1f} us, "
                f"batch of {BATCH} {r['batch_fill_us'] / 1e3:5.2f} ms"
            )
    return " | ".join(parts)


if __name__ == "__main__":
    main()

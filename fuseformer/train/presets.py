"""Named training recipes (data, STYLE.md §6) and the byte-level BPE tokenizer they train.

``builtin``: the small Llama-architecture model shipped with the package, trained on the Python
standard library's own source (every Python installation carries it, so anyone can rerun the
recipe: ``fuseformer train --preset builtin``).
"""

from __future__ import annotations

import json
import os
import sysconfig
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fuseformer.models.config import ModelConfig

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN)

# hidden 384, 6 layers, 6 query / 2 KV heads of 64, MLP 896, vocab 8192, tied embeddings:
# 8192*384 + 6 * (384*640 + 384*384 + 3*384*896 + 2*384) + 384 = 11.70M parameters = 23.4 MB in bf16
# (the budget is 25 MB).
BUILTIN_MODEL = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=8192,
    hidden_size=384,
    intermediate_size=896,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=1024,
    tie_word_embeddings=True,
)


def stdlib_dir() -> Path:
    """The standard library's source folder of this Python."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The standard library's .py files, without installed third-party packages (site-packages)."""
    root = stdlib_dir()
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "dist-packages" not in p.parts)


PRESETS: dict[str, dict[str, Any]] = {
    "builtin": {
        "model": BUILTIN_MODEL,
        # data: filled in by prepare_preset (the stdlib folder of the Python that runs it)
        "data_suffixes": (".py",),
        "seq_len": 512,
        "micro_batch_size": 32,
        "grad_accum_steps": 2,  # 32 768 tokens a step
        "lr": 2e-3,
        "min_lr": 2e-4,
        "warmup_steps": 50,
        # ~20M tokens, ~7 epochs of the H200 machine's 3.12 stdlib (2.9M tokens): a 1500-step run
        # (2026-11-30) reached its best held-out loss, 1.86, at step 600 and overfit after (2.52 at 1500).
        "max_steps": 600,
        "weight_decay": 0.1,
        "betas": (0.9, 0.95),
        "grad_clip": 1.0,
        "precision": "auto",  # bf16 on CUDA (as trained), fp32 on a CPU
        "activation_checkpointing": "off",
        "eval_split": 0.02,
        "eval_every": 50,
        "eval_batches": 16,
        "save_every": 200,
        "log_every": 50,
        "seed": 0,
        "out_dir": "runs/builtin",
    },
}


def train_tokenizer(
    texts: Iterable[str],
    out_dir: str | Path,
    vocab_size: int = 8192,
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
    model_max_length: int = 1024,
) -> Path:
    """Train a byte-level BPE tokenizer (GPT-2 style: ByteLevel pre-tokenizer and decoder, no
    added prefix space) on ``texts`` and write it as a Hugging Face tokenizer directory:
    tokenizer.json, tokenizer_config.json (EOS = the first special token), generation_config.json.

    The vocabulary is ``vocab_size`` including the 256 byte symbols and the special tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    eos = special_tokens[0]
    pad = special_tokens[1] if len(special_tokens) > 1 else eos
    eos_id = tok.token_to_id(eos)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    generation = {
        "eos_token_id": eos_id,
        "pad_token_id": tok.token_to_id(pad),
        "do_sample": True,
        "temperature": 0.8,
        "top_p": 0.95,
        "max_new_tokens": 256,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return out


def _read_texts(files: Iterable[Path]) -> Iterable[str]:
    for f in files:
        try:
            yield f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue


def prepare_preset(name: str, out_dir: str | Path | None = None) -> dict[str, Any]:
    """The config dict of preset ``name``, with what it needs made: for ``builtin``, the stdlib
    data path and a tokenizer trained on it (in <out_dir>/tokenizer, reused when present)."""
    if name not in PRESETS:
        raise ValueError(f"preset: unknown preset {name!r}; known: {sorted(PRESETS)}")
    config = dict(PRESETS[name])
    if out_dir is not None:
        config["out_dir"] = str(out_dir)
    if name == "builtin":
        config["data"] = (str(stdlib_dir()),)
        tok_dir = Path(config["out_dir"]) / "tokenizer"
        if not (tok_dir / "tokenizer.json").is_file():
            if int(os.environ.get("RANK", "0")) == 0:  # under torchrun rank 0 trains it, the others wait
                tmp = tok_dir.with_name(f".{tok_dir.name}.tmp{os.getpid()}")
                train_tokenizer(_read_texts(stdlib_files()), tmp, vocab_size=BUILTIN_MODEL.vocab_size)
                os.replace(tmp, tok_dir)
            else:
                deadline = time.monotonic() + 3600
                while not (tok_dir / "tokenizer.json").is_file():
                    if time.monotonic() > deadline:
                        raise ValueError(f"preset: timed out waiting for rank 0 to write {tok_dir}")
                    time.sleep(1)
        config["tokenizer"] = str(tok_dir)
    return config

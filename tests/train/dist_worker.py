"""Run by tests/train/test_distributed.py, alone (--mode none) or under torchrun (ddp, fsdp): a few
steps of a tiny model on synthetic packed data; rank 0 writes the losses and final weights."""

import argparse

import numpy as np
import torch

from fuseformer.models.config import ModelConfig
from fuseformer.train import TokenCorpus, TrainConfig, Trainer
from fuseformer.train import distributed as D


def corpus() -> TokenCorpus:
    rng = np.random.default_rng(0)
    docs = []
    for _ in range(60):
        a, d, n = rng.integers(0, 31), rng.integers(1, 4), rng.integers(3, 30)
        docs.append([int((a + d * i) % 31) for i in range(n)])
    return TokenCorpus.from_documents(docs, eos_id=31)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="none")
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--accum", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", required=True)
    p.add_argument("--precision", default="fp32")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict | None:
    """Train; on rank 0 return {losses, eval, state (our names), ckpt}."""
    model = ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=32,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    config = TrainConfig(
        model=model,
        seq_len=16,
        micro_batch_size=args.micro,
        grad_accum_steps=args.accum,
        lr=1e-2,
        min_lr=1e-3,
        warmup_steps=1,
        max_steps=args.steps,
        precision=args.precision,
        distributed=args.mode,
        save_every=args.steps,
        out_dir=args.out + ".run",
        progress=False,
        log_every=0,
        activation_checkpointing="every:2",
    )
    trainer = Trainer(config, train_corpus=corpus(), eval_corpus=corpus())
    result = trainer.train()
    eval_loss = trainer.evaluate()
    state = D.full_model_state(trainer.module, trainer.dist)
    trainer.close()
    if not trainer.dist.is_main:
        return None
    state = {k.removeprefix("lm."): v for k, v in state.items()}
    return {"losses": result.losses, "eval": eval_loss, "state": state, "ckpt": str(result.checkpoint)}


def main() -> None:
    # test_distributed.py sets FUSEFORMER_BACKEND=reference (the interpreter is too slow for 3 processes)
    args = parse()
    torch.set_num_threads(1)
    out = run(args)
    if out is not None:
        torch.save(out, args.out)


if __name__ == "__main__":
    main()

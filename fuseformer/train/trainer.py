"""The training loop for causal LMs on the models of our registry (fuseformer.models.registry).

One optimizer step:

    rows of the step (RowSampler; every rank computes the same list)
      -> this rank's micro-batches (flattened varlen: ids/positions/targets (T,), cu_seqlens)
      -> per micro-batch: autocast forward -> LM-head loss summed over tokens (fused linear CE:
         no (T, V) logits) -> scaled by world_size / (targets in the whole step) -> backward
         (gradient sync only on the last micro-batch)
      -> unscale (fp16), clip, AdamW, warmup + cosine schedule

Normalizing by the step's total target count (known on every rank from the rows, no
communication) makes the gradient that of the mean loss over the whole global batch, however it
is split into ranks and micro-batches. Weights, gradients and optimizer state stay fp32 (the
master weights); autocast runs the matmuls and kernels in bf16/fp16.
"""

from __future__ import annotations

import gc
import json
import math
import random
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from fuseformer.layers import RMSNorm
from fuseformer.models.attention_metadata import AttentionMetadata
from fuseformer.models.config import ModelConfig
from fuseformer.models.loader import empty_model
from fuseformer.train import checkpoint as C
from fuseformer.train import distributed as D
from fuseformer.train.config import TrainConfig
from fuseformer.train.data import (
    IGNORE_INDEX,
    Batch,
    PackedRows,
    RowSampler,
    TokenCorpus,
    collate,
    load_corpus,
    micro_batches,
)
from fuseformer.train.fp8 import apply_fp8_training, check_fp8_device
from fuseformer.train.loss import linear_cross_entropy_sum

_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
METRICS_FILE = "metrics.jsonl"
CURVE_FILE = "loss.png"
_LM_PREFIX = "lm."  # CausalLMLoss holds the model as .lm: its state's names, less this, are the model's


# --------------------------------------------------------------------------------------------
# Model preparation, applied from outside the model
# --------------------------------------------------------------------------------------------
class CausalLMLoss(nn.Module):
    """The model and its LM-head loss in one forward, so that DDP/FSDP's root covers the head.

    forward(input_ids (T,), positions (T,), cu_seqlens (n+1,) int32, max_seqlen, targets (T,))
    -> the fp32 sum of the token losses (targets -100 ignored).

    A model whose logits are soft-capped (Gemma2's ``final_logit_softcapping``) passes its cap to the
    fused linear cross-entropy, which applies it inside its kernels (as ``compute_logits`` would).
    """

    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, positions, cu_seqlens, max_seqlen: int, targets) -> torch.Tensor:
        meta = AttentionMetadata(cu_seqlens_q=cu_seqlens, max_seqlen_q=max_seqlen)
        hidden = self.lm(input_ids, positions, meta)  # (T, H)
        cap = self.lm.config.final_logit_softcapping or 0.0
        return linear_cross_entropy_sum(hidden, self.lm.lm_head.weight, targets, softcap=cap)


def init_weights(lm: nn.Module, std: float, seed: int) -> None:
    """normal(0, std) for linear and embedding weights, zero biases, norms scaling by one (weight 1,
    or 0 under an offset: Gemma's 1 + w) (seeded)."""
    offsets = {f"{n}.weight": m.offset for n, m in lm.named_modules() if isinstance(m, RMSNorm)}
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0 - offsets.get(name, 0.0))
            elif p.dim() == 1:
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)


def _autocast_embedding(module: nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor | None:
    # Embedding lookups are not autocast; without this cast the residual stream would be fp32 while
    # the attention/MLP outputs are bf16, and the fused add+norm wants one dtype for both.
    if torch.is_autocast_enabled(out.device.type):
        return out.to(torch.get_autocast_dtype(out.device.type))
    return None


def apply_activation_checkpointing(lm: nn.Module, every: int, skip_last: int = 0) -> None:
    """Recompute layers 0, every, 2*every, ... in backward (torch.utils.checkpoint, non-reentrant),
    but none of the last ``skip_last`` layers.

    The layer instance's forward is replaced, so parameter names (and checkpoints) do not change.
    A layer takes (hidden, residual) and adds them in its fused add+norm; here the add is done
    before the checkpoint, so each boundary keeps one (T, H) tensor instead of two (Llama 1B at
    B 4 x S 4096 in bf16: 16 x 64 MiB = 1 GiB rather than 2 GiB).
    """
    if every <= 0:
        return
    layers = lm.model.layers
    for i, layer in enumerate(layers):
        if i % every or i >= len(layers) - skip_last:
            continue
        inner = layer.forward

        def forward(hidden, residual, *args, _inner=inner):
            if residual is not None:
                hidden = hidden + residual  # the layer then normalizes it and keeps it as the residual
            return checkpoint(_inner, hidden, None, *args, use_reentrant=False)

        layer.forward = forward


def build_optimizer(module: nn.Module, config: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW, weight decay on matrices only (not norms, biases); fused on CUDA, foreach elsewhere."""
    decay, no_decay = [], []
    for p in module.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": config.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    kind = {"fused": True} if device.type == "cuda" else {"foreach": True}
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps, **kind)


def lr_at(step: int, config: TrainConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup to lr over warmup_steps,
    then cosine decay to min_lr at max_steps."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.max_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.min_lr + 0.5 * (config.lr - config.min_lr) * (1 + math.cos(math.pi * progress))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def load_tokenizer(path: str | Path):
    """Our models.tokenizer.Tokenizer of a directory (or tokenizer.json), and its EOS id."""
    from fuseformer.models.tokenizer import Tokenizer

    tok = Tokenizer(path)
    if tok.eos_token_id is None:
        raise ValueError(f"tokenizer: {path} names no eos_token (tokenizer_config.json) that is in the vocabulary")
    return tok, tok.eos_token_id


# --------------------------------------------------------------------------------------------
# Trainer
# --------------------------------------------------------------------------------------------
@dataclass(slots=True)
class TrainResult:
    losses: list[float] = field(default_factory=list)  # per step run by this call
    eval_losses: dict[int, float] = field(default_factory=dict)  # step -> eval loss
    skipped_steps: int = 0
    final_step: int = 0
    checkpoint: Path | None = None
    curve: Path | None = None  # loss.png; None when it was not written (no matplotlib, no metrics)
    export: Path | None = None  # the exported model directory (``train(..., export=...)``)


class Trainer:
    """Holds the model, optimizer and data of a run; ``train()`` runs it to ``max_steps``.

    The data comes from ``config.data`` (tokenized with ``config.tokenizer`` or the model
    directory's tokenizer), or from ``train_corpus``/``eval_corpus`` given directly (tests, tools).
    A checkpoint in ``<out_dir>/checkpoints`` is resumed when ``config.resume``.
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        model: nn.Module | None = None,
        train_corpus: TokenCorpus | None = None,
        eval_corpus: TokenCorpus | None = None,
    ) -> None:
        if model is None and isinstance(config.model, str) and not Path(config.model).is_dir():
            raise ValueError(  # before anything is made (the out_dir, the process group)
                f"TrainConfig: model {config.model} is not a directory: give a Hugging Face model directory "
                "to fine-tune, or a [model] table (architecture and sizes) in the config file to train from scratch"
            )
        self.config = config
        self.dist = D.init_distributed(config.distributed, config.device)
        device = self.dist.device
        seed_everything(config.seed)
        self.out_dir = Path(config.out_dir)
        if self.dist.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)

        # Model: fp32 master weights on the device.
        self.tokenizer_dir: Path | None = None
        if model is None:
            if isinstance(config.model, ModelConfig):
                model = empty_model(config.model, torch.float32, "cpu")  # the registry's class, tied
                init_weights(model, config.init_std, config.seed)
            else:
                from fuseformer.models.loader import load_model

                model, _ = load_model(config.model, dtype=torch.float32)
                self.tokenizer_dir = Path(config.model)
        if config.tokenizer is not None:
            self.tokenizer_dir = Path(config.tokenizer)
        self.lm = model.float().to(device).train()
        self.lm.model.embed_tokens.register_forward_hook(_autocast_embedding)
        if config.fp8:
            check_fp8_device(device)
            converted = apply_fp8_training(self.lm)
            self._log(f"fp8: {len(converted)} linear layers train with float8 GEMMs (torchao, rowwise scales)")
        apply_activation_checkpointing(self.lm, *config.checkpoint_plan())
        self.module = D.parallelize(CausalLMLoss(self.lm), self.lm.model.layers, self.dist)

        # Data.
        if train_corpus is None:
            train_corpus, eval_corpus = self._load_data()
        self.skipped_files = train_corpus.skipped
        self.train_rows = PackedRows(train_corpus, config.seq_len)
        self.eval_rows = PackedRows(eval_corpus, config.seq_len) if eval_corpus is not None else None
        rows_per_step = config.micro_batch_size * config.grad_accum_steps * self.dist.world_size
        self.sampler = RowSampler(len(self.train_rows), rows_per_step, config.seed)

        # Optimizer, schedule, loss scaling.
        self.optimizer = build_optimizer(self.module, config, device)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: lr_at(step, config) / config.lr)
        # "auto": bf16 autocast on CUDA; fp32 elsewhere (on a CPU bf16 ran ~10x slower than fp32).
        self.precision = config.precision
        if self.precision == "auto":
            self.precision = "bf16" if device.type == "cuda" else "fp32"
        self.amp_dtype = _AMP_DTYPES[self.precision]
        self.scaler = None
        if self.precision == "fp16":
            if self.dist.mode == "fsdp":  # found-inf all-reduced across the shards
                from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

                self.scaler = ShardedGradScaler(device.type)
            else:
                self.scaler = torch.amp.GradScaler(device.type)

        self.step = 0
        self.skipped_steps = 0
        self.tokens_seen = 0
        if config.resume:
            resumed = C.resume_latest(config.out_dir, self.load_checkpoint, warn=self.dist.is_main)
            if resumed is not None:
                self._log(f"resumed from {resumed} at step {self.step}")

    # ----------------------------------------------------------------------------------------
    def _load_data(self) -> tuple[TokenCorpus, TokenCorpus | None]:
        config = self.config
        if not config.data:
            raise ValueError("TrainConfig: data is empty; give text files or folders")
        if self.tokenizer_dir is None:
            raise ValueError("TrainConfig: tokenizer is required when model is a ModelConfig")
        tokenizer, eos = load_tokenizer(self.tokenizer_dir)
        cache = Path(config.cache_dir) if config.cache_dir else self.out_dir / "data_cache"
        if self.dist.is_main:  # rank 0 tokenizes and fills the cache; the others then read it
            corpus = load_corpus(config.data, tokenizer, eos, config.data_suffixes, cache, config.data_exclude)
        D.barrier(self.dist)
        if not self.dist.is_main:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                corpus = load_corpus(config.data, tokenizer, eos, config.data_suffixes, cache, config.data_exclude)
        if corpus.tokens.max(initial=0) >= self.lm.config.vocab_size:
            raise ValueError(
                f"data: token id {int(corpus.tokens.max())} is outside the model's vocab_size "
                f"{self.lm.config.vocab_size}"
            )
        return corpus.split(config.eval_split, config.seed)

    def _log(self, message: str) -> None:
        if self.dist.is_main:
            from tqdm.auto import tqdm

            tqdm.write(f"[fuseformer train] {message}")

    def _autocast(self):
        if self.amp_dtype is None:
            return torch.autocast(self.dist.device.type, enabled=False)
        return torch.autocast(self.dist.device.type, dtype=self.amp_dtype)

    def _loss_sum(self, batch: Batch) -> torch.Tensor:
        b = batch.to(self.dist.device)
        with self._autocast():
            return self.module(b.input_ids, b.positions, b.cu_seqlens, b.max_seqlen, b.targets)

    def forward_backward(self, step_rows: np.ndarray) -> tuple[float, int]:
        """Accumulate the gradient of the mean token loss over ``step_rows`` (all ranks' rows).

        Returns (that mean loss, the number of target tokens in the step).
        """
        cfg, info = self.config, self.dist
        total = sum(self.train_rows.row(i)[1].__ne__(IGNORE_INDEX).sum() for i in step_rows)
        total = int(total)
        scale = info.world_size / max(total, 1)  # DDP/FSDP average gradients over ranks
        mine = micro_batches(step_rows, cfg.micro_batch_size, info.rank, info.world_size)
        loss_sum = torch.zeros((), dtype=torch.float32, device=info.device)
        for m, rows in enumerate(mine):
            batch = collate([self.train_rows.row(i) for i in rows])
            with D.set_grad_sync(self.module, info, enabled=m == len(mine) - 1):
                part = self._loss_sum(batch)
                loss = part * scale
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            loss_sum += part.detach()
        D.all_reduce_sum(loss_sum, info)
        return loss_sum.item() / max(total, 1), total

    def optimizer_step(self) -> tuple[float, bool]:
        """Unscale, clip, step, schedule. Returns (grad norm before clipping, whether fp16 skipped it)."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):  # FSDP2: a DTensor
            norm = norm.full_tensor()
        skipped = False
        if self.scaler is not None:
            before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = self.scaler.get_scale() < before
        else:
            self.optimizer.step()
        if not skipped:  # a skipped step does not advance the schedule (as transformers' Trainer)
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm), skipped

    def train_step(self) -> dict[str, Any]:
        """One optimizer step; returns its metrics."""
        lr = self.scheduler.get_last_lr()[0]
        start = time.perf_counter()
        rows = self.sampler.next_step()
        loss, targets = self.forward_backward(rows)
        norm, skipped = self.optimizer_step()
        if self.dist.device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        tokens = len(rows) * self.config.seq_len
        self.step += 1
        self.tokens_seen += tokens
        if skipped:
            self.skipped_steps += 1
            self._log(
                f"step {self.step}: fp16 overflow, step skipped (loss scale lowered; {self.skipped_steps} so far)"
            )
        return {
            "step": self.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": norm,
            "tokens": tokens,
            "target_tokens": targets,
            "tokens_seen": self.tokens_seen,
            "tokens_per_s": tokens / seconds,
            "step_s": seconds,
            "skipped_steps": self.skipped_steps,
            "epoch": self.sampler.epoch,
        }

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean token loss over the first eval_batches * micro_batch_size * world rows of the eval split."""
        if self.eval_rows is None:
            return None
        cfg, info = self.config, self.dist
        n = min(len(self.eval_rows), cfg.eval_batches * cfg.micro_batch_size * info.world_size)
        per_rank = n // info.world_size  # every rank runs the same number of forwards (FSDP collectives)
        if per_rank == 0:
            self._log(f"eval split has {len(self.eval_rows)} row(s) of {cfg.seq_len} tokens: too few, eval skipped")
            return None
        mine = np.arange(info.rank * per_rank, (info.rank + 1) * per_rank)
        totals = torch.zeros(2, dtype=torch.float64, device=info.device)
        self.module.eval()
        for start in range(0, per_rank, cfg.micro_batch_size):
            batch = collate([self.eval_rows.row(int(i)) for i in mine[start : start + cfg.micro_batch_size]])
            totals[0] += self._loss_sum(batch).double()
            totals[1] += batch.num_targets
        self.module.train()
        D.all_reduce_sum(totals, info)
        return (totals[0] / totals[1].clamp(min=1)).item()

    # ----------------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        """Run to max_steps: progress bar, metrics.jsonl, eval, checkpoints, loss.png at the end."""
        from tqdm.auto import tqdm

        cfg, info = self.config, self.dist
        result = TrainResult()
        metrics_path = self.out_dir / METRICS_FILE
        if info.is_main:
            _truncate_metrics(metrics_path, self.step)
            if self.eval_rows is not None and not cfg.eval_every:
                self._log("eval_split holds documents out, but eval_every is 0: no evaluation runs")
            if self.skipped_files:
                self._log(f"{len(self.skipped_files)} file(s) skipped as not UTF-8")
        bar = tqdm(total=cfg.max_steps, initial=self.step, disable=not (info.is_main and cfg.progress), unit="step")
        while self.step < cfg.max_steps:
            m = self.train_step()
            result.losses.append(m["loss"])
            last = self.step == cfg.max_steps
            if self.eval_rows is not None and cfg.eval_every and (self.step % cfg.eval_every == 0 or last):
                m["eval_loss"] = self.evaluate()
                if m["eval_loss"] is not None:
                    result.eval_losses[self.step] = m["eval_loss"]
            if info.is_main:
                with metrics_path.open("a") as f:
                    f.write(json.dumps(m) + "\n")
                bar.set_postfix(loss=f"{m['loss']:.4f}", lr=f"{m['lr']:.2e}", tok_s=f"{m['tokens_per_s']:,.0f}")
                bar.update(1)
                if cfg.log_every and (self.step % cfg.log_every == 0 or last):
                    extra = f" eval {m['eval_loss']:.4f}" if m.get("eval_loss") is not None else ""
                    self._log(
                        f"step {self.step}/{cfg.max_steps} loss {m['loss']:.4f}{extra} lr {m['lr']:.3e} "
                        f"grad_norm {m['grad_norm']:.3f} {m['tokens_per_s']:,.0f} tok/s"
                    )
            if cfg.save_every and (self.step % cfg.save_every == 0 or last):
                result.checkpoint = self.save_checkpoint()
        bar.close()
        if info.is_main:
            result.curve = plot_loss_curve(metrics_path, self.out_dir / CURVE_FILE)
        result.skipped_steps, result.final_step = self.skipped_steps, self.step
        return result

    def close(self) -> None:
        """End a distributed run (DDP/FSDP): release the wrapped model, the optimizer and the data
        parallelism's state, which hold the process group, then tear the group down
        (``distributed.destroy``). The trainer cannot train or save afterwards. A process group freed
        only at interpreter exit (its DDP reducer or FSDP shards still alive) may join its gloo threads
        after C++ has begun to exit, and the process aborts with "terminate called without an active
        exception" (2 gloo ranks on a CPU: 1 run in 24 before, none in 60 after). Alone, a no-op."""
        if self.dist.mode == "none" or self.module is None:
            return
        self.module = self.lm = self.optimizer = self.scheduler = self.scaler = None
        gc.collect()
        D.destroy()

    def export(self, path: str | Path) -> Path | None:
        """Write the model as it is now as a bf16 Hugging Face directory (+ the tokenizer files).
        Every rank calls it (FSDP gathers the shards); rank 0 writes and gets the path."""
        state = D.full_model_state(self.module, self.dist)
        out = None
        if self.dist.is_main:
            state = {k.removeprefix(_LM_PREFIX): v for k, v in state.items()}
            out = C.save_model(state, self.lm.config, path, dtype=torch.bfloat16, tokenizer_dir=self.tokenizer_dir)
        D.barrier(self.dist)
        return out

    # ----------------------------------------------------------------------------------------
    def save_checkpoint(self) -> Path | None:
        """Write the run's checkpoint (model, optimizer, scheduler, scaler, RNG, data position, step) to
        ``<out_dir>/checkpoints`` (checkpoint.py). Every rank calls it (FSDP gathers the shards);
        rank 0 writes and gets the path."""
        info = self.dist
        model_state = D.full_model_state(self.module, info)
        run = C.RunState(
            step=self.step,
            skipped_steps=self.skipped_steps,
            tokens_seen=self.tokens_seen,
            optimizer=D.full_optimizer_state(self.module, self.optimizer, info),
            scheduler=self.scheduler.state_dict(),
            scaler=self.scaler.state_dict() if self.scaler is not None else None,
            data=self.sampler.state_dict(),
        )
        return C.save_checkpoint(
            self.config.out_dir,
            {k.removeprefix(_LM_PREFIX): v for k, v in model_state.items()},
            self.lm.config,
            run,
            dist=info,
            train_config=self.config.to_dict(),
            keep_checkpoints=self.config.keep_checkpoints,
            tokenizer_dir=self.tokenizer_dir,
        )

    def load_checkpoint(self, path: str | Path) -> None:
        """Restore model, optimizer, scheduler, scaler, RNG and data position from the checkpoint at
        ``path``. Every file is read first: a checkpoint that cannot be read (CheckpointReadError)
        leaves the trainer as it was."""
        info = self.dist
        ckpt = C.read_checkpoint(path, self.lm.config)
        run = ckpt.run
        D.load_full_model_state(self.module, {_LM_PREFIX + k: v for k, v in ckpt.model_state.items()}, info)
        D.load_full_optimizer_state(self.module, self.optimizer, run.optimizer, info)
        self.scheduler.load_state_dict(run.scheduler)
        if self.scaler is not None and run.scaler is not None:
            self.scaler.load_state_dict(run.scaler)
        if ckpt.world_size != info.world_size and info.is_main:
            warnings.warn(
                f"load_checkpoint: saved with world size {ckpt.world_size}, resumed with {info.world_size}; "
                "the data order continues, but a step now holds other rows",
                stacklevel=2,
            )
        self.sampler.load_state_dict(run.data)
        C.set_rng_state(ckpt.rng)
        self.step = run.step
        self.skipped_steps = run.skipped_steps
        self.tokens_seen = run.tokens_seen


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of metrics.jsonl. A torn last line (the run was killed while writing it) is dropped
    with a warning; a malformed line elsewhere raises ValueError naming the file and the line."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    while lines and not lines[-1].strip():
        lines.pop()
    rows = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"a {type(row).__name__}, not an object")
        except ValueError as exc:
            if i == len(lines) - 1:
                message = f"train: {path} line {i + 1} is incomplete (a run stopped while writing it): dropped"
                warnings.warn(message, stacklevel=2)
                break
            raise ValueError(f"train: {path} line {i + 1} is not a JSON object: {exc}") from exc
        rows.append(row)
    return rows


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metric lines past ``step`` (a resumed run rewrites the steps after its checkpoint), and a
    torn last line."""
    if not path.is_file():
        return
    keep = [row for row in read_metrics(path) if row.get("step", 0) <= step]
    path.write_text("".join(json.dumps(row) + "\n" for row in keep))


def plot_loss_curve(metrics_path: Path, png_path: Path) -> Path | None:
    """Train (and eval) loss against step from metrics.jsonl, as a PNG (matplotlib Agg)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("train: matplotlib is not installed; no loss curve written", stacklevel=2)
        return None
    rows = read_metrics(metrics_path) if metrics_path.is_file() else []
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=120)
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train", linewidth=1)
    ev = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
    if ev:
        ax.plot(*zip(*ev), "o-", label="eval", markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return png_path


def train(config: TrainConfig, export: str | Path | None = None, **kwargs: Any) -> TrainResult:
    """Build a Trainer for ``config`` and run it (the entry of ``fuseformer train``); with ``export``,
    then write the final model there as a bf16 Hugging Face directory (from memory: no checkpoint
    is needed)."""
    if export is not None and Path(export).exists() and not Path(export).is_dir():
        raise ValueError(f"train: export path {export} is a file, not a directory")
    trainer = None
    try:
        trainer = Trainer(config, **kwargs)
        result = trainer.train()
        if export is not None:
            result.export = trainer.export(export)
        return result
    finally:
        if trainer is not None:
            trainer.close()
        elif config.distributed != "none":
            D.destroy()  # the trainer failed to build after joining the group

"""Data parallelism applied from outside the model (STYLE.md: torchtitan's parallelize.py).

Under ``torchrun`` (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT in the environment):
gloo on CPU, NCCL on CUDA. ``parallelize`` wraps the training module in DDP, or shards it with
FSDP2's ``fully_shard``: each decoder layer its own unit (its parameters are gathered just before
its forward/backward and freed after), then the root (embedding, final norm, LM head).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True, slots=True)
class DistInfo:
    """This process's place in the job."""

    mode: str  # "none", "ddp" or "fsdp"
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _pick_device(device: str, local_rank: int) -> torch.device:
    if device == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", local_rank)
    return dev


def init_distributed(mode: str, device: str = "auto") -> DistInfo:
    """Join the torchrun job (``mode`` "ddp"/"fsdp") or run alone ("none")."""
    if mode == "none":
        return DistInfo("none", 0, 1, 0, _pick_device(device, 0))
    missing = [k for k in _TORCHRUN_ENV if k not in os.environ]
    if missing:
        raise ValueError(
            f"distributed={mode!r} needs the torchrun environment; {', '.join(missing)} not set "
            "(run: torchrun --nproc-per-node N -m fuseformer.train.cli --distributed ddp ...)"
        )
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    dev = _pick_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world)
    return DistInfo(mode, rank, world, local_rank, dev)


def destroy() -> None:
    """Tear the process group down, after a barrier: no rank leaves while another may still be in a
    collective with it. Free what holds the group first (a DDP reducer, FSDP shards:
    ``Trainer.close`` does): a group freed only at interpreter exit aborted a gloo rank now and then
    with "terminate called without an active exception"."""
    if dist.is_initialized():
        if dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def parallelize(module: nn.Module, layers: nn.ModuleList, info: DistInfo) -> nn.Module:
    """DDP- or FSDP2-wrap ``module`` (the training module; ``layers`` its decoder layers)."""
    if info.mode == "none":
        return module
    if info.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [info.device.index] if info.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(info.device.type, (info.world_size,))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def unwrap(module: nn.Module) -> nn.Module:
    """The module under a DDP wrapper (FSDP2 shards in place: nothing to unwrap)."""
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module


def set_grad_sync(module: nn.Module, info: DistInfo, enabled: bool):
    """A context manager for one micro-batch's backward: gradient all-reduce only when ``enabled``
    (the last micro-batch of a step)."""
    import contextlib

    if info.mode == "ddp" and not enabled:
        return module.no_sync()
    if info.mode == "fsdp":
        module.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def all_reduce_sum(t: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.world_size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier(info: DistInfo) -> None:
    if info.world_size > 1:
        dist.barrier()


def full_model_state(module: nn.Module, info: DistInfo) -> dict[str, torch.Tensor]:
    """The whole model state on the CPU (FSDP: gathered; every rank must call it)."""
    if info.mode == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu() for k, v in unwrap(module).state_dict().items()}


def load_full_model_state(module: nn.Module, state: dict[str, torch.Tensor], info: DistInfo) -> None:
    """Load a whole-model state (the same on every rank) into the (possibly sharded) module."""
    if info.mode == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(module, state, options=StateDictOptions(full_state_dict=True))
        return
    unwrap(module).load_state_dict(state)


def full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, info: DistInfo) -> dict:
    if info.mode == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_optimizer_state_dict(module, optimizer, options=options)
    return optimizer.state_dict()


def load_full_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict, info: DistInfo) -> None:
    if info.mode == "fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))
        return
    optimizer.load_state_dict(state)

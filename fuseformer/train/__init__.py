"""Training (DESIGN.md §5): ``TrainConfig``, ``Trainer``/``train``, packed data, checkpoints,
DDP/FSDP2. The ``fuseformer train`` command is train/cli.py."""

from fuseformer.train.config import TrainConfig
from fuseformer.train.data import Batch, PackedRows, RowSampler, TokenCorpus, collate, load_corpus
from fuseformer.train.trainer import Trainer, TrainResult, train

__all__ = [
    "Batch",
    "PackedRows",
    "RowSampler",
    "TokenCorpus",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "collate",
    "load_corpus",
    "train",
]

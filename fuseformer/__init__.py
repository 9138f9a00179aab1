"""fuseformer: fused Triton kernels, an inference engine and a trainer for PyTorch Transformers.

Public API: ``fuseformer.ops`` (the fused ops), ``use_backend`` (force a backend for a block),
``optimize`` and ``revert`` (fuse an existing model in place, verified), ``LLM`` and
``SamplingParams`` (the inference engine; imported on first use).
"""

from fuseformer import ops
from fuseformer.fusion import OptimizeReport, optimize, revert
from fuseformer.runtime.backend import use_backend

__version__ = "0.1.0"

__all__ = ["ops", "use_backend", "optimize", "revert", "OptimizeReport", "LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # The engine pulls in the models, tokenizer and sampler: load it only when asked for.
    if name in ("LLM", "SamplingParams"):
        from fuseformer import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'fuseformer' has no attribute {name!r}")

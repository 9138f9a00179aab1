"""The inference engine: ``LLM(model=path).generate(prompts, SamplingParams(...))`` (DESIGN.md §4).

Names are imported on first use, so that importing one engine module (the scheduler, the sampler)
does not load the model code.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "fuseformer.engine.llm",
    "SamplingParams": "fuseformer.engine.sampling_params",
    "RequestOutput": "fuseformer.engine.outputs",
    "CompletionOutput": "fuseformer.engine.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fuseformer.engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)

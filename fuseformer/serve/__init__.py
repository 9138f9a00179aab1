"""The OpenAI-compatible server: ``fuseformer serve --model DIR`` (``cli.py``), ``create_app`` (``app.py``).

Imported on first use, so that ``import fuseformer.serve`` does not load FastAPI.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from fuseformer.serve.app import create_app

        return create_app
    raise AttributeError(f"module 'fuseformer.serve' has no attribute {name!r}")

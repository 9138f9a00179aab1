"""Backend choice for every fused op: Triton or the PyTorch reference.

The rule (DESIGN.md §2):

- CUDA tensor, Triton importable, shape supported: Triton.
- CPU tensor: reference; or Triton when ``TRITON_INTERPRET=1`` was set before Triton was
  imported (the interpreter runs the kernels on CPU tensors; that is how CI tests them).
- Anything else: reference, with a reason that ``fuseformer info`` prints.
- Forced: ``FUSEFORMER_BACKEND=triton|reference`` in the environment, or
  ``with fuseformer.use_backend("reference"): ...`` for one block of code. Forcing Triton where
  it cannot run is an error, never a silent fallback.

This is the only place that makes the choice; every op asks :func:`choose_backend`.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

BACKENDS = ("triton", "reference")

# Triton decides at ``@triton.jit`` time (when fuseformer.ops is imported) whether kernels are
# interpreted, from this variable. Read it once, at the same moment, so the two never disagree.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# FUSEFORMER_BACKEND is read once, at import (reading os.environ on every op call costs host time
# that shows on small shapes); set it before importing fuseformer, or use ``use_backend``.
_ENV_BACKEND = os.environ.get("FUSEFORMER_BACKEND", "")

# Set by ``use_backend``; a plain module global (not a ContextVar) so that torch.compile can
# trace through the choice and guard on it without a graph break.
_forced: str | None = None


@dataclass(frozen=True, slots=True)
class Choice:
    """The backend an op will run on, and why."""

    backend: str  # "triton" or "reference"
    reason: str


@functools.cache
def triton_status() -> tuple[bool, str]:
    """Whether Triton can be imported here, and the version or the import error."""
    try:
        import triton
    except Exception as exc:  # ImportError, or a broken install raising anything
        return False, f"triton not importable ({type(exc).__name__}: {exc})"
    return True, f"triton {triton.__version__}"


def _env_forced() -> str | None:
    value = _ENV_BACKEND.strip().lower()
    if not value or value == "auto":
        return None
    if value not in BACKENDS:
        raise ValueError(f"FUSEFORMER_BACKEND: expected one of {BACKENDS} or 'auto', got {value!r}")
    return value


def forced_backend() -> str | None:
    """The backend forced by ``use_backend`` (innermost wins) or the environment, if any."""
    return _forced if _forced is not None else _env_forced()


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force every fused op inside the block onto one backend.

    >>> with fuseformer.use_backend("reference"):
    ...     y = fuseformer.ops.rms_norm(x, w)
    """
    global _forced
    if name not in BACKENDS and name != "auto":
        raise ValueError(f"use_backend: name must be one of {BACKENDS} or 'auto', got {name!r}")
    previous = _forced
    _forced = None if name == "auto" else name
    try:
        yield
    finally:
        _forced = previous


def natural_backend(device: torch.device | str, supported: bool = True, why_not: str = "") -> Choice:
    """The backend the rule picks for a tensor on ``device``, ignoring any forcing."""
    device = torch.device(device)
    ok, triton_info = triton_status()
    if not supported:
        return Choice("reference", why_not or "shape or dtype not supported by the kernel")
    if device.type == "cuda":
        if not ok:
            return Choice("reference", triton_info)
        return Choice("triton", f"CUDA tensor, {triton_info}")
    if device.type == "cpu":
        if INTERPRET and ok:
            return Choice("triton", "CPU tensor under TRITON_INTERPRET=1 (interpreter)")
        return Choice("reference", "CPU tensor (set TRITON_INTERPRET=1 to run kernels interpreted)")
    return Choice("reference", f"no Triton backend for device type {device.type!r}")


# (device, supported) -> natural backend; the rule depends on nothing else once Triton's import
# status is known, and this runs on every op call (host time shows on small shapes). Keyed on the
# device itself: ``device.type`` builds a new string each call (CPU 2026-12-01: ~2.5 us a call).
_natural_cache: dict[tuple[torch.device, bool], str] = {}


def choose_backend(op: str, device: torch.device, supported: bool = True, why_not: str = "") -> str:
    """The backend ``op`` runs on for inputs on ``device``: "triton" or "reference".

    ``supported=False`` (with ``why_not``) marks a shape or dtype the kernel does not cover; the
    reference then runs, unless Triton is forced, which raises.
    """
    forced = forced_backend()
    if forced == "reference":
        return "reference"
    key = (device, supported)
    backend = _natural_cache.get(key)
    if backend is not None and (forced is None or backend == forced):
        return backend
    choice = natural_backend(device, supported, why_not)
    _natural_cache[key] = choice.backend
    if forced == "triton" and choice.backend != "triton":
        raise RuntimeError(f"{op}: the Triton backend was forced but cannot run: {choice.reason}")
    return choice.backend


def explain(device: torch.device | str) -> Choice:
    """What an op with supported inputs would run on, for ``fuseformer info``."""
    forced = forced_backend()
    natural = natural_backend(device)
    if forced == "reference":
        return Choice("reference", "forced (FUSEFORMER_BACKEND or use_backend)")
    if forced == "triton":
        if natural.backend != "triton":
            return Choice("error", f"Triton forced but unavailable: {natural.reason}")
        return Choice("triton", "forced; " + natural.reason)
    return natural

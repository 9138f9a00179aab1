"""The autotune cache (DESIGN.md §7): the best launch config per (kernel, GPU, Triton version, shape bucket).

Where a config comes from, first hit wins:

1. this process's memory (a dict lookup on the hot path);
2. the disk cache, one JSON file per (kernel, GPU, Triton version) under ``~/.cache/fuseformer``
   (``FUSEFORMER_CACHE_DIR`` overrides), written by :func:`tune`, which ``fuseformer bench --tune``
   (bench/tune.py: one driver per tuned kernel) calls with each op's ``candidate_configs``;
3. the defaults shipped in the package (``runtime/tuned/<kernel>.json``), per GPU family (H200,
   H100), so that a first call never tunes; a kernel may also give a generic key (e.g. the T bucket
   alone) that the shipped table covers for any model shape;
4. the kernel's own rule (``default``).

Shapes are bucketed (next power of two of the dims that vary, such as the token count) by the
kernel's key, so a new length neither retunes nor recompiles. A cache file that cannot be read,
is not valid JSON, has another schema version, or belongs to another GPU or Triton version is
ignored with a warning, never an error; so is a stored config whose fields are not the kernel's
(``get_config(fields=...)``) or that fails its ``check``. Writes go to a temporary file renamed over
the old one (``os.replace``), so a reader never sees half a file and two tuning processes never
interleave.

Every Triton op takes its launch configs from here (kernel name: key):

- ``mlp_gate_up`` (ops/mlp.py): T bucket, H, I, dtype; shipped tables in ``tuned/``.
- ``rms_norm_fwd``, ``rms_norm_bwd``, ``rms_norm_dw``; ``layer_norm_fwd``, ``layer_norm_bwd``: the row
  length's bucket (N4096), ``add``/``norm`` (residual fused or not), dtype (the dw reduction: N only).
- ``glu_fwd``, ``glu_bwd`` (ops/activations.py): row length bucket, dtype.
- ``rotary`` (ops/rotary.py): tokens (bucket, up to 16), heads, pairs and pass-through dims
  (buckets), dtype.
- ``cross_entropy``: vocabulary bucket, ``loss``/``grad`` pass, dtype.
- ``attention_fwd``, ``attention_bwd_dkdv``, ``attention_bwd_dq``: padded head dim, ``causal`` (any
  causal or window bound) or ``full``, dtype.
- ``paged_attention``: ``decode``/``prefill``, tile rows (bucket, up to 128), padded head dim,
  element size.

The defaults of all but the MLP are the tables and rules in their op files (H200 sweeps where their
comments say so), the ``default`` of step 4, the same on every GPU (attention keeps its small
configs under the interpreter): nothing is shipped for them in ``tuned/`` until a tuning run is
committed. An op looks its config up once per (shape bucket, flags, dtype, device) in a cache made
with :func:`plan_cache`, never on every call; :func:`store` and :func:`clear_memory` empty those caches,
so a config tuned in this process is used at once. An explicit config (a launcher's ``config=`` argument:
what tuning and benchmarks/sweeps.py vary) replaces the lookup for that call; nothing else overrides it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

import torch

SCHEMA_VERSION = 1
_SHIPPED_DIR = Path(__file__).parent / "tuned"
# cache_clear of every plan_cache function: the ops' per-shape lookups.
_PLAN_CACHES: list[Callable[[], None]] = []

# (kernel, gpu) -> {key: config}: the disk cache as loaded once, plus what this process tuned.
_memory: dict[tuple[str, str], dict[str, dict]] = {}


# --------------------------------------------------------------------------------------------
# Identity of a cache entry
# --------------------------------------------------------------------------------------------
def cache_dir() -> Path:
    """Where tuned configs live: ``$FUSEFORMER_CACHE_DIR`` or ``~/.cache/fuseformer``."""
    return Path(os.environ.get("FUSEFORMER_CACHE_DIR") or Path.home() / ".cache" / "fuseformer")


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def gpu_name(device: torch.device | str | int | None = None) -> str:
    """The CUDA device's name (``"NVIDIA H200"``), or ``"cpu"`` for anything that is not CUDA.

    An int is a CUDA device index as ``Tensor.get_device()`` gives it (-1: a CPU tensor)."""
    if isinstance(device, int):
        return "cpu" if device < 0 else _device_name(device)
    device = torch.device(device) if device is not None else None
    if device is None:
        if not torch.cuda.is_available():
            return "cpu"
        return _device_name(torch.cuda.current_device())
    if device.type != "cuda":
        return "cpu"
    return _device_name(device.index if device.index is not None else torch.cuda.current_device())


def gpu_family(name: str) -> str:
    """The shipped-table family of a GPU name: "H200", "H100" (H100/H800 SXM and PCIe), or the name."""
    for family in ("H200", "H100", "H800", "GH200"):
        if family in name:
            return {"H800": "H100", "GH200": "H200"}.get(family, family)
    return name


@functools.cache
def triton_version() -> str:
    try:
        import triton

        return triton.__version__
    except Exception:
        return "none"


def bucket(n: int, minimum: int = 1) -> int:
    """The shape bucket of a dim that varies: the next power of two (at least ``minimum``)."""
    return max(minimum, 1 << max(0, (int(n) - 1).bit_length()))


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as keys spell it: "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in text)


def cache_path(kernel: str, gpu: str, triton: str | None = None) -> Path:
    """The disk cache file of one kernel on one GPU under one Triton version."""
    return cache_dir() / f"{_slug(kernel)}--{_slug(gpu)}--triton-{_slug(triton or triton_version())}.json"


# --------------------------------------------------------------------------------------------
# Disk cache
# --------------------------------------------------------------------------------------------
def _read_disk(kernel: str, gpu: str) -> dict[str, dict]:
    """The configs in the disk cache; {} (with a warning) when the file is unusable."""
    path = cache_path(kernel, gpu)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        warnings.warn(f"autotune: ignoring unreadable cache file {path} ({type(exc).__name__}: {exc})", stacklevel=3)
        return {}
    expected = dict(version=SCHEMA_VERSION, kernel=kernel, gpu=gpu, triton=triton_version())
    if not isinstance(data, dict) or not isinstance(data.get("configs"), dict):
        warnings.warn(f"autotune: ignoring cache file {path}: not a fuseformer autotune file", stacklevel=3)
        return {}
    stale = {k: data.get(k) for k, v in expected.items() if data.get(k) != v}
    if stale:
        warnings.warn(f"autotune: ignoring stale cache file {path}: {stale} (expected {expected})", stacklevel=3)
        return {}
    configs = {k: v for k, v in data["configs"].items() if isinstance(v, dict)}
    if len(configs) != len(data["configs"]):
        warnings.warn(f"autotune: ignoring malformed entries in cache file {path}", stacklevel=3)
    return configs


def _write_disk(kernel: str, gpu: str, configs: dict[str, dict]) -> Path:
    """Write the configs atomically: a temporary file in the same folder, then os.replace."""
    path = cache_path(kernel, gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dict(version=SCHEMA_VERSION, kernel=kernel, gpu=gpu, triton=triton_version(), configs=configs)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def _configs(kernel: str, gpu: str) -> dict[str, dict]:
    entry = _memory.get((kernel, gpu))
    if entry is None:
        entry = _memory[(kernel, gpu)] = _read_disk(kernel, gpu)
    return entry


@functools.cache
def _shipped(kernel: str) -> dict[str, dict[str, dict]]:
    """The package's tuned defaults for one kernel: {gpu family: {key: config}}."""
    path = _SHIPPED_DIR / f"{kernel}.json"
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        return {fam: dict(table) for fam, table in data["gpus"].items()}
    except Exception as exc:  # a broken install must not break the op
        warnings.warn(f"autotune: ignoring shipped table {path} ({type(exc).__name__}: {exc})", stacklevel=3)
        return {}


def clear_memory() -> None:
    """Forget what this process loaded or tuned, and the ops' plans made from it (tests; after
    editing the cache by hand)."""
    _memory.clear()
    clear_plans()


def plan_cache(fn: Callable) -> Callable:
    """``functools.cache`` for an op's function that resolves its launch plan through
    :func:`get_config` (once per shape bucket, flags and device); emptied by :func:`store` and
    :func:`clear_memory`, so that a config tuned or stored later is the one used."""
    cached = functools.cache(fn)
    _PLAN_CACHES.append(cached.cache_clear)
    return cached


def clear_plans() -> None:
    """Empty every :func:`plan_cache`."""
    for clear in _PLAN_CACHES:
        clear()


# --------------------------------------------------------------------------------------------
# Lookup and tuning
# --------------------------------------------------------------------------------------------
def lookup(
    kernel: str, key: str, device: torch.device | str | None = None, generic_key: str | None = None
) -> tuple[dict | None, str]:
    """(config, where it came from: "cache", "shipped" or "none") for ``kernel`` at ``key``."""
    gpu = gpu_name(device)
    cfg = _configs(kernel, gpu).get(key)
    if cfg is not None:
        return cfg, "cache"
    table = _shipped(kernel).get(gpu_family(gpu), {})
    for k in (key, generic_key):
        if k is not None and k in table:
            return table[k], "shipped"
    return None, "none"


def get_config(
    kernel: str,
    key: str,
    *,
    device: torch.device | str | None = None,
    default: dict | Callable[[], dict] | None = None,
    generic_key: str | None = None,
    fields: Collection[str] | None = None,
    check: Callable[[dict], bool] | None = None,
) -> dict | None:
    """The launch config of ``kernel`` for ``key`` on ``device`` (see the module doc for the order);
    ``default`` (a dict or a function making one) when nothing is stored. Never tunes.

    ``fields``: the keys a config must have, no more and no fewer; ``check``: a test the config must
    pass (e.g. a one-pass block covering the row). A stored config failing either is ignored with a
    warning: a hand-edited or stale entry must not break the op.
    """
    cfg, source = lookup(kernel, key, device, generic_key)
    if cfg is not None:
        bad = ""
        if fields is not None and set(cfg) != set(fields):
            bad = f"fields {sorted(cfg)}, expected {sorted(fields)}"
        elif check is not None and not check(cfg):
            bad = "it does not fit this shape"
        if not bad:
            return cfg
        warnings.warn(f"autotune: ignoring the {source} config {cfg} of {kernel} at {key}: {bad}", stacklevel=2)
    return default() if callable(default) else default


def store(kernel: str, key: str, config: dict, device: torch.device | str | None = None) -> Path:
    """Record ``config`` as the best for (kernel, this GPU, this Triton, key), in memory and on disk."""
    gpu = gpu_name(device)
    configs = dict(_configs(kernel, gpu))
    # Merge with what another process may have written since we loaded (last writer wins per key).
    with warnings.catch_warnings():  # a bad file was reported when it was first loaded
        warnings.simplefilter("ignore")
        configs.update(_read_disk(kernel, gpu))
    configs[key] = dict(config)
    _memory[(kernel, gpu)] = configs
    clear_plans()
    return _write_disk(kernel, gpu, configs)


def tune(
    kernel_name: str,
    configs: Iterable[dict],
    bench_fn: Callable[[dict], Callable[[], object]],
    key: str,
    *,
    timer: Callable[[Callable[[], object]], float],
    device: torch.device | str | None = None,
    force: bool = False,
) -> dict:
    """The fastest of ``configs`` for ``key``, measured and stored; the stored one if there is one.

    Args:
        kernel_name: the cache's kernel name (e.g. "mlp_gate_up").
        configs: candidate launch configs.
        bench_fn: config -> a zero-argument callable that runs the kernel once with it.
        key: the shape bucket (the kernel's own key function).
        timer: callable -> milliseconds (``fuseformer.bench._timing.bench_ms``, the one timing helper:
            the runtime takes it as an argument and imports nothing of ``fuseformer.bench``).
        force: measure even when the disk or memory cache already has ``key`` (``bench --tune``).

    A config that fails (compile error, out of resources) is skipped; if all fail, RuntimeError.
    """
    gpu = gpu_name(device)
    if not force:
        cached = _configs(kernel_name, gpu).get(key)
        if cached is not None:
            return cached
    best, best_ms, errors = None, float("inf"), []
    for cfg in configs:
        try:
            ms = timer(bench_fn(cfg))
        except Exception as exc:  # one bad config must not end the sweep
            errors.append(f"{cfg}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        if ms < best_ms:
            best, best_ms = dict(cfg), ms
    if best is None:
        raise RuntimeError(f"autotune: every config of {kernel_name} failed at {key}: " + "; ".join(errors[:3]))
    store(kernel_name, key, best, device)
    return best


# --------------------------------------------------------------------------------------------
# Shipping what a GPU run tuned
# --------------------------------------------------------------------------------------------
def ship(cache_files: Iterable[str | Path], shipped_dir: str | Path | None = None) -> list[Path]:
    """Merge disk-cache files (what ``fuseformer bench --tune`` wrote on some GPU, e.g. with
    ``FUSEFORMER_CACHE_DIR`` pointing into a device run's output) into the shipped tables
    ``runtime/tuned/<kernel>.json``, under the GPU's family; entries already shipped for other keys
    or families stay. Files that are not autotune cache files are skipped with a warning.
    Returns the tables written. (``python -m fuseformer.runtime.autotune ship FILE_OR_DIR...``)"""
    target = Path(shipped_dir) if shipped_dir is not None else _SHIPPED_DIR
    merged: dict[str, dict[str, dict[str, dict]]] = {}
    for src in cache_files:
        try:
            data = json.loads(Path(src).read_text())
            kernel, gpu, configs = data["kernel"], data["gpu"], data["configs"]
            if data.get("version") != SCHEMA_VERSION or not isinstance(configs, dict):
                raise ValueError(f"schema {data.get('version')!r}")
        except Exception as exc:
            warnings.warn(f"autotune.ship: skipping {src} ({type(exc).__name__}: {exc})", stacklevel=2)
            continue
        table = merged.setdefault(kernel, {}).setdefault(gpu_family(gpu), {})
        table.update({k: v for k, v in configs.items() if isinstance(v, dict)})
    written = []
    for kernel, families in sorted(merged.items()):
        path = target / f"{kernel}.json"
        data: dict[str, Any] = {"kernel": kernel}
        if path.exists():
            data = json.loads(path.read_text())  # other keys ("note") stay
        gpus = data.setdefault("gpus", {})
        for family, table in families.items():
            gpus[family] = {**gpus.get(family, {}), **table}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
        written.append(path)
    return written


def _main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m fuseformer.runtime.autotune")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("ship", help="merge disk-cache files into the package's shipped tables")
    s.add_argument("paths", nargs="+", help="cache files, or folders holding them (*.json)")
    s.add_argument("--into", default=None, help="the shipped tables' folder (default: the package's)")
    args = p.parse_args(argv)
    missing = [x for x in args.paths if not Path(x).exists()]
    if missing:
        print(f"autotune ship: no such file or folder: {', '.join(missing)}", file=sys.stderr)
        return 1
    files = [f for x in args.paths for f in (sorted(Path(x).glob("*.json")) if Path(x).is_dir() else [Path(x)])]
    if not files:
        print("autotune ship: no cache files found", file=sys.stderr)
        return 1
    for path in ship(files, args.into):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())

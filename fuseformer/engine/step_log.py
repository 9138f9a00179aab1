"""Where an engine's steps spend their time, by kind of step (``EngineCore.step_log``, also ``LLM.step_log``).

Each step is one ``StepRecord``: its kind ("graph": a decode step replayed from a CUDA graph;
"pieces": a step with prompt chunks replayed as CUDA graph pieces around attention; "decode": a
decode-only step run eagerly; "prefill": prompt chunks only, eagerly; "mixed": prompt chunks and
decoding requests, eagerly), its tokens and requests, and three host intervals:

- ``launch_ms``: scheduling and enqueuing the device work (``EngineCore.launch_step``);
- ``wait_ms``: waiting for the device and reading the sampled tokens (``ModelRunner.collect``);
- ``post_ms``: the rest of ``EngineCore.finish_step`` (scheduler update, detokenizing, the outputs);

and, on CUDA, ``gpu_ms``: the device's span from the step's first enqueued work to its last (CUDA
events; it includes the device's idle gaps while the host is still launching, so a span close to
``launch_ms`` says the step is host-bound). A step with structured outputs also records ``mask_ms``,
how long the grammar library took to fill its rows' token mask, and ``mask_wait_ms``, how much of
``launch_ms`` the host spent waiting for it (the rest of the fill ran beside other host work). The log
keeps the last ``maxlen`` records and running totals by kind, so a benchmark can compare the offline
run's steps with the server's.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepRecord:
    kind: str
    tokens: int
    seqs: int
    launch_ms: float
    wait_ms: float
    post_ms: float
    gpu_ms: float | None = None
    mask_ms: float | None = None
    mask_wait_ms: float | None = None

    @property
    def wall_ms(self) -> float:
        return self.launch_ms + self.wait_ms + self.post_ms


class StepLog:
    """The last ``maxlen`` steps, and totals by kind since the start (``totals``)."""

    def __init__(self, maxlen: int = 16384) -> None:
        if not isinstance(maxlen, int) or maxlen < 1:
            raise ValueError(f"StepLog: maxlen must be a positive int, got {maxlen!r}")
        self.records: deque[StepRecord] = deque(maxlen=maxlen)
        self.count = 0  # records added since the start
        self._totals: dict[str, list[float]] = {}

    def add(self, record: StepRecord) -> None:
        self.records.append(record)
        self.count += 1
        t = self._totals.setdefault(record.kind, [0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
        t[0] += 1
        t[1] += record.tokens
        t[2] += record.launch_ms
        t[3] += record.wait_ms
        t[4] += record.post_ms
        t[5] += record.gpu_ms or 0.0
        t[6] += record.wall_ms
        t[7] += record.mask_ms or 0.0
        t[8] += record.mask_wait_ms or 0.0

    def since(self, count: int) -> list[StepRecord]:
        """The records added after the ``count``-th (those still kept)."""
        n = min(self.count - count, len(self.records))
        return [self.records[i] for i in range(-n, 0)] if n > 0 else []

    def totals(self) -> dict[str, dict[str, float]]:
        """Per kind: steps, tokens, and the seconds of launch, wait, post, gpu, wall, mask (the grammar
        masks' fills) and mask_wait (the host's waits for them) summed."""
        names = ("steps", "tokens", "launch_s", "wait_s", "post_s", "gpu_s", "wall_s", "mask_s", "mask_wait_s")
        out = {}
        for kind, t in self._totals.items():
            out[kind] = {n: (v if i < 2 else round(v / 1e3, 4)) for i, (n, v) in enumerate(zip(names, t))}
        return out


def totals_since(now: dict[str, dict[str, float]], before: dict[str, dict[str, float]]) -> dict[str, dict]:
    """``StepLog.totals()`` less an earlier snapshot of it: the steps in between, by kind."""
    out = {}
    for kind, t in now.items():
        b = before.get(kind, {})
        diff = {n: round(v - b.get(n, 0), 4) for n, v in t.items()}
        if diff["steps"]:
            out[kind] = diff
    return out


def p50_max(values: list[float]) -> dict[str, float]:
    """{"p50": median, "max": max} of non-empty ``values``, rounded to 0.01."""
    return dict(p50=round(statistics.median(values), 2), max=round(max(values), 2))


def summarize(records: list[StepRecord]) -> dict[str, dict[str, float]]:
    """Median and max, ms, of each interval over ``records`` (e.g. the prefill steps of lone requests)."""
    out: dict[str, dict[str, float]] = {}
    for name in ("launch_ms", "wait_ms", "post_ms", "gpu_ms", "wall_ms", "mask_ms", "mask_wait_ms"):
        values = [v for r in records if (v := getattr(r, name)) is not None]
        if values:
            out[name] = p50_max(values)
    return out

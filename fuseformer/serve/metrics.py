"""Prometheus metrics of one server (``GET /metrics``), in a registry of its own (not the process-wide
default), so several apps in one process (tests, benchmarks) do not share counters.

Every metric is exported twice, from the same numbers: as ``fuseformer_<name>`` and under vLLM's
name (``vllm:<name>``), so that dashboards made for vLLM work unchanged (docs/serving.md lists both).
Engine state (running/waiting requests, KV usage, prefix-cache hit rate, preemptions) is read from
the engine when scraped; latencies and token counts are observed by the request handlers as
outputs stream out.

Observations are kept in plain Python numbers, not ``prometheus_client`` metric objects: the handlers
all run on the event loop's thread, so no lock is needed, and an observation costs ~0.3 us instead of
~2 us (plus ~4 us for ``labels()``), which at 256 streams is per engine step. ``collect()`` exports them.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from fuseformer.engine.scheduler import SchedulerStats

# Seconds: from 1 ms (a decode step of a small model on a GPU) to a minute (a long queue on a CPU).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
# Whole requests and their queueing: vLLM's buckets (0.3 s to 2 h 40 min), with sub-second ones first.
_REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)

# Exported as fuseformer_<name> and as vllm:<name> (vLLM v1's names and meanings).
_SHARED = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "num_preemptions",
    "prompt_tokens",
    "generation_tokens",
    "request_success",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
)
# Exported under fuseformer_ only: vLLM's v1 exports the prefix cache as query/hit counters, which the
# engine's stats do not hold (a hit rate only).
_OWN_ONLY = ("prefix_cache_hit_rate",)
# vLLM's earlier name of kv_cache_usage_perc, which older dashboards read.
_VLLM_ALIASES = {"gpu_cache_usage_perc": "kv_cache_usage_perc"}


class _Histogram:
    """A histogram written by one thread without locks; exported as a Prometheus histogram."""

    def __init__(self, documentation: str, buckets: tuple[float, ...]) -> None:
        self.documentation = documentation
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """``count`` observations of ``value``."""
        self.counts[bisect.bisect_left(self.bounds, value)] += count  # the first bound >= value: le semantics
        self.sum += value * count

    def family(self, name: str, model_name: str) -> HistogramMetricFamily:
        cumulative = list(itertools.accumulate(self.counts))
        buckets = [(repr(float(b)), c) for b, c in zip(self.bounds, cumulative)] + [("+Inf", cumulative[-1])]
        family = HistogramMetricFamily(name, self.documentation, labels=["model_name"])
        family.add_metric([model_name], buckets, self.sum)
        return family


class ServerMetrics:
    """The server's metrics; ``render()`` gives the exposition text. The ``observe_*`` and ``count_*``
    methods are called from the event loop's thread only."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats = SchedulerStats()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished: Counter[str] = Counter()  # completions by finish reason
        self.histograms = {
            "time_to_first_token_seconds": _Histogram(
                "From the request's arrival to its first output token", _TTFT_BUCKETS
            ),
            "inter_token_latency_seconds": _Histogram(
                "Between consecutive output tokens of a completion", _ITL_BUCKETS
            ),
            "e2e_request_latency_seconds": _Histogram(
                "From the request's arrival to a completion's last token", _REQUEST_BUCKETS
            ),
            "request_queue_time_seconds": _Histogram(
                "From the request's arrival to its first scheduling (reported by the engine)", _REQUEST_BUCKETS
            ),
            "request_prompt_tokens": _Histogram("Prompt tokens of a request", _TOKEN_BUCKETS),
            "request_generation_tokens": _Histogram("Output tokens of a finished completion", _TOKEN_BUCKETS),
        }
        self._ttft = self.histograms["time_to_first_token_seconds"]
        self._itl = self.histograms["inter_token_latency_seconds"]
        self.registry = CollectorRegistry()
        self.registry.register(self)

    # ---- observations (the event loop's thread) --------------------------------------------------

    def observe_first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_inter_token(self, seconds: float, num_tokens: int = 1) -> None:
        """``num_tokens`` tokens arrived ``seconds`` after the previous ones: each counts seconds / num_tokens."""
        self._itl.observe(seconds / num_tokens, num_tokens)

    def observe_prompt(self, num_tokens: int) -> None:
        """A prompt was added (each prompt of a request once, whatever its ``n``)."""
        self.prompt_tokens += num_tokens
        self.histograms["request_prompt_tokens"].observe(num_tokens)

    def observe_queue_time(self, seconds: float) -> None:
        self.histograms["request_queue_time_seconds"].observe(seconds)

    def count_tokens(self, generation: int) -> None:
        self.generation_tokens += generation

    def count_finished(self, reason: str, e2e_s: float, num_tokens: int) -> None:
        """A completion finished with ``reason``, ``e2e_s`` after its request arrived, ``num_tokens`` long."""
        self.finished[reason] += 1
        self.histograms["e2e_request_latency_seconds"].observe(e2e_s)
        self.histograms["request_generation_tokens"].observe(num_tokens)

    # ---- export --------------------------------------------------------------------------------

    def render(self, stats: SchedulerStats) -> bytes:
        self.stats = stats
        return generate_latest(self.registry)

    def collect(self):
        for name in (*_SHARED, *_OWN_ONLY):
            yield from self._families(name, f"fuseformer_{name}")
        for name in _SHARED:
            yield from self._families(name, f"vllm:{name}")
        for alias, name in _VLLM_ALIASES.items():
            yield from self._families(name, f"vllm:{alias}")

    def _families(self, name: str, exported: str):
        """The metric ``name`` as the families of ``exported``."""
        labels, model = ["model_name"], [self.model_name]
        s = self.stats
        gauges = {
            "num_requests_running": ("Requests being computed", s.num_running),
            "num_requests_waiting": ("Requests waiting to be scheduled", s.num_waiting),
            "kv_cache_usage_perc": ("Fraction of KV blocks in use (1 = full)", s.kv_cache_usage),
            "prefix_cache_hit_rate": ("Prefix-cache hits / lookups (tokens)", s.prefix_cache_hit_rate),
        }
        counters = {
            "num_preemptions": ("Preemptions since start", s.num_preemptions),
            "prompt_tokens": ("Prompt tokens of requests", self.prompt_tokens),
            "generation_tokens": ("Output tokens", self.generation_tokens),
        }
        if name in gauges:
            doc, value = gauges[name]
            family = GaugeMetricFamily(exported, doc, labels=labels)
            family.add_metric(model, value)
            yield family
        elif name in counters:
            doc, value = counters[name]
            family = CounterMetricFamily(exported, doc, labels=labels)
            family.add_metric(model, value)
            yield family
        elif name == "request_success":
            family = CounterMetricFamily(exported, "Finished completions", labels=[*labels, "finished_reason"])
            for reason, count in sorted(self.finished.items()):
                family.add_metric([*model, reason], count)
            yield family
        else:
            yield self.histograms[name].family(exported, self.model_name)

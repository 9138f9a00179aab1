"""Prometheus metrics of one server (``GET /metrics``), in a registry of its own (not the process-wide
default), so several apps in one process (tests, benchmarks) do not share counters.

Engine state (running/waiting requests, KV usage, prefix-cache hit rate) is read from the engine when
scraped; latencies and token counts are observed by the request handlers as outputs stream out.

What is observed per token (inter-token latency, generated tokens) and per request (time to first
token) is kept in plain Python numbers, not ``prometheus_client`` metric objects: the handlers all run
on the event loop's thread, so no lock is needed, and an observation costs ~0.3 us instead of ~2 us
(plus ~4 us for ``labels()``), which at 256 streams is per engine step. ``collect()`` exports them.
"""

from __future__ import annotations

import bisect
import itertools

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from fuseformer.engine.scheduler import SchedulerStats

# Seconds: from 1 ms (a decode step of a small model on a GPU) to a minute (a long queue on a CPU).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class _Histogram:
    """A histogram written by one thread without locks; exported as a Prometheus histogram."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...]) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """``count`` observations of ``value``."""
        self.counts[bisect.bisect_left(self.bounds, value)] += count  # the first bound >= value: le semantics
        self.sum += value * count

    def family(self, model_name: str) -> HistogramMetricFamily:
        cumulative = list(itertools.accumulate(self.counts))
        buckets = [(repr(float(b)), c) for b, c in zip(self.bounds, cumulative)] + [("+Inf", cumulative[-1])]
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model_name"])
        family.add_metric([model_name], buckets, self.sum)
        return family


class _HotPath:
    """The collector of the metrics observed per token and per request (see the module docstring)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.ttft = _Histogram(
            "fuseformer_time_to_first_token_seconds",
            "From the request's arrival to its first output token",
            _TTFT_BUCKETS,
        )
        self.itl = _Histogram(
            "fuseformer_inter_token_latency_seconds",
            "Between consecutive output tokens of a completion",
            _ITL_BUCKETS,
        )
        self.generation_tokens = 0

    def collect(self):
        yield self.ttft.family(self.model_name)
        yield self.itl.family(self.model_name)
        tokens = CounterMetricFamily("fuseformer_generation_tokens", "Output tokens", labels=["model_name"])
        tokens.add_metric([self.model_name], self.generation_tokens)
        yield tokens


class ServerMetrics:
    """The server's metrics; ``render()`` gives the exposition text. The ``observe_*`` and ``count_*``
    methods are called from the event loop's thread only."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        running = Gauge("fuseformer_num_requests_running", "Requests being computed", labels, registry=r)
        waiting = Gauge("fuseformer_num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r)
        kv_usage = Gauge(
            "fuseformer_kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)", labels, registry=r
        )
        prefix_hit_rate = Gauge(
            "fuseformer_prefix_cache_hit_rate", "Prefix-cache hits / lookups (tokens)", labels, registry=r
        )
        preemptions = Gauge("fuseformer_num_preemptions", "Preemptions since start", labels, registry=r)
        self.running, self.waiting = running.labels(model_name), waiting.labels(model_name)
        self.kv_usage, self.prefix_hit_rate = kv_usage.labels(model_name), prefix_hit_rate.labels(model_name)
        self.preemptions = preemptions.labels(model_name)
        self.prompt_tokens = Counter(
            "fuseformer_prompt_tokens", "Prompt tokens of requests", labels, registry=r
        ).labels(model_name)
        self.requests = Counter(
            "fuseformer_request_success", "Finished completions", [*labels, "finished_reason"], registry=r
        )
        self._hot = _HotPath(model_name)
        r.register(self._hot)
        self.model_name = model_name

    def set_engine_stats(self, stats: SchedulerStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.prefix_hit_rate.set(stats.prefix_cache_hit_rate)
        self.preemptions.set(stats.num_preemptions)

    def observe_first_token(self, seconds: float) -> None:
        self._hot.ttft.observe(seconds)

    def observe_inter_token(self, seconds: float, num_tokens: int = 1) -> None:
        """``num_tokens`` tokens arrived ``seconds`` after the previous ones: each counts seconds / num_tokens."""
        self._hot.itl.observe(seconds / num_tokens, num_tokens)

    def count_tokens(self, prompt: int = 0, generation: int = 0) -> None:
        if prompt:
            self.prompt_tokens.inc(prompt)
        if generation:
            self._hot.generation_tokens += generation

    def count_finished(self, reason: str) -> None:
        self.requests.labels(self.model_name, reason).inc()

    content_type = CONTENT_TYPE_LATEST

    def render(self, stats: SchedulerStats) -> bytes:
        self.set_engine_stats(stats)
        return generate_latest(self.registry)

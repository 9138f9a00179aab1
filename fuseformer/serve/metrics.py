"""Prometheus metrics of one server (``GET /metrics``), in a registry of its own (not the process-wide
default), so several apps in one process (tests, benchmarks) do not share counters.

Engine state (running/waiting requests, KV usage, prefix-cache hit rate) is read from the engine when
scraped; latencies and token counts are observed by the request handlers as outputs stream out.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from fuseformer.engine.scheduler import SchedulerStats

# Seconds: from 1 ms (a decode step of a small model on a GPU) to a minute (a long queue on a CPU).
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """The server's metrics; ``render()`` gives the exposition text."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.running = Gauge("fuseformer_num_requests_running", "Requests being computed", labels, registry=r)
        self.waiting = Gauge("fuseformer_num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r)
        self.kv_usage = Gauge(
            "fuseformer_kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full)", labels, registry=r
        )
        self.prefix_hit_rate = Gauge(
            "fuseformer_prefix_cache_hit_rate", "Prefix-cache hits / lookups (tokens)", labels, registry=r
        )
        self.preemptions = Gauge("fuseformer_num_preemptions", "Preemptions since start", labels, registry=r)
        self.ttft = Histogram(
            "fuseformer_time_to_first_token_seconds",
            "From the request's arrival to its first output token",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "fuseformer_inter_token_latency_seconds",
            "Between consecutive output tokens of a completion",
            labels,
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("fuseformer_prompt_tokens", "Prompt tokens of requests", labels, registry=r)
        self.generation_tokens = Counter("fuseformer_generation_tokens", "Output tokens", labels, registry=r)
        self.requests = Counter(
            "fuseformer_request_success", "Finished completions", [*labels, "finished_reason"], registry=r
        )
        self.model_name = model_name

    def set_engine_stats(self, stats: SchedulerStats) -> None:
        m = self.model_name
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_cache_usage)
        self.prefix_hit_rate.labels(m).set(stats.prefix_cache_hit_rate)
        self.preemptions.labels(m).set(stats.num_preemptions)

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model_name).observe(seconds)

    def observe_inter_token(self, seconds: float, num_tokens: int = 1) -> None:
        """``num_tokens`` tokens arrived ``seconds`` after the previous ones: each counts seconds / num_tokens."""
        h = self.itl.labels(self.model_name)
        for _ in range(num_tokens):
            h.observe(seconds / num_tokens)

    def count_tokens(self, prompt: int = 0, generation: int = 0) -> None:
        if prompt:
            self.prompt_tokens.labels(self.model_name).inc(prompt)
        if generation:
            self.generation_tokens.labels(self.model_name).inc(generation)

    def count_finished(self, reason: str) -> None:
        self.requests.labels(self.model_name, reason).inc()

    content_type = CONTENT_TYPE_LATEST

    def render(self, stats: SchedulerStats) -> bytes:
        self.set_engine_stats(stats)
        return generate_latest(self.registry)

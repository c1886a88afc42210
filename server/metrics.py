"""GET /metrics: the engine in Prometheus' text format, under vLLM's metric names and meanings, so vLLM's Grafana
dashboards work unchanged. Gauges read the latest snapshot when scraped; counters and histograms add up the
IterationStats handed over after every step. Each app has its own CollectorRegistry, never the global one.
"""
from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from engine.service import IterationStats
from engine.snapshot import EngineSnapshot

# vLLM's buckets (vllm/v1/metrics/loggers.py), so its dashboards' quantiles mean the same here
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason values, present (at 0) from the start
LABELS = ["model_name", "engine"]  # vLLM's labels; one engine here, index 0
# (vLLM's counter, its help text, the IterationStats field each step adds to it)
COUNTERS = (
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
     "prefix_cache_queries"),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "prefix_cache_hits"),
    ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", "num_preemptions"),
    ("vllm:prompt_tokens", "Number of prefill tokens processed.", "num_prompt_tokens"),
    ("vllm:generation_tokens", "Number of generation tokens processed.", "num_generation_tokens"),
    ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "spec_num_drafts"),
    ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "spec_num_draft_tokens"),
    ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", "spec_num_accepted_tokens"),
)


class EngineMetrics:
    def __init__(self, model_name: str, snapshot: Callable[[], EngineSnapshot]) -> None:
        """`snapshot`: the live engine's latest snapshot (a callable: the engine may be restarted)."""
        self.registry = CollectorRegistry()
        self._labels = (model_name, "0")
        r = self.registry

        def gauge(name: str, doc: str, read: Callable[[EngineSnapshot], float]) -> None:
            Gauge(name, doc, LABELS, registry=r).labels(*self._labels).set_function(lambda: read(snapshot()))

        def histogram(name: str, doc: str, buckets: list[float]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=r).labels(*self._labels)

        gauge("vllm:num_requests_running", "Number of requests in model execution batches.", lambda s: s.num_running)
        gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lambda s: s.num_waiting)
        gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
              lambda s: s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        self._counters = [(Counter(name, doc, LABELS, registry=r).labels(*self._labels), field)
                          for name, doc, field in COUNTERS]
        self._request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                        [*LABELS, "finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self._request_success.labels(*self._labels, reason)
        self.time_to_first_token = histogram("vllm:time_to_first_token_seconds",
                                             "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.inter_token_latency = histogram("vllm:inter_token_latency_seconds",
                                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e_request_latency = histogram("vllm:e2e_request_latency_seconds",
                                             "Histogram of e2e request latency in seconds.", E2E_BUCKETS)

        r.register(CacheConfigInfo(self._labels, snapshot))

    def record(self, stats: IterationStats) -> None:
        """One engine step (called on the engine thread; prometheus_client's metrics are thread-safe)."""
        for counter, field in self._counters:
            counter.inc(getattr(stats, field))
        for ttft in stats.time_to_first_tokens:
            self.time_to_first_token.observe(ttft)
        for itl in stats.inter_token_latencies:
            self.inter_token_latency.observe(itl)
        for finished in stats.finished:
            self._request_success.labels(*self._labels, finished.finish_reason).inc()
            self.e2e_request_latency.observe(finished.e2e_latency)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class CacheConfigInfo:
    """vllm:cache_config_info: the KV pool's shape as labels (value 1), as vLLM publishes it, so a dashboard
    attached from elsewhere can draw usage in blocks. Read at each scrape: the pool may be rebuilt at runtime."""

    def __init__(self, labels: tuple[str, str], snapshot: Callable[[], EngineSnapshot]) -> None:
        self.labels, self.snapshot = labels, snapshot

    def describe(self) -> list:
        return []  # no fixed description: the registry then never calls collect() at registration

    def collect(self):
        snap = self.snapshot()
        family = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                   labels=[*LABELS, "block_size", "num_gpu_blocks", "enable_prefix_caching"])
        family.add_metric([*self.labels, str(snap.block_size), str(snap.kv_blocks_total),
                           str(snap.features["prefix_caching"].active)], 1.0)  # what runs, not what is asked
        yield family

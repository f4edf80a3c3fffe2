"""vLLM-named Prometheus series beside the OpenTelemetry ones (docs/architecture.md
section 9).

Routers, gateways, KEDA blueprints and dashboards of the Kubernetes LLM stack read
vLLM's metric names: the Gateway API Inference Extension's endpoint picker reads
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` and `vllm:cache_config_info`.
OpenTelemetry names cannot hold a colon, so these are prometheus_client metrics on the
same registry as the OpenTelemetry reader: one /metrics page shows both name sets.

The gauges and cumulative counters read the engine's stats snapshot when scraped; the
latency histograms and token counters are fed per request by `RequestTelemetry`, so
gRPC and HTTP requests both count. Every series carries `model_name`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# Bucket boundaries as vLLM's dashboard expects them (seconds).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class CacheConfig:
    """What `vllm:cache_config_info` reports; known once the engine is loaded."""

    model_name: str
    block_size: int
    num_gpu_blocks: int
    enable_prefix_caching: bool


class VllmMetrics:
    """The vLLM-named series on `registry`.

    `stats` returns the engine's latest snapshot (None while the model loads, when the
    engine-fed series show nothing); `bind` names the model once it is loaded.
    """

    def __init__(self, registry: CollectorRegistry, stats: Callable[[], Any]) -> None:
        self._stats = stats
        self.config: CacheConfig | None = None
        label = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, label, registry=registry, buckets=buckets)

        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds",
            "Time between output tokens in seconds.",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency in seconds.",
            REQUEST_BUCKETS,
        )
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Time requests spent waiting in the queue.",
            REQUEST_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens processed.", label, registry=registry
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens produced.", label, registry=registry
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Finished requests (samples), by finish reason.",
            [*label, "finished_reason"],
            registry=registry,
        )
        registry.register(_EngineCollector(self))

    def bind(self, config: CacheConfig) -> None:
        """Sets the model's name and cache settings; every series starts at zero."""
        self.config = config
        name = config.model_name
        for metric in (
            self.time_to_first_token,
            self.inter_token_latency,
            self.e2e_request_latency,
            self.request_queue_time,
            self.prompt_tokens,
            self.generation_tokens,
        ):
            metric.labels(name)
        for reason in FINISH_REASONS:
            self.request_success.labels(name, reason)

    # Per-request observations; ignored until `bind` (no request runs before it).

    def first_token(self, seconds: float) -> None:
        if self.config is not None:
            self.time_to_first_token.labels(self.config.model_name).observe(seconds)

    def new_tokens(self, seconds_since_previous: float, count: int) -> None:
        """`count` tokens of one sample arrived together, `seconds_since_previous` after
        its previous token: each counts as an interval of the mean."""
        if self.config is not None and count > 0:
            child = self.inter_token_latency.labels(self.config.model_name)
            for _ in range(count):
                child.observe(seconds_since_previous / count)

    def queued(self, seconds: float) -> None:
        if self.config is not None:
            self.request_queue_time.labels(self.config.model_name).observe(seconds)

    def sample_finished(self, finish_reason: str) -> None:
        if self.config is not None and finish_reason in FINISH_REASONS:
            self.request_success.labels(self.config.model_name, finish_reason).inc()

    def request_finished(self, seconds: float, prompt_tokens: int, output_tokens: int) -> None:
        if self.config is None:
            return
        name = self.config.model_name
        self.e2e_request_latency.labels(name).observe(seconds)
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(output_tokens)


class _EngineCollector:
    """The series read from the engine's stats snapshot at scrape time."""

    def __init__(self, metrics: VllmMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        config, stats = self.metrics.config, self.metrics._stats()
        if config is None or stats is None:
            return []
        name = [config.model_name]

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(metric, doc, labels=["model_name"])
            family.add_metric(name, value)
            return family

        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the KV cache configuration.",
            labels=["model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        info.add_metric(
            [
                config.model_name,
                str(config.block_size),
                str(config.num_gpu_blocks),
                str(config.enable_prefix_caching),
            ],
            1.0,
        )
        return [
            gauge("vllm:num_requests_running", "Requests running on the engine.", stats.running),
            gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.waiting),
            gauge(
                "vllm:kv_cache_usage_perc",
                "KV-cache usage as a fraction: 1 means every block is in use.",
                1.0 - stats.kv.free_ratio,
            ),
            info,
            counter(
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache.",
                stats.prefix_cache_queries,
            ),
            counter(
                "vllm:prefix_cache_hits",
                "Prompt tokens found in the prefix cache.",
                stats.prefix_cache_hits,
            ),
            counter(
                "vllm:num_preemptions", "Preemptions of running requests.", stats.num_preemptions
            ),
        ]

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
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
# Token-count histograms reach max_model_len, as vLLM's do; this when it is not known.
DEFAULT_MAX_MODEL_LEN = 2048


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's token-count buckets."""
    out, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


@dataclass(frozen=True)
class CacheConfig:
    """What `vllm:cache_config_info` reports; known once the engine is loaded."""

    model_name: str
    block_size: int
    num_gpu_blocks: int
    enable_prefix_caching: bool
    max_model_len: int = DEFAULT_MAX_MODEL_LEN  # the top of the token-count buckets


class VllmMetrics:
    """The vLLM-named series on `registry`.

    `stats` returns the engine's latest snapshot (None while the model loads, when the
    engine-fed series show nothing); `bind` names the model once it is loaded.
    """

    def __init__(self, registry: CollectorRegistry, stats: Callable[[], Any]) -> None:
        self._stats = stats
        self._registry = registry
        self.config: CacheConfig | None = None
        # Per-request token histograms, made by `bind`: their buckets reach max_model_len.
        self.request_prompt_tokens: Histogram | None = None
        self.request_generation_tokens: Histogram | None = None
        self.request_max_num_generation_tokens: Histogram | None = None
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
        # vLLM's older name of the same intervals; autoscalers (llm-d's) still read it.
        self.time_per_output_token = histogram(
            "vllm:time_per_output_token_seconds",
            "Time per output token in seconds (the interval between output tokens).",
            ITL_BUCKETS,
        )
        self.request_params_n = histogram(
            "vllm:request_params_n", "The n request parameter.", PARAMS_N_BUCKETS
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
        if self.request_prompt_tokens is None:
            tokens = buckets_1_2_5(config.max_model_len)
            label = ["model_name"]
            self.request_prompt_tokens = Histogram(
                "vllm:request_prompt_tokens",
                "Prompt tokens per request.",
                label,
                registry=self._registry,
                buckets=tokens,
            )
            self.request_generation_tokens = Histogram(
                "vllm:request_generation_tokens",
                "Generated tokens per request (all its samples).",
                label,
                registry=self._registry,
                buckets=tokens,
            )
            self.request_max_num_generation_tokens = Histogram(
                "vllm:request_max_num_generation_tokens",
                "Generated tokens of a request's longest sample.",
                label,
                registry=self._registry,
                buckets=tokens,
            )
        self.config = config
        name = config.model_name
        for metric in (
            self.time_to_first_token,
            self.inter_token_latency,
            self.time_per_output_token,
            self.request_params_n,
            self.request_prompt_tokens,
            self.request_generation_tokens,
            self.request_max_num_generation_tokens,
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
            name = self.config.model_name
            itl = self.inter_token_latency.labels(name)
            tpot = self.time_per_output_token.labels(name)
            for _ in range(count):
                itl.observe(seconds_since_previous / count)
                tpot.observe(seconds_since_previous / count)

    def queued(self, seconds: float) -> None:
        if self.config is not None:
            self.request_queue_time.labels(self.config.model_name).observe(seconds)

    def sample_finished(self, finish_reason: str) -> None:
        if self.config is not None and finish_reason in FINISH_REASONS:
            self.request_success.labels(self.config.model_name, finish_reason).inc()

    def request_finished(
        self,
        seconds: float,
        prompt_tokens: int,
        output_tokens: int,
        n: int = 1,
        max_sample_tokens: int | None = None,
    ) -> None:
        """One request ended: `output_tokens` over its `n` samples, the longest
        `max_sample_tokens` (default: all of them, one sample)."""
        if self.config is None:
            return
        name = self.config.model_name
        self.e2e_request_latency.labels(name).observe(seconds)
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(output_tokens)
        self.request_prompt_tokens.labels(name).observe(prompt_tokens)
        self.request_generation_tokens.labels(name).observe(output_tokens)
        longest = output_tokens if max_sample_tokens is None else max_sample_tokens
        self.request_max_num_generation_tokens.labels(name).observe(longest)
        self.request_params_n.labels(name).observe(n)


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
            counter(
                "pagedinfer_kv_events_dropped",
                "KV-cache event batches dropped because no one drained the publisher's queue.",
                getattr(stats, "kv_events_dropped", 0),
            ),
        ]

"""vLLM's per-request series that autoscalers read (llm-d's workload variant
autoscaler: prompt and generation tokens per request, time per output token), with
vLLM's buckets, fed from a request's deltas like every other series."""

from __future__ import annotations

from types import SimpleNamespace

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedinfer.service.metrics import Telemetry
from pagedinfer.service.vllm_metrics import CacheConfig, VllmMetrics, buckets_1_2_5

MODEL = "tiny"


def stats(**overrides):
    kv = SimpleNamespace(total=100, free=40, used=60, cached=5, free_ratio=0.4, demand=130)
    values = dict(
        kv=kv, running=1, waiting=0, num_preemptions=0, prefix_cache_queries=0, prefix_cache_hits=0
    )
    return SimpleNamespace(**{**values, **overrides})


class Clock:
    now = 10.0

    def __call__(self) -> float:
        return self.now


def samples(registry: CollectorRegistry) -> dict[tuple[str, str | None], float]:
    """(sample name, its `le`) -> value, for the model's series."""
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.labels.get("model_name") == MODEL:
                out[(s.name, s.labels.get("le"))] = s.value
    return out


def test_token_buckets_are_vllms_1_2_5_up_to_max_model_len():
    assert buckets_1_2_5(512) == (1, 2, 5, 10, 20, 50, 100, 200, 500)
    assert buckets_1_2_5(2048)[-3:] == (500, 1000, 2000)
    assert buckets_1_2_5(1) == (1,)


def test_a_request_feeds_the_per_request_series():
    registry, clock = CollectorRegistry(), Clock()
    telemetry = Telemetry(
        lambda: stats(kv_events_dropped=3),
        metric_readers=[PrometheusMetricReader(registry=registry)],
        clock=clock,
    )
    telemetry.vllm = VllmMetrics(registry, lambda: stats(kv_events_dropped=3))
    telemetry.vllm.bind(CacheConfig(MODEL, 16, 100, True, max_model_len=512))
    trace = telemetry.start_request(request_id="r", operation="text_completion", model=MODEL)
    trace.queued(37)
    # Two samples (n=2): sample 0 makes 3 tokens 0.02 s apart, sample 1 makes 1 token.
    clock.now += 0.5
    trace.on_delta(0, 1, 1, 0, None)
    trace.on_delta(1, 1, 1, 0, "stop")
    for completion in (2, 3):
        clock.now += 0.02
        trace.on_delta(0, 1, completion, 0, "length" if completion == 3 else None)
    trace.end()
    got = samples(registry)
    telemetry.shutdown()

    assert got[("vllm:request_prompt_tokens_sum", None)] == 37
    assert got[("vllm:request_prompt_tokens_bucket", "20.0")] == 0
    assert got[("vllm:request_prompt_tokens_bucket", "50.0")] == 1
    assert got[("vllm:request_generation_tokens_sum", None)] == 4  # both samples
    assert got[("vllm:request_max_num_generation_tokens_sum", None)] == 3  # the longest
    assert got[("vllm:request_params_n_sum", None)] == 2
    assert got[("vllm:request_params_n_bucket", "1.0")] == 0
    assert got[("vllm:request_params_n_bucket", "2.0")] == 1
    # Buckets as vLLM's: 1-2-5 token counts up to max_model_len, n up to 20.
    les = {le for name, le in got if name == "vllm:request_generation_tokens_bucket"}
    assert les == {*(f"{b}.0" for b in buckets_1_2_5(512)), "+Inf"}
    les = {le for name, le in got if name == "vllm:request_params_n_bucket"}
    assert les == {"1.0", "2.0", "5.0", "10.0", "20.0", "+Inf"}
    # Time per output token: the intervals between a sample's tokens, as ITL.
    tpot_count = got[("vllm:time_per_output_token_seconds_count", None)]
    assert tpot_count == got[("vllm:inter_token_latency_seconds_count", None)] == 2
    assert abs(got[("vllm:time_per_output_token_seconds_sum", None)] - 0.04) < 1e-9
    assert got[("vllm:time_per_output_token_seconds_bucket", "0.025")] == 2
    assert got[("pagedinfer_kv_events_dropped_total", None)] == 3

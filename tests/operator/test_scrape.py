"""Scraping pods' /metrics: the exporter's names, and pods that are down, slow or garbled."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
from operator_fakes import closed_port

from pagedinfer.operator.scrape import MetricsError, metrics_url, parse_kv_metrics, scrape

NOW = 1_700_000_000.0


def gauge(name: str, value: float, labels: str = "") -> str:
    return f"# TYPE {name} gauge\n{name}{labels} {value}\n"


def test_parses_the_opentelemetry_exporters_output() -> None:
    # The instruments of docs/architecture.md section 9, through the real exporter.
    script = textwrap.dedent(
        """
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from opentelemetry.metrics import Observation
        from opentelemetry.sdk.metrics import MeterProvider
        from prometheus_client import REGISTRY, generate_latest

        reader = PrometheusMetricReader()
        meter = MeterProvider(metric_readers=[reader]).get_meter("pagedinfer.service")
        for name, unit, value in [
            ("pagedinfer.kv_cache.blocks.total", "{block}", 1000),
            ("pagedinfer.kv_cache.blocks.free", "{block}", 250),
            ("pagedinfer.kv_cache.free_ratio", "1", 0.25),
            ("pagedinfer.kv_cache.blocks.demand", "{block}", 1500),
        ]:
            meter.create_observable_gauge(
                name, [lambda _, v=value: [Observation(v)]], unit=unit
            )
        print(generate_latest(REGISTRY).decode())
        """
    )
    text = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    sample = parse_kv_metrics(text, NOW)
    assert sample.free_ratio == 0.25
    assert (sample.blocks_total, sample.blocks_free, sample.blocks_demand) == (1000, 250, 1500)
    assert sample.utilization == 1.5
    assert sample.observed_at == NOW


@pytest.mark.parametrize(
    "suffix", ["", "_ratio", "_1", "_total", "_ratio_total"], ids=lambda s: s or "bare"
)
def test_accepts_unit_and_total_suffixes(suffix: str) -> None:
    text = gauge(f"pagedinfer_kv_cache_free_ratio{suffix}", 0.4) + gauge(
        f"pagedinfer_kv_cache_blocks_total{suffix}", 10
    )
    sample = parse_kv_metrics(text, NOW)
    assert (sample.free_ratio, sample.blocks_total) == (0.4, 10)


def test_unrelated_metrics_with_a_common_prefix_are_ignored() -> None:
    text = gauge("pagedinfer_kv_cache_free_ratio", 0.4) + gauge(
        "pagedinfer_kv_cache_free_ratio_by_tenant", 0.9
    )
    assert parse_kv_metrics(text, NOW).free_ratio == 0.4


def test_the_ratio_is_derived_from_blocks_when_not_exported() -> None:
    text = gauge("pagedinfer_kv_cache_blocks_total", 200) + gauge(
        "pagedinfer_kv_cache_blocks_free", 50
    )
    assert parse_kv_metrics(text, NOW).free_ratio == 0.25


def test_several_series_are_averaged_and_summed() -> None:
    text = (
        "# TYPE pagedinfer_kv_cache_free_ratio gauge\n"
        'pagedinfer_kv_cache_free_ratio{engine="0"} 0.2\n'
        'pagedinfer_kv_cache_free_ratio{engine="1"} 0.4\n'
        "# TYPE pagedinfer_kv_cache_blocks_total gauge\n"
        'pagedinfer_kv_cache_blocks_total{engine="0"} 100\n'
        'pagedinfer_kv_cache_blocks_total{engine="1"} 100\n'
    )
    sample = parse_kv_metrics(text, NOW)
    assert sample.free_ratio == pytest.approx(0.3)
    assert sample.blocks_total == 200


def test_a_sample_timestamp_is_its_age() -> None:
    text = "# TYPE pagedinfer_kv_cache_free_ratio gauge\npagedinfer_kv_cache_free_ratio 0.5 1699999000000\n"
    assert parse_kv_metrics(text, NOW).observed_at == 1_699_999_000.0


BAD = {
    "html": "<html><body>502 Bad Gateway</body></html>",
    "json": '{"free_ratio": 0.5}',
    "truncated": "pagedinfer_kv_cache_free_ratio{a=",
    "no KV gauges (model loading)": 'target_info{service_name="x"} 1\n',
    "empty": "",
    "NaN ratio": gauge("pagedinfer_kv_cache_free_ratio", "NaN"),
    "negative": gauge("pagedinfer_kv_cache_free_ratio", -0.1),
    "ratio above 1": gauge("pagedinfer_kv_cache_free_ratio", 1.5),
    "zero blocks without a ratio": gauge("pagedinfer_kv_cache_blocks_total", 0)
    + gauge("pagedinfer_kv_cache_blocks_free", 0),
}


@pytest.mark.parametrize("text", BAD.values(), ids=BAD.keys())
def test_garbage_is_an_error_not_a_sample(text: str) -> None:
    with pytest.raises(MetricsError):
        parse_kv_metrics(text, NOW)


def pod(ip: str | None, ports: list[dict]) -> dict:
    return {
        "spec": {"containers": [{"name": "sidecar"}, {"name": "server", "ports": ports}]},
        "status": {"podIP": ip} if ip else {},
    }


def test_the_url_uses_the_pods_ip_and_its_port_named_metrics() -> None:
    ports = [{"name": "grpc", "containerPort": 50051}, {"name": "metrics", "containerPort": 9999}]
    assert metrics_url(pod("10.0.0.7", ports)) == "http://10.0.0.7:9999/metrics"
    assert metrics_url(pod("fd00::7", ports)) == "http://[fd00::7]:9999/metrics"
    assert metrics_url(pod(None, ports)) is None
    assert metrics_url(pod("10.0.0.7", ports[:1])) is None


@pytest.mark.asyncio
async def test_scrapes_live_pods_and_reports_each_failure(fake_pods) -> None:
    ok = await fake_pods.start(free_ratio=0.2)
    slow = await fake_pods.start()
    slow.mode = "slow"
    garbage = await fake_pods.start()
    garbage.mode = "garbage"
    broken = await fake_pods.start()
    broken.mode = "error"
    loading = await fake_pods.start()
    loading.mode = "empty"
    targets = [
        ("ok", ok.url),
        ("slow", slow.url),
        ("garbage", garbage.url),
        ("broken", broken.url),
        ("loading", loading.url),
        ("down", f"http://127.0.0.1:{closed_port()}/metrics"),
    ]
    started = time.monotonic()
    result = await scrape(targets, timeout=0.5, clock=lambda: NOW)
    assert time.monotonic() - started < 2.0  # the slow pod did not hold the others up
    assert list(result.samples) == ["ok"]
    assert result.samples["ok"].free_ratio == 0.2
    assert result.samples["ok"].observed_at == NOW
    assert result.errors["slow"] == "timed out after 0.5s"
    assert "unparseable" in result.errors["garbage"]
    assert result.errors["broken"] == "HTTP 500"
    assert "no pagedinfer_kv_cache_free_ratio" in result.errors["loading"]
    assert "ClientConnectorError" in result.errors["down"]


@pytest.mark.asyncio
async def test_concurrency_is_bounded(fake_pods) -> None:
    pod = await fake_pods.start()
    result = await scrape([(f"p{i}", pod.url) for i in range(12)], timeout=5, concurrency=3)
    assert len(result.samples) == 12
    assert pod.max_in_flight == 3

"""Scraping the KV-cache gauges of inference pods from their Prometheus `/metrics`.

Each pod is read at its IP and the container port named `metrics` in its own spec, with
a timeout and a bound on concurrent requests; the text is parsed by prometheus_client.
A pod that is down, slow or answers garbage yields an error string, never an exception:
the autoscaler treats it as a pod without metrics.
"""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from pagedinfer.operator.autoscaler import Sample

PREFIX = "pagedinfer_kv_cache_"
GAUGES = ("free_ratio", "blocks_total", "blocks_free", "blocks_demand")
# The OpenTelemetry exporter may append a unit (`_ratio`, `_blocks`, `_1`) and, for
# counters, `_total` to the instrument's name; accept the base name with or without.
_NAME = re.compile(rf"^{PREFIX}({'|'.join(GAUGES)})(?:_ratio|_blocks?|_1)?(?:_total)?$")
MAX_BYTES = 1 << 20  # a pod's whole exposition is a few KiB
ACCEPT = "text/plain;version=0.0.4"


class MetricsError(ValueError):
    """The exposition lacks the KV-cache gauges or has nonsense in them."""


def parse_kv_metrics(text: str, scraped_at: float) -> Sample:
    """The KV-cache sample of one exposition. Series of one gauge with different labels
    are summed (blocks) or averaged (the ratio)."""
    values: dict[str, list[float]] = {}
    stamps: list[float] = []
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                match = _NAME.match(sample.name)
                if match:
                    values.setdefault(match.group(1), []).append(float(sample.value))
                    if sample.timestamp is not None:
                        stamps.append(float(sample.timestamp))
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsError(f"unparseable exposition: {exc}") from None
    for name, series in values.items():
        if not all(math.isfinite(v) and v >= 0 for v in series):
            raise MetricsError(f"{PREFIX}{name} is not a finite, non-negative number: {series}")
    total = sum(values.get("blocks_total", []))
    free = sum(values.get("blocks_free", []))
    if "free_ratio" in values:
        ratio = sum(values["free_ratio"]) / len(values["free_ratio"])
    elif "blocks_total" in values and "blocks_free" in values and total > 0:
        ratio = free / total
    else:
        raise MetricsError(f"no {PREFIX}free_ratio (the engine may still be loading)")
    if ratio > 1.0:
        raise MetricsError(f"{PREFIX}free_ratio {ratio} is above 1")
    demand = values.get("blocks_demand")
    return Sample(
        free_ratio=ratio,
        # An exposition with timestamps says how old its samples are; ours have none.
        observed_at=min(stamps) if stamps else scraped_at,
        blocks_total=total,
        blocks_free=free,
        blocks_demand=sum(demand) if demand else None,
    )


def metrics_url(pod: Mapping[str, Any]) -> str | None:
    """`http://<podIP>:<port named metrics>/metrics`, or None if the pod has neither."""
    ip = (pod.get("status") or {}).get("podIP")
    for container in (pod.get("spec") or {}).get("containers", []):
        for port in container.get("ports") or []:
            if port.get("name") == "metrics" and ip:
                host = f"[{ip}]" if ":" in ip else ip
                return f"http://{host}:{port['containerPort']}/metrics"
    return None


@dataclass
class ScrapeResult:
    samples: dict[str, Sample] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # pod name -> what went wrong


async def scrape(
    targets: Iterable[tuple[str, str]],
    *,
    timeout: float,
    concurrency: int = 16,
    clock: Callable[[], float] = time.time,
) -> ScrapeResult:
    """Read every `(pod name, url)` at once, at most `concurrency` at a time."""
    result = ScrapeResult()
    limit = asyncio.Semaphore(concurrency)

    async def one(session: aiohttp.ClientSession, pod: str, url: str) -> None:
        async with limit:
            try:
                async with asyncio.timeout(timeout):
                    async with session.get(url, headers={"Accept": ACCEPT}) as response:
                        if response.status != 200:
                            raise MetricsError(f"HTTP {response.status}")
                        body = await response.content.read(MAX_BYTES + 1)
                if len(body) > MAX_BYTES:
                    raise MetricsError(f"exposition larger than {MAX_BYTES} bytes")
                text = body.decode("utf-8", errors="replace")
                result.samples[pod] = parse_kv_metrics(text, clock())
            except TimeoutError:
                result.errors[pod] = f"timed out after {timeout:g}s"
            except MetricsError as exc:
                result.errors[pod] = str(exc)
            except aiohttp.ClientError as exc:
                result.errors[pod] = f"{type(exc).__name__}: {exc}"

    connector = aiohttp.TCPConnector(limit=concurrency, force_close=True)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(one(session, pod, url) for pod, url in targets))
    return result

"""Stand-ins for inference pods: real HTTP servers on 127.0.0.1 serving /metrics."""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web


class FakePod:
    """One pod's metrics endpoint; the test sets what it answers.

    mode: "ok" (the exposition below), "garbage", "error" (HTTP 500), "empty" (no KV
    gauges, as while the model loads), "slow" (answers after `delay` seconds).
    """

    def __init__(self, free_ratio: float = 0.5) -> None:
        self.free_ratio = free_ratio
        self.blocks_total = 1000
        self.demand: int | None = None
        self.mode = "ok"
        self.delay = 5.0
        self.hits = 0
        self.port = 0
        self.in_flight = 0
        self.max_in_flight = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def exposition(self) -> str:
        """What the OpenTelemetry Prometheus exporter writes for the engine's gauges."""
        free = round(self.blocks_total * self.free_ratio)
        demand = self.demand if self.demand is not None else self.blocks_total - free
        scope = 'otel_scope_name="pagedinfer.service",otel_scope_version=""'
        lines = []
        for name, value in [
            ("pagedinfer_kv_cache_blocks_total", self.blocks_total),
            ("pagedinfer_kv_cache_blocks_free", free),
            ("pagedinfer_kv_cache_free_ratio", self.free_ratio),
            ("pagedinfer_kv_cache_blocks_demand", demand),
        ]:
            lines += [f"# HELP {name} ", f"# TYPE {name} gauge", f"{name}{{{scope}}} {value}"]
        lines += ['target_info{service_name="pagedinfer"} 1.0']
        return "\n".join(lines) + "\n"

    async def handle(self, request: web.Request) -> web.Response:
        self.hits += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.mode == "slow":
                await asyncio.sleep(self.delay)
            elif self.mode == "ok":
                await asyncio.sleep(0.05)  # lets concurrent scrapes overlap
            if self.mode == "error":
                return web.Response(status=500, text="engine exploded")
            if self.mode == "garbage":
                return web.Response(text="<html><body>not metrics</body></html>")
            if self.mode == "empty":
                return web.Response(text='target_info{service_name="pagedinfer"} 1.0\n')
            return web.Response(text=self.exposition(), content_type="text/plain")
        finally:
            self.in_flight -= 1


class FakePods:
    def __init__(self) -> None:
        self._runners: list[web.AppRunner] = []

    async def start(self, free_ratio: float = 0.5) -> FakePod:
        pod = FakePod(free_ratio)
        app = web.Application()
        app.router.add_get("/metrics", pod.handle)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        pod.port = sock.getsockname()[1]
        await web.SockSite(runner, sock).start()
        self._runners.append(runner)
        return pod

    async def close(self) -> None:
        for runner in self._runners:
            await runner.cleanup()


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]

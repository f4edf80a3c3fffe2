"""Stand-ins for what a cluster would run: inference pods (real HTTP servers on 127.0.0.1
serving /metrics), the API server (kmock), and the kubelet (a loop writing Pods)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import socket
import time
from typing import Any

import kmock
from aiohttp import web

NAMESPACE = "ns1"  # where the end-to-end tests' operator watches


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
    """Starts FakePods; each listens on its own port of 127.0.0.1."""

    def __init__(self) -> None:
        self._runners: dict[int, web.AppRunner] = {}

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
        self._runners[pod.port] = runner
        return pod

    async def stop(self, pod: FakePod) -> None:
        """Take one pod's endpoint down: its port then refuses connections."""
        runner = self._runners.pop(pod.port, None)
        if runner is not None:
            await runner.cleanup()

    async def close(self) -> None:
        for runner in self._runners.values():
            await runner.cleanup()
        self._runners.clear()


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Cluster(kmock.KubernetesEmulator):
    """kmock's emulated API server, plus what a real one does and kmock leaves out:
    a new resourceVersion on every write (kopf tells its own changes apart by it),
    resourceVersion preconditions (409 Conflict), `metadata.generation` counting spec
    changes, generateName, watches that resume from a list's resourceVersion, and
    label selectors on lists."""

    _version = 1000

    async def _handle(self, request: kmock.Request) -> Any:
        writes = (kmock.action.CREATE, kmock.action.UPDATE)
        if request.resource is not None and request.action in writes:
            if isinstance(request.data, dict):
                self._stamp(request)
            elif isinstance(request.data, list):  # a JSON patch, as kopf sends for finalizers
                self._test_version(request)
                Cluster._version += 1
                version = str(Cluster._version)
                request.data.append(
                    {"op": "add", "path": "/metadata/resourceVersion", "value": version}
                )
        return await super()._handle(request)

    def _test_version(self, request: kmock.Request) -> None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return
        current = self.objects[key].raw.get("metadata", {}).get("resourceVersion")
        for op in request.data:
            tests_version = op.get("op") == "test" and op.get("path") == "/metadata/resourceVersion"
            if tests_version and op.get("value") != current:
                raise kmock.KubernetesError(
                    status=422, reason="Invalid", message="the test operation failed"
                )

    def _stamp(self, request: kmock.Request) -> None:
        meta = request.data.setdefault("metadata", {})
        name = request.name or meta.get("name")
        key = (request.resource, request.namespace or meta.get("namespace"), name)
        stored = None
        if key in self.objects and not self.objects[key].deleted:
            stored = self.objects[key].raw
        if request.action == kmock.action.UPDATE and stored is not None:
            old = stored.get("metadata", {})
            expected = meta.get("resourceVersion")
            if expected and expected != old.get("resourceVersion"):
                raise kmock.KubernetesError(
                    status=409, reason="Conflict", message="the object has been modified"
                )
            spec_changed = "spec" in request.data and {
                **(stored.get("spec") or {}),
                **request.data["spec"],
            } != stored.get("spec")
            if request.subresource is None and spec_changed:
                meta["generation"] = old.get("generation", 1) + 1
        elif request.action == kmock.action.CREATE:
            meta.setdefault("generation", 1)
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = f"{meta['generateName']}{Cluster._version:x}"
        Cluster._version += 1
        meta["resourceVersion"] = str(Cluster._version)

    async def _serve_watch(self, request: kmock.Request) -> Any:
        # kmock replays every object as ADDED on each watch, then streams what it sees
        # after subscribing. A watch from a list's resourceVersion must instead get what
        # changed since that version and nothing older, and must not miss a write that
        # lands between the snapshot and the subscription.
        yield b""
        since = int((request.params or {}).get("resourceVersion") or 0)
        bus = self._buses[request.resource]
        async with self._lock:
            mark = await bus.mark()
            snapshot = [
                {"type": "ADDED" if not since else "MODIFIED", "object": obj.raw}
                for (resource, namespace, _), obj in self.objects.items()
                if resource == request.resource
                and not obj.deleted
                and request.namespace in (None, namespace)
                and int(obj.raw.get("metadata", {}).get("resourceVersion") or 0) > since
            ]
        for event in snapshot:
            yield event
        async for event in bus.stream(since=mark):
            namespace = event.get("object", {}).get("metadata", {}).get("namespace")
            if request.namespace in (None, namespace):
                yield event

    async def _serve_list(self, request: kmock.Request) -> Any:
        result = await super()._serve_list(request)
        result["metadata"]["resourceVersion"] = str(Cluster._version)
        selector = (request.params or {}).get("labelSelector")
        if selector:
            wanted = dict(term.split("=", 1) for term in selector.split(","))
            result["items"] = [
                obj
                for obj in result["items"]
                if wanted.items() <= ((obj.get("metadata") or {}).get("labels") or {}).items()
            ]
        return result


def rfc3339(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class Kubelet:
    """Plays the Deployment controller and the kubelet in one namespace.

    Keeps as many Pod objects as each Deployment wants, each Ready at 127.0.0.1 with its
    own FakePod serving /metrics on the port its spec names `metrics`, and writes each
    Deployment's status. Everything goes through the API, so watchers see it.
    """

    def __init__(self, api: kmock.KubernetesEmulator, fakes: FakePods, namespace: str) -> None:
        self.api = api
        self.fakes = fakes
        self.namespace = namespace
        self.free_ratio = 0.5
        self.pods: dict[str, FakePod] = {}
        self._task: asyncio.Task | None = None

    def set_free_ratio(self, free_ratio: float) -> None:
        self.free_ratio = free_ratio
        for pod in self.pods.values():
            pod.free_ratio = free_ratio

    def set_mode(self, mode: str) -> None:
        for pod in self.pods.values():
            pod.mode = mode

    async def _json(self, method: str, path: str, body: Any = None) -> Any:
        response = await self.api.request(method, path, json=body)
        return await response.json()

    async def _sync(self) -> None:
        base = f"/apis/apps/v1/namespaces/{self.namespace}/deployments"
        pods_path = f"/api/v1/namespaces/{self.namespace}/pods"
        for deployment in (await self._json("GET", base)).get("items", []):
            name = deployment["metadata"]["name"]
            want = deployment["spec"].get("replicas", 1)
            labels = deployment["spec"]["template"]["metadata"]["labels"]
            mine = sorted(
                (p for p in self.pods if p.rsplit("-", 1)[0] == name),
                key=lambda p: int(p.rsplit("-", 1)[1]),
            )
            for pod_name in mine[want:]:
                await self.api.request("DELETE", f"{pods_path}/{pod_name}")
                await self.fakes.stop(self.pods.pop(pod_name))
            for i in range(len(mine), want):
                fake = await self.fakes.start(self.free_ratio)
                pod_name = f"{name}-{max([int(p.rsplit('-', 1)[1]) for p in mine] + [i - 1]) + 1}"
                mine.append(pod_name)
                self.pods[pod_name] = fake
                await self._json("POST", pods_path, self._pod(pod_name, labels, fake))
            status = {
                "observedGeneration": deployment["metadata"].get("generation", 1),
                "replicas": want,
                "readyReplicas": want,
                "updatedReplicas": want,
                "availableReplicas": want,
            }
            if deployment.get("status") != status:
                await self._json("PATCH", f"{base}/{name}/status", {"status": status})

    def _pod(self, name: str, labels: dict, fake: FakePod) -> dict:
        ports = [
            {"name": "grpc", "containerPort": 50051},
            {"name": "metrics", "containerPort": fake.port},
        ]
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": labels,
                "resourceVersion": "1",
            },
            "spec": {"containers": [{"name": "server", "image": "x", "ports": ports}]},
            "status": {
                "phase": "Running",
                "podIP": "127.0.0.1",
                "conditions": [
                    {"type": "Ready", "status": "True", "lastTransitionTime": rfc3339(time.time())}
                ],
            },
        }

    async def _loop(self) -> None:
        while True:
            await self._sync()
            await asyncio.sleep(0.1)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

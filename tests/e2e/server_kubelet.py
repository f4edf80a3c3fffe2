"""The rest of a cluster, for the end-to-end test: a kubelet that runs real
`pagedinfer serve` processes as the operator's pods, and a gRPC load generator.

The kubelet watches the Deployments in its namespace (through the emulated API, as
the real Deployment controller and kubelet do) and keeps one server process per
wanted replica. Each runs the command and arguments of the Deployment's pod template,
with its ports moved to free ones on 127.0.0.1; its Pod object names them (so the
operator scrapes each process at the port named `metrics` in that pod's own spec), and
its Ready condition follows the container's readiness probe (an HTTP GET of /health on
the port named http). A replica that goes leaves the ready set first, as a deleted pod
leaves the endpoints, then gets its preStop sleep, then SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import os
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from operator_fakes import rfc3339
from test_server import Server, free_ports, stop_server

from pagedinfer.service.proto import inference_pb2 as pb


@dataclass
class Replica:
    """One pod: its Pod object's name and the server process behind it."""

    name: str
    server: Server
    probe_url: str  # the readiness probe's, on this process's port
    pre_stop_s: float  # the preStop hook's sleep
    ready: bool = False
    started_at: float = field(default_factory=time.monotonic)
    ready_at: float | None = None


class ServerKubelet:
    """Plays the Deployment controller and the kubelet for one namespace."""

    def __init__(self, api: Any, namespace: str, workdir: Path, probe_period: float = 0.5):
        self.api = api
        self.namespace = namespace
        self.workdir = workdir
        self.probe_period = probe_period
        self.replicas: dict[str, Replica] = {}
        self.ready: tuple[Replica, ...] = ()  # replaced whole: read by the load's threads
        self.exits: dict[str, int] = {}  # replica -> exit code, for the ones stopped
        self.errors: list[str] = []
        self._indices = itertools.count()
        self._task: asyncio.Task | None = None

    # -- the API ----------------------------------------------------------------------

    async def _json(self, method: str, path: str, body: Any = None) -> Any:
        response = await self.api.request(method, path, json=body)
        return await response.json()

    @property
    def _pods(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods"

    # -- one reconciliation -------------------------------------------------------------

    async def _sync(self) -> None:
        base = f"/apis/apps/v1/namespaces/{self.namespace}/deployments"
        for deployment in (await self._json("GET", base)).get("items", []):
            name = deployment["metadata"]["name"]
            want = deployment["spec"].get("replicas", 1)
            mine = [r for r in self.replicas.values() if r.name.rsplit("-", 1)[0] == name]
            for replica in mine[want:]:  # the newest go first
                await self._stop(replica)
            for _ in range(len(mine), want):
                await self._start(deployment)
            mine = [r for r in self.replicas.values() if r.name.rsplit("-", 1)[0] == name]
            await asyncio.gather(*(self._probe(r) for r in mine))
            ready = sum(r.ready for r in mine)
            status = {
                "observedGeneration": deployment["metadata"].get("generation", 1),
                "replicas": len(mine),
                "readyReplicas": ready,
                "updatedReplicas": len(mine),
                "availableReplicas": ready,
            }
            if deployment.get("status") != status:
                await self._json("PATCH", f"{base}/{name}/status", {"status": status})
        self.ready = tuple(r for r in self.replicas.values() if r.ready)

    async def _start(self, deployment: dict) -> None:
        """Runs the pod template's container as a process, and writes its Pod object."""
        template = copy.deepcopy(deployment["spec"]["template"])
        (container,) = template["spec"]["containers"]
        assert container["command"] == ["pagedinfer"], container["command"]
        name = f"{deployment['metadata']['name']}-{next(self._indices)}"
        ports = dict(zip(("http", "grpc", "metrics"), free_ports(3), strict=True))
        for port in container["ports"]:
            port["containerPort"] = ports[port["name"]]
        probe = container["readinessProbe"]["httpGet"]
        assert probe["scheme"] == "HTTP", probe
        probe_url = f"http://127.0.0.1:{ports[probe['port']]}{probe['path']}"
        sleep, seconds = container["lifecycle"]["preStop"]["exec"]["command"]
        assert sleep == "sleep", container["lifecycle"]
        directory = self.workdir / name
        directory.mkdir()
        args = [sys.executable, "-m", "pagedinfer.service.cli", *container["args"],
                "--host", "127.0.0.1", "--port", str(ports["grpc"]),
                "--http-port", str(ports["http"]),
                "--metrics-port", str(ports["metrics"])]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
        env.pop("PAGEDINFER_AUTH_TOKEN", None)
        log = directory / "server.log"
        with open(log, "wb") as log_file:
            process = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT,
                                       cwd=directory, env=env)  # fmt: skip
        channel = grpc.insecure_channel(f"127.0.0.1:{ports['grpc']}")
        server = Server(process, ports["grpc"], ports["metrics"], log, channel,
                        http_port=ports["http"])  # fmt: skip
        self.replicas[name] = Replica(name, server, probe_url, float(seconds))
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": template["metadata"]["labels"],
                "resourceVersion": "1",
            },
            "spec": template["spec"],
            "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": [
                {"type": "Ready", "status": "False", "lastTransitionTime": rfc3339(time.time())}
            ]},
        }  # fmt: skip
        await self._json("POST", self._pods, pod)

    async def _probe(self, replica: Replica) -> None:
        """The readiness probe: 200 from GET /health means Ready."""
        ready = await asyncio.to_thread(answers_200, replica.probe_url)
        if ready == replica.ready:
            return
        if replica.server.process.poll() is not None:
            self.errors.append(f"{replica.name} exited with {replica.server.process.returncode}")
        replica.ready = ready
        replica.ready_at = time.monotonic() if ready else None
        condition = {
            "type": "Ready",
            "status": str(ready),
            "lastTransitionTime": rfc3339(time.time()),
        }
        await self._json("PATCH", f"{self._pods}/{replica.name}/status",
                         {"status": {"conditions": [condition]}})  # fmt: skip

    async def _stop(self, replica: Replica) -> None:
        """Deletes the Pod (it leaves the endpoints), runs its preStop sleep, then stops
        the process with SIGTERM, as Kubernetes does."""
        del self.replicas[replica.name]
        self.ready = tuple(r for r in self.ready if r is not replica)
        await self.api.request("DELETE", f"{self._pods}/{replica.name}")
        await asyncio.sleep(replica.pre_stop_s)
        self.exits[replica.name] = await asyncio.to_thread(stop_server, replica.server)

    # -- lifecycle --------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            try:
                await self._sync()
            except Exception as exc:  # noted, and the loop goes on like a kubelet would
                self.errors.append(f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(self.probe_period)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for replica in list(self.replicas.values()):
            await asyncio.to_thread(stop_server, replica.server, 30)
        self.replicas.clear()


def answers_200(url: str) -> bool:
    """An HTTP probe: 2xx/3xx pass, as the kubelet counts; so 200 from /health."""
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return 200 <= response.status < 400
    except (urllib.error.URLError, OSError):  # 503 (loading, draining) or no answer yet
        return False


@dataclass
class Outcome:
    replica: str
    started_at: float
    code: str  # "OK" or the gRPC status code's name
    finish_reason: int = 0
    completion_tokens: int = 0


class LoadGenerator:
    """`workers` threads, each sending one request after another, round robin over the
    replicas that are ready at the time of each request."""

    def __init__(self, targets: Callable[[], tuple[Replica, ...]], workers: int,
                 prompt_tokens: int, max_tokens: int) -> None:  # fmt: skip
        self.targets = targets
        self.workers = workers
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.outcomes: list[Outcome] = []
        self._turn = itertools.count()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for i in range(self.workers):
            thread = threading.Thread(target=self._work, args=(i,), name=f"load-{i}")
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        """Sends no new request; waits for those in flight to finish."""
        self._stop.set()
        for thread in self._threads:
            thread.join()

    def _work(self, worker: int) -> None:
        rng = random.Random(worker)
        while not self._stop.is_set():
            started_at = time.monotonic()
            targets = self.targets()
            if not targets:
                time.sleep(0.1)
                continue
            replica = targets[next(self._turn) % len(targets)]
            # Distinct prompts: every request needs blocks of its own (no prefix hits).
            prompt = [rng.randrange(1000, 20000) for _ in range(self.prompt_tokens)]
            request = pb.GenerateRequest(
                prompt_token_ids=prompt,
                sampling=pb.SamplingParams(max_tokens=self.max_tokens, temperature=0.0,
                                           ignore_eos=True),
            )  # fmt: skip
            try:
                *_, last = replica.server.stub.Generate(request, timeout=120)
            except grpc.RpcError as exc:
                self.outcomes.append(Outcome(replica.name, started_at, exc.code().name))
            else:
                self.outcomes.append(Outcome(replica.name, started_at, "OK", last.finish_reason,
                                             last.usage.completion_tokens))  # fmt: skip

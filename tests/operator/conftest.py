"""Fixtures of the operator tests: stand-in pods, an emulated API server, the operator."""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import AsyncIterator

import kmock
import pytest
import pytest_asyncio
from operator_fakes import NAMESPACE, Cluster, FakePods, Kubelet

from pagedinfer.operator.spec import GROUP, KIND, PLURAL, VERSION


@pytest_asyncio.fixture
async def fake_pods() -> AsyncIterator[FakePods]:
    pods = FakePods()
    yield pods
    await pods.close()


@pytest.fixture
def kmock_options(kmock_options: dict) -> dict:
    return {**kmock_options, "cls": Cluster}


@pytest.fixture
def cluster(kmock: kmock.KubernetesEmulator, tmp_path, monkeypatch) -> kmock.KubernetesEmulator:
    """The emulated API server, with our CRD's resource, and a kubeconfig pointing at it
    that both kopf and the operator's own client read."""
    kmock.resources.load_bundled()
    kmock.resources[f"{GROUP}/{VERSION}/{PLURAL}"] = kmock.ResourceInfo(
        kind=KIND,
        singular="inferenceservice",
        namespaced=True,
        verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
        shortnames={"pisvc"},
        subresources={"status", "scale"},
    )
    config = tmp_path / "kubeconfig"
    config.write_text(
        f"""
        apiVersion: v1
        kind: Config
        current-context: emulated
        clusters: [{{name: emulated, cluster: {{server: "{kmock.url}"}}}}]
        contexts: [{{name: emulated, context: {{cluster: emulated, user: nobody}}}}]
        users: [{{name: nobody, user: {{}}}}]
        """
    )
    monkeypatch.setenv("KUBECONFIG", str(config))
    return kmock


@pytest_asyncio.fixture
async def kubelet(cluster, fake_pods) -> AsyncIterator[Kubelet]:
    kubelet = Kubelet(cluster, fake_pods, NAMESPACE)
    kubelet.start()
    yield kubelet
    await kubelet.stop()


@pytest_asyncio.fixture
async def operator(cluster) -> AsyncIterator[threading.Thread]:
    """`pagedinfer operator --namespace ns1 --standalone`, in a thread of its own.

    kopf treats every task of its event loop that it did not start as hung when it
    stops, so it gets a loop of its own, away from the test's and the emulator's.
    """
    import kopf

    import pagedinfer.operator.handlers  # noqa: F401  (registers the handlers)
    from pagedinfer.operator import main

    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    args = parser.parse_args(["--namespace", NAMESPACE, "--standalone"])
    kwargs = main.kopf_kwargs(args)
    kwargs["settings"].scanning.disabled = True  # no CRD or namespace discovery
    kwargs["memo"].options.retry_delay = 0.5
    stop, ready = threading.Event(), threading.Event()
    failures: list[BaseException] = []

    def run() -> None:
        try:
            asyncio.run(kopf.operator(stop_flag=stop, ready_flag=ready, **kwargs))
        except BaseException as exc:
            failures.append(exc)

    thread = threading.Thread(target=run, name="operator", daemon=True)
    thread.start()
    assert await asyncio.to_thread(ready.wait, 10), "the operator did not start"
    yield thread
    stop.set()
    await asyncio.to_thread(thread.join, 20)
    assert not thread.is_alive(), "the operator did not stop"
    assert not failures, failures

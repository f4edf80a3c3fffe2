"""Fixtures of the operator tests: stand-in pods, an emulated API server, the operator."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator

import kmock
import pytest
import pytest_asyncio
from operator_fakes import Cluster, FakePods, Kubelet

from pagedinfer.operator.spec import GROUP, KIND, PLURAL, VERSION

NAMESPACE = "ns1"


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
async def operator(cluster) -> AsyncIterator[asyncio.Task]:
    """`pagedinfer operator --namespace ns1 --standalone`, in this event loop."""
    import kopf

    import pagedinfer.operator.handlers  # noqa: F401  (registers the handlers)
    from pagedinfer.operator import main

    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    args = parser.parse_args(["--namespace", NAMESPACE, "--standalone"])
    kwargs = main.kopf_kwargs(args)
    kwargs["settings"].scanning.disabled = True  # no CRD or namespace discovery
    kwargs["memo"].options.retry_delay = 0.5
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(kopf.operator(stop_flag=stop, ready_flag=ready, **kwargs))
    await asyncio.wait_for(ready.wait(), 10)
    yield task
    stop.set()
    with contextlib.suppress(asyncio.CancelledError):  # kopf's way of finishing
        await asyncio.wait_for(task, 20)

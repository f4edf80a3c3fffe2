"""The status the controller writes after a reconcile must not undo a newer one.

A fake API keeps objects in memory and plays the kubelet and the operator's Deployment
event handler at the worst moment: after the reconcile wrote the Deployment, before it
writes the InferenceService's status.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest

from pagedinfer.operator.controller import Controller, Options
from pagedinfer.operator.spec import GROUP, KIND, VERSION

pytestmark = pytest.mark.asyncio

NS, NAME = "ns", "llm"
LOG = logging.getLogger("test")


class MemoryKube:
    """get/create/apply/patch over a dict, with resourceVersions; `after_create` runs
    after each object is stored."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.version = 0
        self.after_create = None

    def _store(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.version += 1
        meta = obj["metadata"]
        meta["resourceVersion"] = str(self.version)
        meta.setdefault("generation", 1)
        self.objects[obj["kind"], meta["namespace"], meta["name"]] = obj
        return copy.deepcopy(obj)

    async def get(self, api_version: str, kind: str, ns: str, name: str) -> dict | None:
        return copy.deepcopy(self.objects.get((kind, ns, name)))

    async def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        stored = self._store(copy.deepcopy(obj))
        if self.after_create is not None:
            await self.after_create(stored)
        return stored

    async def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        return self._store(copy.deepcopy(obj))

    async def patch(self, api_version, kind, ns, name, patch, subresource=None) -> dict:
        obj = self.objects[kind, ns, name]
        wanted = patch.get("metadata", {}).get("resourceVersion")
        assert wanted in (None, obj["metadata"]["resourceVersion"]), "no conflicts here"
        obj.setdefault("status", {}).update(patch.get("status", {}))
        return self._store(obj)


def condition(kube: MemoryKube, type_: str) -> dict:
    status = kube.objects[KIND, NS, NAME].get("status") or {}
    return next(c for c in status.get("conditions", []) if c["type"] == type_)


async def test_a_deployment_reported_ready_during_the_reconcile_stays_ready() -> None:
    kube = MemoryKube()
    controller = Controller(kube, Options(default_image="pagedinfer:test"))
    body = kube._store(
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": KIND,
            "metadata": {"name": NAME, "namespace": NS, "uid": "uid-llm"},
            "spec": {"replicas": 2, "model": {"name": "smol"}},
        }
    )

    async def kubelet_then_event(created: dict) -> None:
        if created["kind"] != "Deployment":
            return
        # The kubelet reports both replicas ready, and the event handler writes it.
        deployment = kube.objects["Deployment", NS, NAME]
        deployment["status"] = {
            "observedGeneration": 1,
            "replicas": 2,
            "readyReplicas": 2,
            "updatedReplicas": 2,
            "availableReplicas": 2,
        }
        await controller.on_child_event("MODIFIED", copy.deepcopy(deployment), LOG)
        assert condition(kube, "DeploymentReady")["status"] == "True"

    kube.after_create = kubelet_then_event
    await controller.reconcile(body, LOG)
    # The reconcile's own status write comes last: it must see the ready Deployment.
    assert condition(kube, "DeploymentReady")["status"] == "True"
    assert kube.objects[KIND, NS, NAME]["status"]["readyReplicas"] == 2

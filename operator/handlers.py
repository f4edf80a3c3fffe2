"""The kopf handlers of the operator: they register, and delegate to the controller.

Importing this module registers them in kopf's default registry; main.py runs kopf.
The controller (API client and options) is built at startup and kept in kopf's memo.
"""

from __future__ import annotations

from typing import Any

import kopf

from pagedinfer.operator.controller import Controller
from pagedinfer.operator.kube import Kube
from pagedinfer.operator.resources import MANAGED_BY
from pagedinfer.operator.spec import GROUP, PLURAL, VERSION

OURS = {"app.kubernetes.io/managed-by": MANAGED_BY}


@kopf.on.startup()
async def connect(memo: kopf.Memo, **_: Any) -> None:
    memo.controller = Controller(await Kube.connect(), memo.options)


@kopf.on.login()
async def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    return kopf.ConnectionInfo(**await memo.controller.kube.credentials())


@kopf.on.cleanup()
async def disconnect(memo: kopf.Memo, **_: Any) -> None:
    await memo.controller.close()


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL)
async def reconcile(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    await memo.controller.reconcile(body, logger)


@kopf.on.event("apps", "v1", "deployments", labels=OURS)
@kopf.on.event("", "v1", "services", labels=OURS)
async def child_changed(
    type: str | None, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    await memo.controller.on_child_event(type, body, logger)


def _autoscaled(spec: kopf.Spec, **_: Any) -> bool:
    return spec.get("autoscaling") is not None


# Only autoscaled InferenceServices run a daemon, and only they get kopf's finalizer
# (which lets kopf stop the daemon before the object goes).
@kopf.daemon(GROUP, VERSION, PLURAL, when=_autoscaled, cancellation_timeout=10)
async def autoscale(
    stopped: kopf.DaemonStopped, body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    await memo.controller.autoscale(stopped, body, logger)

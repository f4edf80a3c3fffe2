"""What the operator does for one InferenceService: reconcile its children, keep its
status current, and run its autoscaler. The kopf handlers (handlers.py) only call in here.

Side effects live here, between the API (kube.py), the scraper (scrape.py) and the pure
decisions (resources.py, autoscaler.py, status.py). Kubernetes API errors surface as
kopf.TemporaryError so that kopf retries the handler; the autoscaler loop logs them
and tries again on its next period.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from pagedinfer.operator import status as st
from pagedinfer.operator.autoscaler import History, PodState, Recommendation, decide, warm_pods
from pagedinfer.operator.kube import ApiException, Kube
from pagedinfer.operator.resources import (
    build_deployment,
    build_service,
    deployment_replicas,
    selector_labels,
)
from pagedinfer.operator.scrape import metrics_url, scrape
from pagedinfer.operator.spec import (
    API_VERSION,
    KIND,
    AutoscalingSpec,
    parse_spec,
    validation_errors,
)

Body = Mapping[str, Any]


@dataclass
class Options:
    default_image: str
    scrape_concurrency: int = 16
    retry_delay: float = 5.0  # before kopf retries a handler that hit an API error
    clock: Callable[[], float] = time.time


def pod_state(pod: Body) -> PodState:
    """The autoscaler's view of a Pod object."""
    ready = next(
        (c for c in (pod.get("status") or {}).get("conditions") or [] if c.get("type") == "Ready"),
        {},
    )
    is_ready = ready.get("status") == "True"
    since = st.parse_rfc3339(ready.get("lastTransitionTime")) if is_ready else None
    return PodState(pod["metadata"]["name"], is_ready, since)


def is_live(pod: Body) -> bool:
    """Neither terminating nor finished: a pod that serves or will serve."""
    phase = (pod.get("status") or {}).get("phase", "Pending")
    return not pod["metadata"].get("deletionTimestamp") and phase in ("Pending", "Running")


def owner_name(child: Body) -> str | None:
    for ref in child.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("apiVersion") == API_VERSION:
            return ref.get("name")
    return None


def _memory(policy: AutoscalingSpec) -> float:
    """How far back the stabilisation windows and rate limits look."""
    return max(
        policy.scale_up.stabilization_window_s,
        policy.scale_down.stabilization_window_s,
        policy.scale_up.period_s,
        policy.scale_down.period_s,
    )


# How often an autoscaler between periods checks whether it should stop.
STOP_CHECK_S = 0.2


@dataclass
class Controller:
    kube: Kube
    options: Options
    _locks: dict[tuple[str, str], asyncio.Lock] = field(
        default_factory=lambda: defaultdict(asyncio.Lock)
    )
    closed: bool = False  # the operator is exiting: daemons kopf still starts must not run

    async def close(self) -> None:
        self.closed = True
        await self.kube.close()

    # -- reconciliation ---------------------------------------------------------------

    async def reconcile(self, body: Body, logger: logging.Logger | logging.LoggerAdapter) -> None:
        """Create or update the Deployment and the Service; refresh the status."""
        try:
            await self._reconcile(body, logger)
        except ApiException as exc:
            raise kopf.TemporaryError(
                f"Kubernetes API: {exc.status} {exc.reason}", delay=self.options.retry_delay
            ) from exc

    async def _reconcile(self, body: Body, logger: logging.Logger | logging.LoggerAdapter) -> None:
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        errors = validation_errors(body)
        if errors:
            message = "; ".join(errors)
            kopf.warn(dict(body), reason="InvalidSpec", message=message)
            await self.update_status(
                ns, name, lambda b: st.deployment_status(b, None, self._now(), errors)
            )
            raise kopf.PermanentError(f"invalid spec: {message}")

        spec = parse_spec(body.get("spec") or {})
        existing = await self.kube.get("apps/v1", "Deployment", ns, name)
        current = None if existing is None else existing.get("spec", {}).get("replicas")
        replicas = deployment_replicas(spec, current)
        await self._ensure(
            build_deployment(body, replicas, self.options.default_image), existing, logger
        )
        service = build_service(body)
        await self._ensure(service, await self.kube.get("v1", "Service", ns, name), logger)

        async def compute(fresh: Body) -> dict[str, Any]:
            # The Deployment as it is now, read under the status lock: the one written
            # above may be stale already (the kubelet may have reported its replicas, and
            # the event handler carried that into our status), and writing from it would
            # undo that with nothing left to redo it.
            latest = await self.kube.get("apps/v1", "Deployment", ns, name)
            now = self._now()
            update = st.deployment_status(fresh, latest, now)
            if spec.autoscaling is None:
                update.update(st.static_scaling_status(update, now))
            return update

        await self.update_status(ns, name, compute)

    async def _ensure(
        self,
        obj: dict[str, Any],
        existing: Body | None,
        logger: logging.Logger | logging.LoggerAdapter,
    ) -> dict[str, Any]:
        kind, name = obj["kind"], obj["metadata"]["name"]
        if existing is None:
            logger.info(f"creating {kind} {name}")
            return await self.kube.create(obj)
        return await self.kube.apply(obj)

    async def on_child_event(
        self, event_type: str | None, child: Body, logger: logging.Logger | logging.LoggerAdapter
    ) -> None:
        """A Deployment or Service of ours changed: put it back if it was deleted, or
        carry the Deployment's progress into the owner's status."""
        owner = owner_name(child)
        if owner is None:
            return
        ns = child["metadata"]["namespace"]
        try:
            if event_type == "DELETED":
                body = await self.kube.get(API_VERSION, KIND, ns, owner)
                if body is None or body["metadata"].get("deletionTimestamp"):
                    return  # the owner is going too: the garbage collector's doing
                logger.info(
                    f"{child['kind']} {ns}/{child['metadata']['name']} was deleted: recreating"
                )
                await self.reconcile(body, logger)
            elif child.get("kind") == "Deployment":
                await self.update_status(
                    ns, owner, lambda b: st.deployment_status(b, child, self._now())
                )
        except (ApiException, kopf.TemporaryError) as exc:
            # Event handlers are not retried; the next event or resume repairs it.
            logger.warning(f"could not follow {child['kind']} event {event_type}: {exc}")

    async def update_status(
        self,
        ns: str,
        name: str,
        compute: Callable[[Body], Mapping[str, Any] | Awaitable[Mapping[str, Any]]],
    ) -> None:
        """Write `compute(fresh body)` into the status, if it changes anything.

        One writer per object at a time in this process, and the object's resourceVersion
        as a precondition against other writers: on a conflict, read and compute again.
        `compute` may be a coroutine function, to read what it needs under the lock.
        """
        async with self._locks[ns, name]:
            for attempt in range(3):
                body = await self.kube.get(API_VERSION, KIND, ns, name)
                if body is None:
                    return
                computed = compute(body)
                if inspect.isawaitable(computed):
                    computed = await computed
                update = dict(computed)
                if not st.changed(body.get("status") or {}, update):
                    return
                patch: dict[str, Any] = {"status": update}
                if body["metadata"].get("resourceVersion"):
                    patch["metadata"] = {"resourceVersion": body["metadata"]["resourceVersion"]}
                try:
                    await self.kube.patch(API_VERSION, KIND, ns, name, patch, subresource="status")
                    return
                except ApiException as exc:
                    if exc.status != 409 or attempt == 2:
                        raise

    # -- autoscaling ------------------------------------------------------------------

    async def autoscale(
        self, stopped: Any, body: Body, logger: logging.Logger | logging.LoggerAdapter
    ) -> None:
        """The autoscaler of one InferenceService, until kopf stops it. `body` is kopf's
        live view of the object, so spec changes apply from the next period on."""
        ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
        history: History | None = None
        while not stopped and not self.closed:
            policy = parse_spec(body.get("spec") or {}).autoscaling
            if policy is None:
                return
            try:
                history = await self.autoscale_once(ns, name, policy, history, logger)
            except ApiException as exc:
                logger.warning(f"autoscaler: Kubernetes API {exc.status} {exc.reason}; retrying")
            except Exception:
                logger.exception("autoscaler: unexpected error; retrying next period")
            await self._until_next_period(stopped, policy.sync_period_s)

    async def _until_next_period(self, stopped: Any, seconds: float) -> None:
        """Sleep `seconds`, or less once kopf stops the daemon or the operator closes.

        Not kopf's `stopped.wait(seconds)`: that waits in a task of its own, and when the
        operator exits, kopf re-raises the exception of every task that ends in its last
        few seconds. The waiter of a daemon that kopf starts after it has stopped the
        others (this loop then ends through `closed`) can time out there, and the
        operator then exits with TimeoutError.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while not stopped and not self.closed:
            left = deadline - loop.time()
            if left <= 0:
                return
            await asyncio.sleep(min(left, STOP_CHECK_S))

    async def autoscale_once(
        self,
        ns: str,
        name: str,
        policy: AutoscalingSpec,
        history: History | None,
        logger: logging.Logger | logging.LoggerAdapter,
    ) -> History | None:
        """One sync period: scrape, decide, scale, report. Returns the history to keep."""
        body = await self.kube.get(API_VERSION, KIND, ns, name)
        deployment = await self.kube.get("apps/v1", "Deployment", ns, name)
        if body is None or deployment is None or validation_errors(body):
            return history  # nothing to scale (yet), or a spec the reconciler refused
        current = int(deployment.get("spec", {}).get("replicas", 1))
        now = self._now()
        if history is None:
            # After a start or restart, act as if the current count was just recommended:
            # no scale-down before a full window of evidence.
            status = body.get("status") or {}
            history = History((Recommendation(now, current),), st.history_events(status))

        pods = [p for p in await self.kube.list_pods(ns, selector_labels(name)) if is_live(p)]
        states = [pod_state(p) for p in pods]
        warm = {p.name for p in warm_pods(policy, states, now)}
        targets, errors = [], {}
        for pod in pods:
            pod_name = pod["metadata"]["name"]
            if pod_name in warm:
                url = metrics_url(pod)
                if url is None:
                    errors[pod_name] = "no pod IP or no container port named metrics"
                else:
                    targets.append((pod_name, url))
        result = await scrape(
            targets,
            timeout=policy.scrape_timeout_s,
            concurrency=self.options.scrape_concurrency,
            clock=self.options.clock,
        )
        errors.update(result.errors)
        decision = decide(policy, current, states, result.samples, history, now)

        if decision.desired != current:
            patch = {"spec": {"replicas": decision.desired}}
            await self.kube.patch("apps/v1", "Deployment", ns, name, patch)
            up = decision.desired > current
            reason = "ScaledUp" if up else "ScaledDown"
            kopf.event(dict(body), type="Normal", reason=reason, message=decision.message)
            logger.info(f"{reason}: {decision.message}")
        elif errors:
            logger.info(f"autoscaler: {decision.message}; metrics missing: {errors}")
        await self.update_status(
            ns,
            name,
            lambda b: st.autoscaling_status(b.get("status") or {}, decision, current, errors, now),
        )
        return history.record(decision, current, now, keep_s=_memory(policy))

    def _now(self) -> float:
        return self.options.clock()

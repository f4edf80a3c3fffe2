"""The autoscaler daemon's loop: a sync each period, and an end as soon as kopf stops it
or the operator closes, with no task of its own left behind.

kopf re-raises, when the operator exits, the exception of every task that ends in its
last few seconds; a waiter task that timed out there made the operator exit with
TimeoutError. So the wait between periods must not be such a task.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import pytest

from pagedinfer.operator.controller import STOP_CHECK_S, Controller, Options

pytestmark = pytest.mark.asyncio

LOG = logging.getLogger("test")
PERIOD = 0.3
BODY = {
    "metadata": {"namespace": "ns", "name": "llm"},
    "spec": {"autoscaling": {"maxReplicas": 3, "syncPeriodSeconds": PERIOD}},
}


class Stopped:
    """kopf's `stopped` flag as the daemon reads it: false until kopf stops the daemon."""

    def __init__(self) -> None:
        self.is_set = False

    def __bool__(self) -> bool:
        return self.is_set

    def wait(self, timeout: float) -> None:
        raise AssertionError("kopf's time-limited wait runs in a task of its own")


class ClosingKube:
    """The API client, as far as `Controller.close` uses it."""

    async def close(self) -> None:
        pass


def controller_counting_syncs() -> tuple[Controller, list[float]]:
    controller = Controller(kube=ClosingKube(), options=Options(default_image="pagedinfer:test"))
    syncs: list[float] = []

    async def autoscale_once(ns, name, policy, history, logger):
        syncs.append(asyncio.get_running_loop().time())
        return history

    controller.autoscale_once = autoscale_once
    return controller, syncs


@pytest.mark.parametrize("how", ["kopf stops the daemon", "the operator closes"])
async def test_syncs_each_period_and_ends_promptly(how: str) -> None:
    controller, syncs = controller_counting_syncs()
    stopped = Stopped()
    before = asyncio.all_tasks()
    daemon = asyncio.create_task(controller.autoscale(stopped, BODY, LOG))
    await asyncio.sleep(2.5 * PERIOD)
    assert len(syncs) == 3
    gaps = [later - earlier for earlier, later in itertools.pairwise(syncs)]
    assert all(PERIOD - 0.01 <= gap <= PERIOD + 0.2 for gap in gaps), gaps
    # Waiting for the next period, the daemon runs no other task.
    assert asyncio.all_tasks() - before == {daemon}

    if how == "kopf stops the daemon":
        stopped.is_set = True
    else:
        await controller.close()
    start = asyncio.get_running_loop().time()
    await asyncio.wait_for(daemon, 1.0)
    assert asyncio.get_running_loop().time() - start <= STOP_CHECK_S + 0.1
    assert len(syncs) == 3

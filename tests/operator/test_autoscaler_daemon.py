"""The autoscaler daemon's loop: a sync each period, and an end as soon as kopf stops it
or the operator closes, with no task of its own left behind.

When the operator exits, kopf re-raises the exception of every task that ends in its
last few seconds; a time-limited waiter task timing out there would make the operator
exit with TimeoutError. So the wait between periods must not be such a task.
"""

from __future__ import annotations

import asyncio
import itertools
import logging

import pytest

from pagedinfer.operator.controller import Controller, Options

pytestmark = pytest.mark.asyncio

LOG = logging.getLogger("test")


def body(period: float) -> dict:
    return {
        "metadata": {"namespace": "ns", "name": "llm"},
        "spec": {"autoscaling": {"maxReplicas": 3, "syncPeriodSeconds": period}},
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


async def until(condition, timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.01)


async def test_syncs_come_a_period_apart() -> None:
    period = 0.3
    controller, syncs = controller_counting_syncs()
    stopped = Stopped()
    daemon = asyncio.create_task(controller.autoscale(stopped, body(period), LOG))
    await until(lambda: len(syncs) == 3)
    stopped.is_set = True
    await asyncio.wait_for(daemon, 5.0)
    gaps = [later - earlier for earlier, later in itertools.pairwise(syncs)]
    assert all(gap >= period - 0.01 for gap in gaps), gaps


@pytest.mark.parametrize("how", ["kopf stops the daemon", "the operator closes"])
async def test_ends_long_before_its_next_period_with_no_task_of_its_own(how: str) -> None:
    controller, syncs = controller_counting_syncs()
    stopped = Stopped()
    before = asyncio.all_tasks()
    daemon = asyncio.create_task(controller.autoscale(stopped, body(3600.0), LOG))
    await until(lambda: len(syncs) == 1)
    await asyncio.sleep(0.05)
    # Waiting for the next period, the daemon runs no other task.
    assert asyncio.all_tasks() - before == {daemon}

    if how == "kopf stops the daemon":
        stopped.is_set = True
    else:
        await controller.close()
    await asyncio.wait_for(daemon, 5.0)  # the period is an hour
    assert len(syncs) == 1

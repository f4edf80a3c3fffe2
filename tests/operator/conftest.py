"""Fixtures of the operator tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio
from operator_fakes import FakePods


@pytest_asyncio.fixture
async def fake_pods() -> AsyncIterator[FakePods]:
    pods = FakePods()
    yield pods
    await pods.close()

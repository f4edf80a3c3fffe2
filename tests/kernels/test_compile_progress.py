"""The CPU backend's compile progress: each kernel numba compiles, each warm-up step and
a heartbeat are logged at info level, with the seconds since the warm-up began."""

from __future__ import annotations

import logging
import re
import threading
import time

import numba
import pytest

from pagedinfer.kernels.cpu import compile_progress as progress_module
from pagedinfer.kernels.cpu.compile_progress import compile_progress

LOGGER = progress_module.__name__


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_each_kernel_compiled_and_each_step_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    @numba.njit
    def helper(x):
        return x + 1

    @numba.njit
    def kernel(x):
        return helper(x) * 2

    caplog.set_level(logging.INFO, logger=LOGGER)
    with compile_progress(2, heartbeat_s=3600) as progress:
        progress.begin_step()
        assert kernel(3) == 8  # compiles kernel, and helper inside it
        progress.begin_step()
        assert kernel(4) == 10  # compiled already: nothing new
    lines = messages(caplog)
    patterns = [
        r"CPU executor: warm-up step 1 of 2, 0 kernels compiled so far, \d+ s",
        r"CPU executor: compiled kernel 1 \(test_compile_progress\.kernel, 2 functions\) "
        r"in warm-up step 1 of 2, \d+ s",
        r"CPU executor: warm-up step 2 of 2, 1 kernels compiled so far, \d+ s",
        r"CPU executor: warm-up compiled 1 kernels \(2 functions\) in \d+ s",
    ]
    assert len(lines) == len(patterns), lines
    for line, pattern in zip(lines, patterns, strict=True):
        assert re.fullmatch(pattern, line), line
    assert (progress.kernels, progress.functions) == (1, 2)


def test_kernels_compiled_on_worker_threads_count_too(caplog: pytest.LogCaptureFixture) -> None:
    @numba.njit
    def on_a_worker(x):
        return x - 1

    caplog.set_level(logging.INFO, logger=LOGGER)
    with compile_progress(1, heartbeat_s=3600) as progress:
        progress.begin_step()
        worker = threading.Thread(target=on_a_worker, args=(5,))
        worker.start()
        worker.join()
    assert progress.kernels == 1
    assert any("test_compile_progress.on_a_worker" in line for line in messages(caplog))


def test_a_long_compile_sends_a_heartbeat(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)

    def heartbeats() -> list[str]:
        return [line for line in messages(caplog) if "still compiling" in line]

    with compile_progress(3, heartbeat_s=0.01) as progress:
        progress.begin_step()
        deadline = time.monotonic() + 60
        while not heartbeats():
            assert time.monotonic() < deadline, "no heartbeat"
            time.sleep(0.01)
    assert re.fullmatch(
        r"CPU executor: still compiling, warm-up step 1 of 3, 0 kernels compiled, \d+ s",
        heartbeats()[0],
    )


def test_cached_warm_ups_log_their_steps_below_info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    with compile_progress(1, level=logging.DEBUG, heartbeat_s=3600) as progress:
        progress.begin_step()
    assert messages(caplog) == []

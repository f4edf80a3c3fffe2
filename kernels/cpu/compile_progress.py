"""Progress of the warm-up that compiles the CPU kernels, logged at info level.

A first start on a new model shape compiles for minutes (in a child process, while the
torch forward serves): the log says which warm-up step runs, each kernel numba finished
compiling, and every `HEARTBEAT_S` seconds what it is at, with the seconds since the
warm-up began, so that an operator sees it move. Kernels loaded from numba's disk cache
are not compiled and log nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from numba.core import event

log = logging.getLogger(__name__)

_COMPILE = "numba:compile"  # numba's event around each function it compiles (not on a cache hit)
HEARTBEAT_S = 30.0  # one kernel may compile for a minute or more


class CompileProgress(event.Listener):
    """Counts what numba compiles, on any thread (the warm-up's kernels run some work on
    worker threads), and logs each kernel (an outermost compile, its callees counted with
    it) and each step."""

    def __init__(self, total_steps: int, level: int = logging.INFO) -> None:
        self.total_steps = total_steps
        self.level = level  # of the step lines; kernel lines are always info
        self.step = 0
        self.kernels = 0  # kernels compiled (outermost compiles)
        self.functions = 0  # every function compiled, callees included
        self._nesting = threading.local()  # per thread: compiles under way
        self._lock = threading.Lock()
        self._started = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self._started

    def begin_step(self) -> None:
        self.step += 1
        log.log(
            self.level,
            "CPU executor: warm-up step %d of %d, %d kernels compiled so far, %.0f s",
            self.step,
            self.total_steps,
            self.kernels,
            self.elapsed(),
        )

    def heartbeat(self) -> None:
        log.log(
            self.level,
            "CPU executor: still compiling, warm-up step %d of %d, %d kernels compiled, %.0f s",
            self.step,
            self.total_steps,
            self.kernels,
            self.elapsed(),
        )

    def on_start(self, ev: Any) -> None:
        self._nesting.depth = getattr(self._nesting, "depth", 0) + 1

    def on_end(self, ev: Any) -> None:
        depth = getattr(self._nesting, "depth", 0)
        if depth == 0:  # began before this listener was installed
            return
        self._nesting.depth = depth - 1
        with self._lock:
            self.functions += 1
            if depth > 1:
                return
            self.kernels += 1
            log.info(
                "CPU executor: compiled kernel %d (%s, %d functions) in warm-up step %d of %d, "
                "%.0f s",
                self.kernels,
                _kernel_name(ev.data.get("dispatcher")),
                self.functions,
                self.step,
                self.total_steps,
                self.elapsed(),
            )


@contextlib.contextmanager
def compile_progress(
    total_steps: int, level: int = logging.INFO, heartbeat_s: float = HEARTBEAT_S
) -> Iterator[CompileProgress]:
    """Listen to numba's compiles while the block runs (a warm-up of `total_steps` steps,
    each announced by `begin_step`), with a heartbeat line every `heartbeat_s` seconds;
    log a summary at the end."""
    progress = CompileProgress(total_steps, level)
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(heartbeat_s):
            progress.heartbeat()

    beating = threading.Thread(target=beat, name="pagedinfer-compile-progress", daemon=True)
    beating.start()
    try:
        with event.install_listener(_COMPILE, progress):
            yield progress
    finally:
        stop.set()
        beating.join()
    if progress.kernels:
        log.info(
            "CPU executor: warm-up compiled %d kernels (%d functions) in %.0f s",
            progress.kernels,
            progress.functions,
            progress.elapsed(),
        )


def _kernel_name(dispatcher: Any) -> str:
    """`module.function` of a numba dispatcher, for the log."""
    function = getattr(dispatcher, "py_func", None)
    if function is None:
        return "?"
    module = getattr(function, "__module__", "") or ""
    return f"{module.rsplit('.', 1)[-1]}.{function.__name__}"

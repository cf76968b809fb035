"""Progress of optimize() and verify() through standard logging (logger "ckpt_planner").

Every stage (capture, profile, solve, rewrite, verify) logs one INFO record when it
starts and one when it ends, with its duration in seconds; the solvers log their
own steps under "ckpt_planner.solvers". Nothing is shown unless the application
configures logging (`logging.basicConfig(level=logging.INFO)`) or passes
`progress=True`, which attaches a stderr handler for the duration of the call:
that shows in a notebook cell, in a log file redirected from stderr, and on a
terminal alike, since it does not depend on a TTY.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator

__all__ = ["logger", "stage", "stages_seen", "progress_enabled", "native_stderr_dropped"]

logger = logging.getLogger("ckpt_planner")

_FORMAT = "ckpt_planner %(levelname)s %(message)s"

_LISTENERS: contextvars.ContextVar[tuple[Callable[[str], None], ...]] = contextvars.ContextVar("stages", default=())
"""Who is told each stage's name as it starts (`stages_seen`): logging may be disabled where they listen."""


@contextlib.contextmanager
def stage(name: str, detail: str = "") -> Iterator[None]:
    """Log the start and the end (with seconds taken) of one pipeline stage."""
    for listen in _LISTENERS.get():
        listen(name)
    logger.info("%s: start%s", name, f" ({detail})" if detail else "")
    t0 = time.perf_counter()
    try:
        yield
    except Exception as e:
        logger.info("%s: failed after %.2f s (%s)", name, time.perf_counter() - t0, type(e).__name__)
        raise
    logger.info("%s: done in %.2f s", name, time.perf_counter() - t0)


@contextlib.contextmanager
def stages_seen(listen: Callable[[str], None]) -> Iterator[None]:
    """Call `listen(name)` as each stage starts, for the duration (a command line's progress bar), whether
    or not logging shows anything."""
    token = _LISTENERS.set((*_LISTENERS.get(), listen))
    try:
        yield
    finally:
        _LISTENERS.reset(token)


class _Handler(logging.StreamHandler):
    """Writes to the sys.stderr of the moment (a notebook replaces it per cell)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(_FORMAT))

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it
        pass


@contextlib.contextmanager
def progress_enabled(enabled: bool) -> Iterator[None]:
    """With enabled=True, show INFO records of "ckpt_planner" on stderr for the duration."""
    if not enabled:
        yield
        return
    handler = _Handler()
    previous = logger.level
    logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


@contextlib.contextmanager
def native_stderr_dropped() -> Iterator[None]:
    """Drop what native code writes to file descriptor 2 while inside (Kineto's `USDT: ... profiler_start`
    lines when torch.profiler starts and stops). Wrap only the native call that writes the noise: Python
    warnings raised inside would be dropped too, so a user's own code never runs inside."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no descriptor 2: nothing to drop
        yield
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)

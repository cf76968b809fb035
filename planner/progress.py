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
import logging
import sys
import time
from collections.abc import Iterator

__all__ = ["logger", "stage", "progress_enabled"]

logger = logging.getLogger("ckpt_planner")

_FORMAT = "ckpt_planner %(levelname)s %(message)s"


@contextlib.contextmanager
def stage(name: str, detail: str = "") -> Iterator[None]:
    """Log the start and the end (with seconds taken) of one pipeline stage."""
    logger.info("%s: start%s", name, f" ({detail})" if detail else "")
    t0 = time.perf_counter()
    try:
        yield
    except Exception as e:
        logger.info("%s: failed after %.2f s (%s)", name, time.perf_counter() - t0, type(e).__name__)
        raise
    logger.info("%s: done in %.2f s", name, time.perf_counter() - t0)


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

"""The callbacks' log lines: through tqdm's bar while one is shown, each starting "callback: "."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from ..progress import logger

__all__ = ["through_bars"]


@contextlib.contextmanager
def through_bars() -> Iterator[None]:
    """While a tqdm bar is shown, console log handlers write through `tqdm.write` (above the bar)."""
    try:
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm
    except ImportError:
        yield
        return
    if not list(getattr(tqdm, "_instances", ())):
        yield
        return
    with logging_redirect_tqdm(loggers=[logging.root, logger]):
        yield


def _log(level: int, msg: str, *args: Any) -> None:
    if logger.isEnabledFor(level):
        with through_bars():
            logger.log(level, "callback: " + msg, *args)

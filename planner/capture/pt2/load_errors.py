"""torch.export's own reports kept off the terminal, and what stopped a load told in one line.

torch.export logs tracebacks (a failed export, a failed load) and hides the cause of a failed load in a log
record; the command line prints one line per error, so these keep the log quiet and find the cause.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator

from ...errors import InputError
from .custom_ops import register_operators

__all__ = ["load_failure", "logged_errors", "quiet_torch_export"]


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)[:300]


@contextlib.contextmanager
def quiet_torch_export() -> Iterator[None]:
    """torch.export logs tracebacks (a failed load, a failed export); keep our one-line errors clean."""
    names = ("torch.export", "torch._export", "torch._dynamo", "torch.fx.experimental", "torch._subclasses.fake_tensor")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


_UNREGISTERED = re.compile(r"Deserializing (\S+?)\.? in pytree is not registered")
# torch's SerializeError for a node whose operator it cannot resolve prints the whole node; its target leads
_NODE_OPERATOR = re.compile(r"Failed deserializing node Node\(target='torch\.ops\.(\w+)\.(\w+)\.")


@contextlib.contextmanager
def logged_errors(found: list[BaseException]) -> Iterator[None]:
    """Collect the exceptions torch.export logs and prints nothing.

    `torch.export.load` catches the error that stopped it, logs it as a warning of the `torch.export`
    logger and raises a RuntimeError that only says to "check the warnings above"; its cause is in the
    log record, not in the exception's chain. While the load runs, the logger's only handler is the one
    that keeps them (torch gives it one that prints to stderr), and a command line's `logging.disable`,
    which would drop the record before any handler sees it, is lowered to let warnings through.
    """

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.exc_info and record.exc_info[1] is not None:
                found.append(record.exc_info[1])

    logger, handler = logging.getLogger("torch.export"), Keep(logging.WARNING)
    saved = (logger.level, logger.propagate, logger.disabled, logger.handlers, logging.root.manager.disable)
    logger.setLevel(logging.WARNING)
    logger.propagate, logger.disabled, logger.handlers = False, False, [handler]
    if saved[4] >= logging.WARNING:
        logging.disable(logging.INFO)
    try:
        yield
    finally:
        logger.setLevel(saved[0])
        logger.propagate, logger.disabled, logger.handlers = saved[1], saved[2], saved[3]
        logging.disable(saved[4])


def load_failure(e: BaseException, logged: list[BaseException]) -> str:
    """What stopped torch.export.load, in one line: the logged cause when torch hid it, and what to do when
    the program's inputs or outputs are a type registered with torch's pytree only by its own library."""
    cause = next(iter(logged), None) or e.__cause__ or e
    found = _UNREGISTERED.search(str(cause))
    operator = _NODE_OPERATOR.search(str(cause))
    if found is None and operator is not None:
        try:  # the operator torch could not resolve, named with what to do (when it is indeed unregistered)
            register_operators({f"{operator.group(1)}::{operator.group(2)}"})
        except InputError as named:
            return str(named)
    if found is None:
        return _first_line(cause)
    name = found.group(1)
    return (
        f"{_first_line(cause)} The program returns or takes a {name}, a type torch rebuilds only once its "
        "library has registered it with torch's pytree (a transformers ModelOutput, on `import transformers`), "
        "and the command line never imports a library a file names. Export the model so that it returns plain "
        "tensors: `ckpt-planner export MODEL --input ... -o model.pt2` (Python: "
        "`ckpt_planner.export_for_cli(model, inputs, 'model.pt2')`), which returns the loss alone when labels "
        f"are given, else the logits or a tuple of tensors; or, in Python, register {name} before loading it "
        "(for a transformers type, `import transformers` does)"
    )

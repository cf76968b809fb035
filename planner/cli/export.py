"""`ckpt-planner export` and `ckpt_planner.export_for_cli`: a model saved as a `.pt2` that the command line loads.

`torch.export.save` records the types of a program's inputs and outputs by name, and `torch.export.load`
rebuilds a type only when it is registered with torch's pytree in the loading process. A transformers
model returns a `ModelOutput` (`CausalLMOutputWithPast`), which only `import transformers` registers, and
the command line never imports a library that a file names (that would run code on the file's say-so),
so such a program cannot be loaded there. Here the model is exported wrapped so that it returns plain
tensors (the loss alone, the logits, or a flat tuple) and takes plain tuples and dicts. The wrapper shares
the model's parameters, buffers and submodules, so the program's names are the model's own
(`model.layers.0.mlp`, not `wrapped.model.layers.0.mlp`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import re
import stat
import sys
import tempfile
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..capture.pt2.load_errors import quiet_torch_export
from ..errors import InputError, OutputError
from ..model_state import ModelState
from ..plan_schema import not_a_file
from .cli_args import EXIT_OK
from .outputs import command_output, out, say

__all__ = ["RETURNS", "export_for_cli", "export_program", "save_program", "cmd_export"]

RETURNS = ("auto", "loss", "logits", "tensors")
"""What the exported program returns: the loss, the logits, or every tensor of the output (a flat tuple);
'auto' is the loss when the output has one (labels were given), else the logits, else every tensor."""

# What torch's pytree rebuilds by name in any process; their subclasses (a ModelOutput is an OrderedDict,
# a namedtuple a tuple) need their own registration.
_PLAIN = (tuple, list, dict, collections.OrderedDict, collections.defaultdict, collections.deque)


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)[:300]


def _tensors(out: Any) -> tuple[torch.Tensor, ...]:
    from torch.utils import _pytree as pytree

    return tuple(t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor))


def _field(out: Any, name: str) -> torch.Tensor | None:
    value = out.get(name) if isinstance(out, Mapping) else None  # a ModelOutput is a Mapping
    return value if isinstance(value, torch.Tensor) else None


def plain_outputs(out: Any, returns: str) -> tuple[torch.Tensor | tuple[torch.Tensor, ...], str]:
    """(what the program returns, which of RETURNS that is) for a model's output."""
    kind = type(out).__name__
    if returns in ("auto", "loss") and _field(out, "loss") is not None:
        return _field(out, "loss"), "loss"
    if returns == "loss":
        raise InputError(f"returns: the model's output ({kind}) has no loss tensor; give the labels as an input "
                         "(e.g. --input labels=2,128:int64:0-VOCAB) or choose --returns logits or tensors")
    if returns in ("auto", "logits") and _field(out, "logits") is not None:
        return _field(out, "logits"), "logits"
    if returns == "logits":
        raise InputError(f"returns: the model's output ({kind}) has no logits tensor; choose --returns loss or tensors")
    tensors = _tensors(out)
    if not tensors:
        raise InputError(f"returns: the model's output ({kind}) holds no tensor, so there is no training step to plan")
    return (tensors[0] if len(tensors) == 1 else tensors), "tensors"


class _PlainOutputs(torch.nn.Module):
    """The model, returning plain tensors. Its parameters, buffers and submodules are the model's own dicts,
    so torch.export names everything as the model does and the model itself is never changed."""

    def __init__(self, model: torch.nn.Module, returns: str) -> None:
        super().__init__()
        for name in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
            self.__dict__[name] = model.__dict__[name]
        object.__setattr__(self, "_model", model)  # not a submodule: its children are ours already
        # torch.export puts back the module's attributes (lists and dicts included) after tracing, so what
        # the forward chose is kept outside them
        object.__setattr__(self, "chosen", types.SimpleNamespace(returns=returns))
        self.returns = returns
        self.training = model.training

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out, self.chosen.returns = plain_outputs(self._model(*args, **kwargs), self.returns)
        return out


def _split(example_inputs: Any) -> tuple[tuple, dict]:
    """(args, kwargs) as plain containers: a BatchEncoding or another Mapping becomes a dict, a list a tuple."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, Mapping):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise InputError(f"inputs: a tensor, a tuple or a dict of them, not {type(example_inputs).__name__}")


def _foreign_types(spec: Any) -> list[str]:
    """Types in a pytree spec that torch.export.load could not rebuild without their library."""
    found, todo = [], [spec]
    while todo:
        node = todo.pop()
        kind = getattr(node, "type", None)
        if kind is not None and kind not in _PLAIN:
            found.append(f"{kind.__module__}.{kind.__qualname__}")
        todo.extend(node.children() if hasattr(node, "children") else getattr(node, "children_specs", ()))
    return sorted(set(found))


def _ours(e: BaseException) -> InputError | None:
    """Our own error raised inside the traced forward, however torch wrapped it."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, InputError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _why_not(e: BaseException) -> str:
    """Why torch.export failed, in one line; for a branch on a value the data decides (`Eq(u0, 1)` on a
    boolean mask's count), what to do instead: the API plans such a model, the command line needs a saved
    program."""
    seen, chain = set(), []
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    guard = next((c for c in chain if type(c).__name__ == "GuardOnDataDependentSymNode"), None)
    if guard is None:
        return _first_line(chain[0])
    # torch's text: "Could not guard on data-dependent expression Eq(u0, 1) (unhinted: ...).  (Size-like ...)"
    found = re.search(r"data-dependent expression (.+?) \(unhinted", str(guard))
    expr = found.group(1)[:120] if found else "a size"
    return (f"its code branches on {expr}, where u0 is a value the data decides (a boolean mask's count, a "
            "tensor's item), and a saved program cannot branch; plan it in Python instead: "
            "ckpt_planner.optimize(model, inputs, activation_budget=...)")


def export_program(model: torch.nn.Module, example_inputs: Any, *, returns: str = "auto",
                   train: bool = True) -> tuple[torch.export.ExportedProgram, str]:
    """(the program, which of RETURNS it returns): `model` exported with torch.export in training mode
    (`train=False`: eval mode), returning plain tensors. The model's mode, buffers and grads are restored."""
    if returns not in RETURNS:
        raise InputError(f"returns: {returns!r} is not one of {', '.join(RETURNS)}")
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"model: an nn.Module, not {type(model).__name__}")
    args, kwargs = _split(example_inputs)
    with ModelState(model).preserved():
        model.train(train)
        wrapped = _PlainOutputs(model, returns)
        # torch.export prints the partial graph of a failed trace to stderr (a plain print, not a log record);
        # what the trace prints is held, and shown only when it succeeds (the model's own warnings)
        printed = io.StringIO()
        try:
            with quiet_torch_export(), contextlib.redirect_stderr(printed):
                program = torch.export.export(wrapped, args, kwargs)
        except Exception as e:  # noqa: BLE001 - the model's code, traced by torch: report its first line
            ours = _ours(e)
            if ours is not None:
                raise InputError(str(ours)) from None
            raise InputError(f"model: torch.export cannot export it with these inputs: {_why_not(e)}") from None
    sys.stderr.write(printed.getvalue())
    foreign = _foreign_types(program.call_spec.in_spec)
    if foreign:
        raise InputError(f"inputs: they hold {', '.join(foreign)}, which torch.export.load cannot rebuild where "
                         "its library is not imported; give tensors, tuples and dicts")
    return program, wrapped.chosen.returns


def _mode_for(path: Path) -> int:
    if path.exists():
        return stat.S_IMODE(os.stat(path).st_mode)
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def save_program(program: torch.export.ExportedProgram, path: str | os.PathLike) -> Path:
    """torch.export.save to a temporary file beside `path`, renamed into place: a failed save (a full
    disk, Ctrl-C) leaves no partial file, and an existing file keeps its mode. OutputError on failure."""
    p = Path(path)
    kind = not_a_file(p)
    if kind is not None:
        raise OutputError(f"output {str(p)!r} is {kind}; only a regular file is replaced, so name a file path")
    try:
        mode = _mode_for(p)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}-", suffix=".pt2", dir=p.parent if str(p.parent) else ".")
        os.close(fd)
    except OSError as e:
        raise OutputError(f"output {str(p)!r} could not be written ({e.strerror or e}); nothing was written") from None
    try:
        with quiet_torch_export():
            torch.export.save(program, tmp)
        os.chmod(tmp, mode)
        os.replace(tmp, p)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, (KeyboardInterrupt, SystemExit)):
            raise
        raise OutputError(f"output {str(p)!r} could not be written ({_first_line(e)}); nothing was written") from None
    return p


def export_for_cli(model: torch.nn.Module, example_inputs: Any, path: str | os.PathLike, *,
                   returns: str = "auto", train: bool = True) -> torch.export.ExportedProgram:
    """Export `model` so that `ckpt-planner plan PATH` loads it, and save it to `path`; returns the program.

    The program returns plain tensors (`returns`, one of RETURNS: by default the loss when the output has
    one, else the logits, else every tensor), so no library has to register its output types where it
    is loaded; it is exported in training mode (the mode a plan is for) unless `train=False`, with
    `example_inputs` (a tensor, a tuple of positional arguments or a dict of keyword arguments) as its
    sample inputs, the command line's default. Errors are InputError (OutputError for the file).
    """
    program, _ = export_program(model, example_inputs, returns=returns, train=train)
    save_program(program, path)
    return program


def cmd_export(args: argparse.Namespace) -> int:
    """Save MODEL as a .pt2 that returns plain tensors, with its inputs as the default ones (export.py)."""
    from .loading import model_and_inputs

    if args.device == "meta":
        raise InputError("device: a .pt2 holds the model's weights, which the meta device has none of; use cpu or cuda")
    target = command_output(args.output, "output", args)
    loaded, inputs, record = model_and_inputs(args)
    program, returns = export_program(loaded.model, inputs, returns=args.returns)
    save_program(program, target)
    shown = record.get("inputs") or record.get("inputs_file") or record.get("inputs_source")
    if args.json:
        out(args, json.dumps({"output": str(target), "returns": returns, "inputs": shown}))
    what = "every tensor of the output" if returns == "tensors" else f"the {returns}"
    inputs_text = " ".join(shown) if isinstance(shown, list) else shown
    say(args, f"wrote {target}: returns {what}; its inputs, the default ones: {inputs_text}\n"
               f"plan it:  ckpt-planner plan {target} --activation-budget 0.75 -o plan.json")
    return EXIT_OK

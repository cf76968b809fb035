"""Models and example inputs named on the command line, and checkpointed modules written by `apply`.

Model specs:

* ``model.pt2`` — a `torch.export.save`d ExportedProgram; its `.module()` is
  the model (export it in training mode: the graph keeps the mode it was
  exported in). Its saved example inputs are the default inputs.
* ``path/to/file.py:factory`` or ``package.module:factory`` — a function
  called with no arguments that returns the model, or ``(model,
  example_inputs)``.
* any other file (``model.pt``) — a `torch.save`d module. Unpickling runs
  code from the file, so it is refused unless ``trust_pickle=True``.

Input specs (``--input``, repeatable; one per positional argument, or
``NAME=...`` for a keyword argument)::

    SHAPE[:DTYPE[:LOW-HIGH]]     8,3,224,224   8,3,224,224:float16   2,128:int64:0-50257

SHAPE is comma-separated sizes (``""`` or ``scalar`` for a 0-d tensor).
DTYPE is a torch dtype name (default float32). Floating tensors are standard
normal, or uniform in [LOW, HIGH) when a range is given; integer tensors are
uniform integers in [LOW, HIGH) (HIGH exclusive, like `torch.randint`;
default 0-2); bool tensors are random bits.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..capture.pt2.archive import open_torch_save_file
from ..capture.pt2.zipcheck import memory_bytes
from ..capture.trace import normalize_inputs  # what an apply folder's load.py imports: from here alone
from ..errors import InputError
from ..profile.loss import default_loss
from .applied import APPLIED_FORMAT, Applied, load_applied, write_applied  # the apply folder; importable from here
from .models import LoadedModel, _first_line, load_model, model_kind  # noqa: F401 - importable from here, as before

__all__ = [
    "InputSpec",
    "LoadedModel",
    "Applied",
    "APPLIED_FORMAT",
    "parse_input_spec",
    "make_inputs",
    "load_inputs_file",
    "load_model",
    "load_model_and_inputs",
    "inputs_named",
    "model_and_inputs",
    "model_kind",
    "write_applied",
    "load_applied",
    "normalize_inputs",
    "default_loss",
]


_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32", "float", "float64", "double", "float16", "half", "bfloat16",
        "int64", "long", "int32", "int", "int16", "short", "int8", "uint8", "bool",
    )
}
_SPEC = re.compile(r"^(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)=)?(?P<rest>.*)$")


@dataclass(frozen=True, kw_only=True)
class InputSpec:
    """One example input described on the command line."""

    shape: tuple[int, ...]
    """Sizes of the tensor."""
    dtype: torch.dtype = torch.float32
    """Element type."""
    low: float | int | None = None
    """Lower end of the value range (inclusive; an exact int for integer dtypes), or None for the default."""
    high: float | int | None = None
    """Upper end of the value range (exclusive; an exact int for integer dtypes), or None for the default."""
    name: str | None = None
    """Keyword-argument name, or None for a positional argument."""
    text: str = ""
    """The spec as written (recorded in plan files)."""


def parse_input_spec(text: str) -> InputSpec:
    """Parse ``[NAME=]SHAPE[:DTYPE[:LOW-HIGH]]``; a malformed spec raises InputError naming it."""
    m = _SPEC.match(text.strip())
    name, rest = m.group("name"), m.group("rest")
    parts = rest.split(":")
    if len(parts) > 3:
        raise InputError(f"input {text!r}: expected SHAPE[:DTYPE[:LOW-HIGH]], e.g. 8,3,224,224 or 2,128:int64:0-50257")
    shape_text = parts[0].strip()
    if shape_text in ("", "scalar"):
        shape: tuple[int, ...] = ()
    else:
        try:
            shape = tuple(int(s) for s in shape_text.split(","))
        except ValueError:
            raise InputError(
                f"input {text!r}: shape {shape_text!r} is not comma-separated integers (e.g. 8,3,224,224)"
            ) from None
        if any(s < 0 for s in shape):
            raise InputError(f"input {text!r}: shape {shape_text!r} has a negative size")
        if any(s >= 2**63 for s in shape):
            raise InputError(f"input {text!r}: shape {shape_text!r} has a size beyond 2**63 - 1")
    dtype = torch.float32
    if len(parts) > 1 and parts[1].strip():
        key = parts[1].strip().removeprefix("torch.")
        if key not in _DTYPES:
            raise InputError(f"input {text!r}: unknown dtype {parts[1]!r}; valid: {', '.join(sorted(_DTYPES))}")
        dtype = _DTYPES[key]
    low = high = None
    if len(parts) > 2:
        if len(parts[2]) > _MAX_RANGE_CHARS:
            raise InputError(f"input {text[:80]!r}: range is longer than {_MAX_RANGE_CHARS} characters; give LOW-HIGH")
        if dtype == torch.bool:
            raise InputError(f"input {text!r}: a value range does not apply to bool")
        rm = re.fullmatch(r"\s*(-?[0-9.eE+]+)\s*-\s*(-?[0-9.eE+]+)\s*", parts[2])
        low, high = (_bound(rm.group(1), dtype), _bound(rm.group(2), dtype)) if rm else (None, None)
        if low is None or high is None or not low < high:
            raise InputError(f"input {text!r}: range {parts[2]!r} is not LOW-HIGH with LOW < HIGH (e.g. 0-50257)")
        _check_range(text, dtype, low, high)
    return InputSpec(shape=shape, dtype=dtype, low=low, high=high, name=name, text=text)


_MAX_RANGE_CHARS = 100


def _bound(text: str, dtype: torch.dtype) -> float | int | None:
    """One end of a range: a float, or for an integer dtype the exact integer (a float would round
    2**63 - 1 up past int64); None when it is not a number."""
    if not dtype.is_floating_point and re.fullmatch(r"-?[0-9]+", text):
        return int(text)
    try:
        value = float(text)
    except ValueError:
        return None
    if not dtype.is_floating_point and math.isfinite(value) and value == int(value):
        return int(value)
    return value


def _check_range(text: str, dtype: torch.dtype, low: float | int, high: float | int) -> None:
    """LOW-HIGH must be finite and representable in the dtype; integer ranges must hold an integer."""
    if not (math.isfinite(low) and math.isfinite(high)):
        raise InputError(f"input {text!r}: range {low:g}-{high:g} is not finite; give finite LOW-HIGH")
    if dtype.is_floating_point:
        info = torch.finfo(dtype)
        if low < info.min or high > info.max:
            raise InputError(f"input {text!r}: range {low:g}-{high:g} is outside {dtype} ([{info.min:g}, {info.max:g}])")
        return
    if not (isinstance(low, int) and isinstance(high, int)):
        raise InputError(f"input {text!r}: an integer dtype needs integer LOW-HIGH (e.g. 0-50257), got {low:g}-{high:g}")
    info = torch.iinfo(dtype)
    # torch.randint takes HIGH as an int64 too: for int64 itself the largest HIGH is 2**63 - 1
    top = min(info.max + 1, 2**63 - 1)
    if low < info.min or high > top:
        raise InputError(
            f"input {text!r}: the range is outside what torch.randint draws for {dtype} "
            f"(LOW >= {info.min}, HIGH <= {top})"
        )


def _make_tensor(spec: InputSpec, generator: torch.Generator) -> torch.Tensor:
    if spec.dtype == torch.bool:
        return torch.randint(0, 2, spec.shape, generator=generator).bool()
    if spec.dtype.is_floating_point:
        if spec.low is None:
            return torch.randn(spec.shape, generator=generator).to(spec.dtype)
        u = torch.rand(spec.shape, generator=generator)
        if spec.high - spec.low > torch.finfo(u.dtype).max:  # the width overflows float32: scale each end instead
            u = u.double()
            return (spec.low * (1 - u) + spec.high * u).to(spec.dtype)
        return (u * (spec.high - spec.low) + spec.low).to(spec.dtype)
    low = int(spec.low) if spec.low is not None else 0
    high = int(spec.high) if spec.high is not None else 2
    return torch.randint(low, high, spec.shape, generator=generator, dtype=spec.dtype)


def make_inputs(specs: Sequence[InputSpec], *, seed: int = 0) -> tuple | dict:
    """Random example inputs: a tuple of positional args, or a dict when every spec is named.

    Sizes are checked before anything is allocated: inputs larger than this
    machine's memory raise InputError naming the input.
    """
    if not 0 <= seed < 2**64:
        raise InputError(f"seed: {seed} is outside 0 .. 2**64 - 1")
    limit, total = memory_bytes(), 0
    for s in specs:
        total += math.prod(s.shape) * (1 if s.dtype == torch.bool else s.dtype.itemsize)
        if limit is not None and total > limit:
            raise InputError(
                f"input {s.text!r}: the inputs need {total / 1e9:.3g} GB, more than this machine's memory "
                f"({limit / 1e9:.3g} GB); give smaller shapes"
            )
    g = torch.Generator().manual_seed(seed)
    tensors = [(s.name, _make_tensor(s, g)) for s in specs]
    named = [n for n, _ in tensors if n is not None]
    if named and len(named) != len(tensors):
        raise InputError("input: name every --input (NAME=SHAPE...) or none of them")
    if named:
        return dict(tensors)
    return tuple(t for _, t in tensors)


def load_inputs_file(path: str | os.PathLike) -> Any:
    """A torch.save'd tensor, tuple/list of tensors or dict of tensors, loaded with weights_only=True."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"inputs file {str(p)!r} does not exist")
    try:
        f = open_torch_save_file(p)  # a regular file that fits in memory; a zip laid out and capped before loading
    except InputError as e:
        raise InputError(f"inputs file {str(p)!r} {e}") from None
    try:
        with f:
            value = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
        raise InputError(f"inputs file {str(p)!r} cannot be read with weights_only=True: {_first_line(e)}") from None
    if isinstance(value, list):
        value = tuple(value)
    if not isinstance(value, (torch.Tensor, tuple, dict)):
        raise InputError(f"inputs file {str(p)!r}: expected a tensor, a tuple or a dict of tensors, got {type(value).__name__}")
    return value


def load_model_and_inputs(
    spec: str,
    *,
    input_specs: Sequence[str] = (),
    inputs_file: str | None = None,
    seed: int = 0,
    device: str = "cpu",
    trust_pickle: bool = False,
    recorded: dict[str, Any] | None = None,
) -> tuple[LoadedModel, Any, dict[str, Any]]:
    """(model, example inputs, a record of where both came from) for the command line.

    Inputs come from `input_specs`, else `inputs_file`, else `recorded` (the
    record of an earlier call, as stored in a plan file), else the model file
    or factory, else the model's `example_input_array`. device='cuda' moves
    model and inputs there; 'meta' leaves them on the CPU (profiling fakes them).
    """
    if input_specs and inputs_file:
        raise InputError("input: give --input or --inputs, not both")
    specs = [parse_input_spec(s) for s in input_specs]
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("device: 'cuda' was asked for but torch.cuda.is_available() is False")
    loaded = load_model(spec, trust_pickle=trust_pickle)
    record: dict[str, Any] = {"model": loaded.spec, "model_kind": loaded.kind, "seed": seed, "device": device}
    recorded = recorded or {}
    if specs:
        inputs, record["inputs"] = make_inputs(specs, seed=seed), [s.text for s in specs]
    elif inputs_file:
        inputs, record["inputs_file"] = load_inputs_file(inputs_file), str(Path(inputs_file).resolve())
    elif recorded.get("inputs") is not None:
        texts, rseed = _recorded_specs(recorded)
        specs = [parse_input_spec(s) for s in texts]
        inputs, record["inputs"], record["seed"] = make_inputs(specs, seed=rseed), texts, rseed
    elif recorded.get("inputs_file") is not None:
        # A plan file is data from elsewhere: a path in it is never opened on its say-so.
        raise InputError(
            f"inputs: the plan was made with inputs from the file {str(recorded['inputs_file'])[:200]!r}, "
            "which is not read from a plan file; pass --inputs FILE (or --input SHAPE) to use it"
        )
    elif loaded.example_inputs is not None:
        inputs, record["inputs_source"] = loaded.example_inputs, "the model file or factory"
    elif getattr(loaded.model, "example_input_array", None) is not None:
        inputs, record["inputs_source"] = loaded.model.example_input_array, "model.example_input_array"
    else:
        raise InputError(f"inputs: none given and model {spec!r} carries none; pass --input SHAPE[:DTYPE] or --inputs FILE")
    if device == "cuda":
        loaded.model.to("cuda")
        inputs = _to(inputs, "cuda")
    return loaded, inputs, record


def _recorded_specs(recorded: dict[str, Any]) -> tuple[list[str], int]:
    """The `--input` specs and seed a plan file records (stats.cli), checked: it may have been edited."""
    texts, seed = recorded.get("inputs"), recorded.get("seed", 0)
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) and len(t) < 1000 for t in texts):
        raise InputError("plan file: stats.cli.inputs is not a list of input specs; pass --input SHAPE[:DTYPE] instead")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise InputError(f"plan file: stats.cli.seed {str(seed)[:40]!r} is not an integer in 0 .. 2**64 - 1")
    return list(texts), seed


def _to(value: Any, device: str) -> Any:
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


@contextlib.contextmanager
def inputs_named(loaded: LoadedModel, inputs: Any, record: dict[str, Any]) -> Iterator[None]:
    """A failure that the inputs caused becomes an InputError naming them: a capture or profile failure, or
    the model's own error where a model the capture cannot take whole is run eagerly in parts."""
    from ..capture.preflight import explain_failure
    from ..errors import CaptureError, ModelInputError, ProfileError

    try:
        yield
    except Exception as e:
        ours = type(e).__module__.partition(".")[0] == __name__.partition(".")[0]  # the planner's own errors
        if ours and not isinstance(e, (CaptureError, ProfileError, ModelInputError)):
            raise
        reference = loaded.example_inputs
        if reference is None:
            reference = getattr(loaded.model, "example_input_array", None)
        if isinstance(e, ModelInputError):
            seen = CaptureError(e.raised)  # the model's own error, as the capture would have met it
        else:
            seen = e if ours else CaptureError(f"{type(e).__name__}: {e}")
        better = explain_failure(loaded.model, inputs, reference, seen, record.get("inputs"))
        if better is None:
            raise
        raise better from None


def model_and_inputs(args: Any, recorded: dict[str, Any] | None = None) -> tuple[LoadedModel, Any, dict[str, Any]]:
    """(loaded model, inputs, record) from a command's MODEL and input options; a .pt2 model's inputs are
    checked against its exported shapes."""
    from ..capture.preflight import check_exported_inputs

    loaded, inputs, record = load_model_and_inputs(
        args.model, input_specs=args.input or (), inputs_file=args.inputs, seed=args.seed, device=args.device,
        trust_pickle=args.trust_pickle, recorded=recorded,
    )
    if loaded.kind == "pt2":
        check_exported_inputs(loaded.model, inputs, record.get("inputs"))
    return loaded, inputs, record

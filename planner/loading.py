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
import importlib
import importlib.util
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import InputError

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
    "model_kind",
    "write_applied",
    "load_applied",
]

APPLIED_FORMAT = "ckpt-planner/applied"
APPLIED_VERSION = 1

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
    low: float | None = None
    """Lower end of the value range (inclusive), or None for the default."""
    high: float | None = None
    """Upper end of the value range (exclusive), or None for the default."""
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
    dtype = torch.float32
    if len(parts) > 1 and parts[1].strip():
        key = parts[1].strip().removeprefix("torch.")
        if key not in _DTYPES:
            raise InputError(f"input {text!r}: unknown dtype {parts[1]!r}; valid: {', '.join(sorted(_DTYPES))}")
        dtype = _DTYPES[key]
    low = high = None
    if len(parts) > 2:
        rm = re.fullmatch(r"\s*(-?[0-9.eE+]+)\s*-\s*(-?[0-9.eE+]+)\s*", parts[2])
        try:
            low, high = (float(rm.group(1)), float(rm.group(2))) if rm else (None, None)
        except ValueError:
            low = high = None
        if low is None or high is None or not low < high:
            raise InputError(f"input {text!r}: range {parts[2]!r} is not LOW-HIGH with LOW < HIGH (e.g. 0-50257)")
        if dtype == torch.bool:
            raise InputError(f"input {text!r}: a value range does not apply to bool")
    return InputSpec(shape=shape, dtype=dtype, low=low, high=high, name=name, text=text)


def _make_tensor(spec: InputSpec, generator: torch.Generator) -> torch.Tensor:
    if spec.dtype == torch.bool:
        return torch.randint(0, 2, spec.shape, generator=generator).bool()
    if spec.dtype.is_floating_point:
        if spec.low is None:
            return torch.randn(spec.shape, generator=generator).to(spec.dtype)
        return (torch.rand(spec.shape, generator=generator) * (spec.high - spec.low) + spec.low).to(spec.dtype)
    low = int(spec.low) if spec.low is not None else 0
    high = int(spec.high) if spec.high is not None else 2
    return torch.randint(low, high, spec.shape, generator=generator, dtype=spec.dtype)


def make_inputs(specs: Sequence[InputSpec], *, seed: int = 0) -> tuple | dict:
    """Random example inputs: a tuple of positional args, or a dict when every spec is named."""
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
    if not p.is_file():
        raise InputError(f"inputs file {str(p)!r} does not exist")
    try:
        value = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling failure is a bad file
        raise InputError(f"inputs file {str(p)!r} cannot be read with weights_only=True: {_first_line(e)}") from None
    if isinstance(value, list):
        value = tuple(value)
    if not isinstance(value, (torch.Tensor, tuple, dict)):
        raise InputError(f"inputs file {str(p)!r}: expected a tensor, a tuple or a dict of tensors, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class LoadedModel:
    """A model from a spec, and the example inputs that came with it (None when none did)."""

    model: torch.nn.Module
    example_inputs: Any
    kind: str
    """'pt2', 'factory' or 'pickle'."""
    spec: str
    """The spec, with file paths made absolute."""


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)[:300]


def model_kind(spec: str) -> str:
    """'pt2', 'factory' or 'pickle' for a model spec (no file is read)."""
    if spec.endswith(".pt2"):
        return "pt2"
    head, sep, tail = spec.rpartition(":")
    if sep and tail.isidentifier() and (head.endswith(".py") or re.fullmatch(r"[A-Za-z_][\w.]*", head)):
        return "factory"
    return "pickle"


@contextlib.contextmanager
def _quiet_torch_export() -> Iterator[None]:
    """torch.export.load logs a traceback before it retries a file; keep our one-line errors clean."""
    logger = logging.getLogger("torch.export")
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def _load_pt2(path: Path) -> tuple[torch.nn.Module, Any]:
    if not zipfile.is_zipfile(path):
        raise InputError(f"model file {str(path)!r} is not a torch.export archive (.pt2)")
    try:
        with _quiet_torch_export():
            ep = torch.export.load(path)
    except Exception as e:  # noqa: BLE001 - corrupt or foreign archive
        raise InputError(f"model file {str(path)!r} cannot be loaded with torch.export.load: {_first_line(e)}") from None
    module = ep.module()
    # ep.module() refuses train()/eval(); the graph keeps the mode it was exported in, so plain
    # flag-setting (nn.Module's own methods) is what capture and verify need.
    for attr in ("train", "eval"):
        if attr in module.__dict__:
            delattr(module, attr)
    example = getattr(ep, "example_inputs", None)
    if example is not None:
        args, kwargs = example
        example = dict(kwargs) if kwargs and not args else tuple(args) if not kwargs else None
    return module, example


@contextlib.contextmanager
def _on_path(directory: str) -> Iterator[None]:
    sys.path.insert(0, directory)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(directory)


def _load_factory(spec: str) -> tuple[torch.nn.Module, Any, str]:
    head, _, name = spec.rpartition(":")
    if head.endswith(".py"):
        path = Path(head).resolve()
        if not path.is_file():
            raise InputError(f"model spec {spec!r}: file {head!r} does not exist")
        mod_name = f"_ckpt_planner_factory_{abs(hash(str(path)))}"
        ctx: contextlib.AbstractContextManager = _on_path(str(path.parent))
        resolved = f"{path}:{name}"
    else:  # like `python -m`, the working directory is importable
        path, mod_name, ctx, resolved = None, head, _on_path(os.getcwd()), spec
    with ctx:
        try:
            if path is not None:
                ispec = importlib.util.spec_from_file_location(mod_name, path)
                module = importlib.util.module_from_spec(ispec)
                ispec.loader.exec_module(module)
            else:
                module = importlib.import_module(head)
        except Exception as e:  # noqa: BLE001 - the user's code; report its first line
            raise InputError(f"model spec {spec!r}: importing {head!r} failed: {_first_line(e)}") from None
        factory = getattr(module, name, None)
        if not callable(factory):
            raise InputError(f"model spec {spec!r}: {head!r} has no callable {name!r}")
        try:
            made = factory()
        except Exception as e:  # noqa: BLE001
            raise InputError(f"model spec {spec!r}: {name}() raised {_first_line(e)}") from None
    example = None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        made, example = made
    if not isinstance(made, torch.nn.Module):
        raise InputError(f"model spec {spec!r}: {name}() returned {type(made).__name__}, not an nn.Module or (model, inputs)")
    return made, example, resolved


def load_model(spec: str, *, trust_pickle: bool = False) -> LoadedModel:
    """Load the model a spec names (see the module docstring). Errors are InputError naming the spec."""
    kind = model_kind(spec)
    if kind == "factory":
        model, example, resolved = _load_factory(spec)
        return LoadedModel(model, example, kind, resolved)
    path = Path(spec)
    if not path.is_file():
        raise InputError(f"model file {spec!r} does not exist")
    if kind == "pt2":
        model, example = _load_pt2(path)
        return LoadedModel(model, example, kind, str(path.resolve()))
    if not trust_pickle:
        raise InputError(
            f"model file {spec!r} is a pickle (torch.save); loading it runs code from the file, "
            "so pass --trust-pickle if you trust it, or give a .pt2 (torch.export.save) or a file.py:factory spec"
        )
    try:
        model = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - corrupt or foreign file
        raise InputError(f"model file {spec!r} cannot be unpickled: {_first_line(e)}") from None
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"model file {spec!r} holds a {type(model).__name__}, not an nn.Module")
    return LoadedModel(model, None, kind, str(path.resolve()))


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
    elif isinstance(recorded.get("inputs"), list):
        specs = [parse_input_spec(s) for s in recorded["inputs"]]
        inputs, record["inputs"] = make_inputs(specs, seed=int(recorded.get("seed", 0))), list(recorded["inputs"])
    elif recorded.get("inputs_file"):
        inputs, record["inputs_file"] = load_inputs_file(recorded["inputs_file"]), recorded["inputs_file"]
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


def _to(value: Any, device: str) -> Any:
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


# -- apply output -----------------------------------------------------------


@dataclass(frozen=True)
class Applied:
    """A checkpointed module loaded back from an `apply` folder."""

    module: torch.nn.Module
    """The checkpointed module; trains like the original (same parameters)."""
    model: torch.nn.Module
    """The original model it was built from, with the saved state loaded."""
    plan: Any
    """The Plan (ckpt_planner.plan.Plan)."""
    example_inputs: Any
    """The example inputs the plan was made for."""


def write_applied(out: str | os.PathLike, *, loaded: LoadedModel, plan: Any, example_inputs: Any) -> Path:
    """Write an `apply` folder atomically: manifest, plan, state dict, inputs, generated code, load.py.

    `plan.module` must be built. An existing `apply` folder at `out` is replaced; any other
    existing non-empty path is refused.
    """
    out = Path(out)
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / "manifest.json").is_file())):
        raise InputError(f"output {str(out)!r} exists and is not an empty folder or an earlier apply output")
    parent = out.parent if str(out.parent) else Path(".")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=parent))
    try:
        model_spec = loaded.spec
        if loaded.kind in ("pt2", "pickle"):  # copy the file: the folder is self-contained
            local = "model.pt2" if loaded.kind == "pt2" else "model.pt"
            shutil.copyfile(loaded.spec, tmp / local)
            model_spec = local
        module = plan.module
        torch.save({k: v.detach().cpu() for k, v in module.state_dict().items()}, tmp / "state_dict.pt")
        torch.save(_to(example_inputs, "cpu"), tmp / "inputs.pt")
        plan.save(tmp / "plan.json")
        code = tmp / "code"
        code.mkdir()
        (code / "module.py").write_text(module.code)
        for name, sub in module.named_modules():
            if type(sub).__name__ == "CheckpointRegion":
                (code / f"{name}.py").write_text(sub.code)
        manifest = {
            "format": APPLIED_FORMAT,
            "version": APPLIED_VERSION,
            "model": model_spec,
            "model_kind": loaded.kind,
            "cwd": os.getcwd(),  # where a package.module:factory spec was importable from
            "fingerprint": plan.fingerprint,
            "files": {"plan": "plan.json", "state_dict": "state_dict.pt", "inputs": "inputs.pt", "code": "code/"},
        }
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
        (tmp / "load.py").write_text(_LOAD_PY)
        old = None
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}-old-", dir=parent))
            os.replace(out, old / "prev")
        os.replace(tmp, out)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_applied(path: str | os.PathLike, *, trust_pickle: bool = False) -> Applied:
    """Rebuild the checkpointed module from an `apply` folder.

    The model is loaded from its spec, its saved state dict is loaded into it
    (weights_only=True), and the plan is rebuilt on it (Plan.rebuild checks the
    graph's fingerprint). A folder holding a pickled model needs trust_pickle=True.
    """
    from .plan import Plan

    folder = Path(path)
    manifest_path = folder / "manifest.json"
    if not manifest_path.is_file():
        raise InputError(f"apply folder {str(folder)!r} has no manifest.json")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"apply folder {str(folder)!r}: manifest.json is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != APPLIED_FORMAT:
        raise InputError(f"apply folder {str(folder)!r}: manifest.json is not a ckpt-planner apply manifest")
    spec = str(manifest["model"])
    if manifest.get("model_kind") in ("pt2", "pickle"):
        spec = str(folder / spec)
    with _on_path(str(manifest.get("cwd", "."))):
        loaded = load_model(spec, trust_pickle=trust_pickle)
    try:
        state = torch.load(folder / "state_dict.pt", map_location="cpu", weights_only=True)
        inputs = torch.load(folder / "inputs.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001
        raise InputError(f"apply folder {str(folder)!r}: cannot read its tensors: {_first_line(e)}") from None
    model = loaded.model
    model.load_state_dict(state)
    plan = Plan.load(folder / "plan.json")
    module = plan.rebuild(model, inputs)
    return Applied(module=module, model=model, plan=plan, example_inputs=inputs)


_LOAD_PY = '''"""Load the checkpointed module in this folder (written by `ckpt-planner apply`).

    from load import load            # with this folder on sys.path
    module = load().module           # trains like the original model, same parameters
    python load.py                   # one training step, prints the loss
"""

from pathlib import Path

from ckpt_planner.loading import load_applied

HERE = Path(__file__).resolve().parent


def load(trust_pickle: bool = False):
    """The Applied record: .module (checkpointed), .model, .plan, .example_inputs."""
    return load_applied(HERE, trust_pickle=trust_pickle)


if __name__ == "__main__":
    import sys

    from ckpt_planner.capture import normalize_inputs
    from ckpt_planner.verify import default_loss

    applied = load(trust_pickle="--trust-pickle" in sys.argv)
    args, kwargs = normalize_inputs(applied.example_inputs)
    loss = default_loss(applied.module(*args, **kwargs))
    loss.backward()
    print(f"loaded {type(applied.model).__name__} with {len(applied.plan.regions)} checkpointed regions; "
          f"one training step: loss {loss.item():.6g}")
'''

"""The command line's model loading: a `.pt2` (read safely, see archive.py), a `file.py:factory` or
`package.module:factory`, or a pickled module (only with `trust_pickle`). Read by loading.py (models with
their inputs) and by applied.py (the model an apply folder names), so neither imports the other."""


from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import re
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..capture.pt2.archive import load_pt2_safely
from ..errors import InputError

__all__ = ["LoadedModel", "load_model", "model_kind"]


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
    """'pt2', 'factory' or 'pickle' for a model spec.

    An existing file is a file even when its name looks like ``module:factory``
    (``checkpoint:latest``): it is never imported as code.
    """
    if spec.endswith(".pt2") or (Path(spec).is_file() and zipfile.is_zipfile(spec) and _is_pt2_zip(spec)):
        return "pt2"
    if Path(spec).is_file():
        return "pickle"
        return "pt2"
    head, sep, tail = spec.rpartition(":")
    if sep and tail.isidentifier() and (head.endswith(".py") or re.fullmatch(r"[A-Za-z_][\w.]*", head)):
        return "factory"
    return "pickle"


def _is_pt2_zip(path: str) -> bool:
    with contextlib.suppress(OSError, zipfile.BadZipFile), zipfile.ZipFile(path) as z:
        return any(n == "archive_format" or n.endswith("/archive_format") for n in z.namelist())
    return False


def _load_pt2(path: Path, *, trust_pickle: bool = False) -> tuple[torch.nn.Module, Any]:
    ep = load_pt2_safely(path, trust_pickle=trust_pickle)
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
        except SystemExit as e:  # the user's module called sys.exit() while imported
            raise InputError(f"model spec {spec!r}: importing {head!r} called sys.exit({e.code!r})") from None
        factory = getattr(module, name, None)
        if not callable(factory):
            raise InputError(f"model spec {spec!r}: {head!r} has no callable {name!r}")
        try:
            made = factory()
        except Exception as e:  # noqa: BLE001
            raise InputError(f"model spec {spec!r}: {name}() raised {_first_line(e)}") from None
        except SystemExit as e:  # a factory that exits would end the command with its code and no word
            raise InputError(f"model spec {spec!r}: {name}() called sys.exit({e.code!r})") from None
    example = None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        made, example = made
    if not isinstance(made, torch.nn.Module):
        raise InputError(f"model spec {spec!r}: {name}() returned {type(made).__name__}, not an nn.Module or (model, inputs)")
    return made, example, resolved


def load_model(spec: str, *, trust_pickle: bool = False, kind: str | None = None) -> LoadedModel:
    """Load the model a spec names (see the module docstring). Errors are InputError naming the spec.

    `kind` ('pt2', 'factory' or 'pickle') overrides what `model_kind` infers from the spec.
    """
    kind = kind or model_kind(spec)
    if kind == "factory":
        model, example, resolved = _load_factory(spec)
        return LoadedModel(model, example, kind, resolved)
    path = Path(spec)
    if not path.is_file():
        raise InputError(f"model file {spec!r} does not exist")
    if kind == "pt2":
        model, example = _load_pt2(path, trust_pickle=trust_pickle)
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

"""The folder `ckpt-planner apply` writes, and loading it back without running code you did not agree to.

A folder holds ``manifest.json`` (format ``ckpt-planner/applied``), the plan,
the state dict and example inputs (loaded with ``weights_only=True``), the
generated code (for reading; it is never executed: the module is rebuilt from
the plan), ``load.py``, and, for a `.pt2` or pickled model, a copy of the model
file as ``model.pt2`` / ``model.pt``.

What loading trusts (`load_applied`):

* a ``.pt2`` model is read only from ``model.pt2`` inside the folder, and
  refused when it holds pickled members (see `archive.py`) unless
  ``trust_pickle=True``;
* a pickled model (``model.pt`` inside the folder) needs ``trust_pickle=True``;
* a ``file.py:factory`` / ``package.module:factory`` model is code: it runs
  only with ``trust_code=True``, from the absolute path or module name the
  manifest records; the recorded working directory goes at the end of
  ``sys.path`` (it can never shadow an installed or standard module);
* every other file is a fixed name inside the folder; a path or link leading
  out of it is refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError, OutputError
from ..plan_schema import read_bounded
from .legacy import refresh_load_script
from .outputs import digests, foreign_files, remove_written

__all__ = ["APPLIED_FORMAT", "Applied", "is_applied_folder", "write_applied", "load_applied"]

APPLIED_FORMAT = "ckpt-planner/applied"
APPLIED_VERSION = 1
_MODEL_FILES = {"pt2": "model.pt2", "pickle": "model.pt"}
MAX_MANIFEST_BYTES = 16 << 20
"""An apply manifest's size limit: it holds a few names and one digest per file written."""


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


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    """The folder's manifest when it is one of ours (format key), else None."""
    raw = read_bounded(folder / "manifest.json", MAX_MANIFEST_BYTES)  # no link followed, nothing unbounded
    if raw is None:
        return None
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):  # ValueError: JSON, or a 5,000-digit number
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == APPLIED_FORMAT else None


def is_applied_folder(path: str | os.PathLike) -> bool:
    """True for a real folder (not a link) whose manifest.json is an `apply` manifest."""
    p = Path(path)
    return p.is_dir() and not p.is_symlink() and _read_manifest(p) is not None


def check_output_folder(out: Path) -> None:
    """Refuse an output that exists and is neither an empty folder nor an earlier `apply` folder holding
    only files apply wrote, unchanged."""
    if out.is_symlink() or (out.exists() and not (out.is_dir() and (not any(out.iterdir()) or is_applied_folder(out)))):
        raise InputError(
            f"output folder {str(out)!r} exists and is not an empty folder or an earlier ckpt-planner apply output "
            "(its manifest.json has no ckpt-planner format key); choose another folder"
        )
    refusal = _refusal(out, out) if out.exists() else None
    if refusal is not None:
        raise refusal


def _shown(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _refusal(out: Path, folder: Path) -> OutputError | None:
    """Why `folder` (the output `out`, or where it was moved aside) may not be replaced, or None: it is
    empty, or an apply folder holding only the files apply wrote, unchanged."""
    if folder.is_symlink() or not folder.is_dir():
        return OutputError(f"output folder {str(out)!r} stopped being a folder while apply ran; it was left as it is")
    manifest = _read_manifest(folder)
    if manifest is None:
        entries = sorted(p.name for p in folder.iterdir())
        if not entries:
            return None
        return OutputError(
            f"output folder {str(out)!r} is not empty (it holds {_shown(entries)}) and is not an earlier "
            "ckpt-planner apply output; it was left as it is: choose another folder"
        )
    if not isinstance(manifest.get("written"), dict):
        return OutputError(
            f"output folder {str(out)!r} is an apply output of an earlier release, which recorded no digests of "
            "the files it wrote, so they cannot be told from yours; it was left as it is: move out what you keep "
            "and delete it, or choose another folder"
        )
    theirs = foreign_files(folder, manifest)
    if theirs:
        return OutputError(
            f"output folder {str(out)!r} is an earlier apply output holding files apply did not write or that "
            f"changed since ({_shown(theirs)}); replacing it would delete them: move them out or choose another folder"
        )
    return None


def _to_cpu(value: Any) -> Any:
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, value)


def _swap_into_place(tmp: Path, out: Path, parent: Path) -> None:
    """Rename `tmp` to `out`. An existing `out` is first moved aside, so nothing can land in it any more,
    and judged again there: files that appeared since the command's first check (or a folder that changed)
    put it back and refuse. After the swap, only what apply wrote is deleted from the old folder."""
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}-old-", dir=parent))
    prev = aside / "prev"
    try:
        os.replace(out, prev)
    except FileNotFoundError:  # no earlier folder: a non-empty one made meanwhile refuses the rename (ENOTEMPTY)
        aside.rmdir()
        try:
            os.replace(tmp, out)
        except OSError as e:
            raise OutputError(f"output folder {str(out)!r} appeared while apply ran and could not be replaced "
                              f"({e.strerror or e}); it was left as it is") from None
        return
    except BaseException:
        aside.rmdir()
        raise
    refusal = _refusal(out, prev)
    if refusal is not None:
        _put_back(prev, out, aside)
        raise refusal
    try:
        os.replace(tmp, out)
    except BaseException as e:
        _put_back(prev, out, aside)
        if isinstance(e, OSError):
            raise InputError(
                f"output folder {str(out)!r}: the new folder could not be moved into place ({e.strerror or e}); "
                "the previous folder was left as it was"
            ) from None
        raise
    manifest = _read_manifest(prev) or {}
    if remove_written(prev, manifest):
        aside.rmdir()
        return
    # Something landed in the old folder after it was judged (through a handle opened before): kept, visible.
    kept = Path(tempfile.mkdtemp(prefix=f"{out.name}.kept-", dir=parent))
    os.replace(prev, kept)
    aside.rmdir()
    raise OutputError(f"output folder {str(out)!r} was written; files that appeared in the folder it replaced while "
                      f"apply ran were kept in {str(kept)!r}")


def _put_back(prev: Path, out: Path, aside: Path) -> None:
    """Move the earlier folder back to `out` (InputError naming where it is if that fails)."""
    try:
        os.replace(prev, out)
    except OSError as e:
        raise InputError(
            f"output folder {str(out)!r}: the previous folder could not be restored ({e.strerror or e}); "
            f"it is at {str(prev)!r}"
        ) from None
    aside.rmdir()


def write_applied(out: str | os.PathLike, *, loaded: Any, plan: Any, example_inputs: Any) -> Path:
    """Write an `apply` folder atomically: manifest, plan, state dict, inputs, generated code, load.py.

    `loaded` is a `loading.LoadedModel`; `plan.module` must be built. The
    folder is written beside `out` and renamed into place. Only an empty folder
    or an earlier `apply` folder (its manifest has our format key) is replaced;
    if the final rename fails the earlier folder is restored.
    """
    out = Path(out)
    check_output_folder(out)
    parent = out.parent if str(out.parent) else Path(".")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=parent))
    try:
        model_spec = loaded.spec
        if loaded.kind in _MODEL_FILES:  # copy the file: the folder is self-contained
            model_spec = _MODEL_FILES[loaded.kind]
            shutil.copyfile(loaded.spec, tmp / model_spec)
        module = plan.module
        torch.save({k: v.detach().cpu() for k, v in module.state_dict().items()}, tmp / "state_dict.pt")
        torch.save(_to_cpu(example_inputs), tmp / "inputs.pt")
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
            "fingerprint": plan.fingerprint,
            "files": {"plan": "plan.json", "state_dict": "state_dict.pt", "inputs": "inputs.pt", "code": "code/"},
        }
        if loaded.kind == "factory" and not model_spec.rpartition(":")[0].endswith(".py"):
            manifest["cwd"] = os.getcwd()  # where a package.module:factory spec was importable from
        (tmp / "load.py").write_text(_LOAD_PY)
        manifest["written"] = digests(tmp)  # a later apply -o replaces only these, unchanged
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2))
        _swap_into_place(tmp, out, parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) or (isinstance(e, RuntimeError) and "write" in str(e)):  # torch.save's writer
            first = next((ln for ln in str(e.strerror if isinstance(e, OSError) else e).splitlines() if ln.strip()), "")
            raise OutputError(f"output folder {str(out)!r} could not be written ({first[:200]}); nothing was "
                              "written and an earlier folder there was left as it was") from None
        raise
    return out


def _inside(folder: Path, name: str, what: str) -> Path:
    """`folder/name`, refused unless it is a regular file that stays inside the folder."""
    root = folder.resolve()
    path = root / name
    if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts:
        raise InputError(f"apply folder {str(folder)!r}: {what} {name!r} is not a file name inside the folder")
    if path.is_symlink() or not path.resolve().is_relative_to(root) or not path.is_file():
        raise InputError(f"apply folder {str(folder)!r}: {what} {name!r} is missing or leads outside the folder")
    return path


@contextlib.contextmanager
def _at_end_of_path(directory: str | None) -> Iterator[None]:
    added = directory is not None and directory not in sys.path
    if added:
        sys.path.append(directory)
    try:
        yield
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(directory)


def _load_model(folder: Path, manifest: dict[str, Any], *, trust_pickle: bool, trust_code: bool) -> Any:
    from .models import load_model

    kind, spec = manifest.get("model_kind"), manifest.get("model")
    if not isinstance(spec, str):
        raise InputError(f"apply folder {str(folder)!r}: manifest.json has no model")
    if kind in _MODEL_FILES:
        if spec != _MODEL_FILES[kind]:
            raise InputError(
                f"apply folder {str(folder)!r}: manifest names model {spec!r}; a {kind} model is read only from "
                f"{_MODEL_FILES[kind]!r} inside the folder"
            )
        return load_model(str(_inside(folder, spec, "model")), trust_pickle=trust_pickle, kind=kind)
    if kind != "factory":
        raise InputError(f"apply folder {str(folder)!r}: manifest.json has an unknown model_kind {str(kind)[:40]!r}")
    if not trust_code:
        raise InputError(
            f"apply folder {str(folder)!r}: its model is the factory {spec[:200]!r}, which is code; "
            "loading it runs that code, so pass trust_code=True (load.py: --trust-code) only if you trust it"
        )
    head = spec.rpartition(":")[0]
    if head.endswith(".py") and not Path(head).is_absolute():
        raise InputError(f"apply folder {str(folder)!r}: factory file {head!r} is not the absolute path apply records")
    cwd = manifest.get("cwd")
    with _at_end_of_path(cwd if isinstance(cwd, str) else None):
        return load_model(spec, kind="factory")


def load_applied(path: str | os.PathLike, *, trust_pickle: bool = False, trust_code: bool = False) -> Applied:
    """Rebuild the checkpointed module from an `apply` folder; runs no code without consent.

    The model is loaded as the manifest says (see the module docstring: a
    `.pt2` copy inside the folder, pickled members refused unless
    ``trust_pickle=True``; a pickled model only with ``trust_pickle=True``; a
    factory only with ``trust_code=True``), its saved state dict is loaded into
    it (weights_only=True), and the plan is rebuilt on it (Plan.rebuild checks
    the graph's fingerprint). Every file is read from a fixed name inside the
    folder. Errors are InputError naming the folder and the file.
    """
    from ..plan import Plan

    folder = Path(path)
    if not (folder / "manifest.json").is_file():
        raise InputError(f"apply folder {str(folder)!r} has no manifest.json")
    manifest = _read_manifest(folder)
    if manifest is None:
        raise InputError(f"apply folder {str(folder)!r}: manifest.json is not a ckpt-planner apply manifest")
    loaded = _load_model(folder, manifest, trust_pickle=trust_pickle, trust_code=trust_code)
    try:
        state = torch.load(_inside(folder, "state_dict.pt", "file"), map_location="cpu", weights_only=True)
        inputs = torch.load(_inside(folder, "inputs.pt", "file"), map_location="cpu", weights_only=True)
    except InputError:
        raise
    except Exception as e:  # noqa: BLE001
        first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)[:300]
        raise InputError(f"apply folder {str(folder)!r}: cannot read its tensors: {first}") from None
    model = loaded.model
    model.load_state_dict(state)
    plan = Plan.load(_inside(folder, "plan.json", "file"))
    module = plan.rebuild(model, inputs)
    # loaded: only now is an earlier release's load.py (it imports paths that are gone) replaced
    refresh_load_script(folder, manifest, _LOAD_PY)
    return Applied(module=module, model=model, plan=plan, example_inputs=inputs)


_LOAD_PY = '''"""Load the checkpointed module in this folder (written by `ckpt-planner apply`).

    from load import load            # with this folder on sys.path
    module = load().module           # trains like the original model, same parameters
    python load.py                   # one training step, prints the loss

A model given as a factory (file.py:make) is code: pass --trust-code (trust_code=True)
to run it; a pickled model needs --trust-pickle (trust_pickle=True).
"""

from pathlib import Path

from ckpt_planner.cli.loading import load_applied  # the one module this script imports: its names stay put

HERE = Path(__file__).resolve().parent


def load(trust_pickle: bool = False, trust_code: bool = False):
    """The Applied record: .module (checkpointed), .model, .plan, .example_inputs."""
    return load_applied(HERE, trust_pickle=trust_pickle, trust_code=trust_code)


if __name__ == "__main__":
    import sys

    from ckpt_planner.cli.loading import default_loss, normalize_inputs

    try:
        applied = load(trust_pickle="--trust-pickle" in sys.argv, trust_code="--trust-code" in sys.argv)
    except ValueError as e:  # the planner's input and plan-file errors: one line, exit 2
        print(f"load.py: {e}", file=sys.stderr)
        sys.exit(2)
    args, kwargs = normalize_inputs(applied.example_inputs)
    loss = default_loss(applied.module(*args, **kwargs))
    loss.backward()
    print(f"loaded {type(applied.model).__name__} with {len(applied.plan.regions)} checkpointed regions; "
          f"one training step: loss {loss.item():.6g}")
'''

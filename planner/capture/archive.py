"""Loading a `torch.export` archive (.pt2) without running code hidden in it.

`torch.export.load` (torch 2.13, `torch/export/pt2_archive/_package.py`) reads
some members with plain pickle, which runs whatever code the file carries:

* a weight or tensor constant whose entry in
  ``data/weights/<model>_weights_config.json`` /
  ``data/constants/<model>_constants_config.json`` says ``use_pickle: true``
  (`torch.load(..., weights_only=False)`);
* constants named ``custom_obj_*`` (TorchScript objects) or ``opaque_obj_*``
  (`pickle.loads`);
* the legacy weights / constants files ``data/weights/<model>.pt`` and
  ``data/constants/<model>.pt``, and the sample inputs
  ``data/sample_inputs/<model>.pt``, which `torch._export.serde` loads with
  ``weights_only=True`` and, when that fails, again with ``weights_only=False``;
* AOTInductor members (``data/aotinductor/``): compiled shared libraries;
* archives of the older, pre-2.8 layout (no ``archive_format`` member), read
  through the same fallback.

`load_pt2_safely` reads the archive once into memory, lists its members with
the same reader torch uses (`torch._C.PyTorchFileReader`, which strips the
archive's root folder), refuses the file when any member above would run code,
and hands the very same bytes to `torch.export.load`, so the file cannot change
between the check and the load. ``trust_pickle=True`` skips the check.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..errors import InputError

__all__ = ["unsafe_members", "load_pt2_safely"]

_WEIGHTS_DIR = "data/weights/"
_CONSTANTS_DIR = "data/constants/"
_SAMPLE_INPUTS = "data/sample_inputs/{}.pt"
_MODELS_DIR = "models/"
_AOTI_DIR = "data/aotinductor/"


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)[:300]


def _loads_weights_only(data: bytes) -> bool:
    """True when `torch.load(weights_only=True)` reads these bytes (torch then never falls back)."""
    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - any failure means torch would retry with weights_only=False
        return False
    return True


def _config(reader: Any, name: str) -> dict[str, Any]:
    try:
        data = json.loads(reader.get_record(name).decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, RuntimeError) as e:
        raise InputError(f"archive member {name!r} is not valid JSON ({_first_line(e)})") from None
    config = data.get("config") if isinstance(data, dict) else None
    if not isinstance(config, dict) or not all(isinstance(v, dict) for v in config.values()):
        raise InputError(f"archive member {name!r} is not a torch.export payload config")
    return config


def unsafe_members(data: bytes) -> list[str]:
    """Members of a .pt2 archive (its bytes) that `torch.export.load` would unpickle or execute.

    Raises InputError when the bytes are not an archive at all.
    """
    if not zipfile.is_zipfile(io.BytesIO(data)):
        raise InputError("not a torch.export archive (.pt2): not a zip file")
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        # torch.export.load retries any archive it fails to read as the older layout, whose
        # top-level `version` member leads to pickled state dicts, constants and inputs.
        if "version" in z.namelist():
            return ["version (an older torch.export layout, read with pickle)"]
    try:
        reader = torch._C.PyTorchFileReader(io.BytesIO(data))
        names = set(reader.get_all_records())
    except RuntimeError as e:
        raise InputError(f"not a readable torch.export archive: {_first_line(e)}") from None
    if "archive_format" not in names or reader.get_record("archive_format").decode(errors="replace") != "pt2":
        return ["the whole archive (an older torch.export layout, read with pickle)"]
    found: list[str] = []
    models = sorted(n[len(_MODELS_DIR):-len(".json")] for n in names if n.startswith(_MODELS_DIR) and n.endswith(".json"))
    for model in models:
        for legacy in (f"{_WEIGHTS_DIR}{model}.pt", f"{_CONSTANTS_DIR}{model}.pt"):
            if legacy in names and not _loads_weights_only(reader.get_record(legacy)):
                found.append(f"{legacy} (not loadable with weights_only=True)")
        weights = f"{_WEIGHTS_DIR}{model}_weights_config.json"
        if weights in names:
            for fqn, meta in _config(reader, weights).items():
                if meta.get("use_pickle"):
                    found.append(f"weight {fqn!r} ({_WEIGHTS_DIR}{meta.get('path_name')}, use_pickle)")
        constants = f"{_CONSTANTS_DIR}{model}_constants_config.json"
        if constants in names:
            for fqn, meta in _config(reader, constants).items():
                path = str(meta.get("path_name", ""))
                if meta.get("use_pickle") or path.startswith(("custom_obj_", "opaque_obj_")):
                    found.append(f"constant {fqn!r} ({_CONSTANTS_DIR}{path}, pickled object)")
        sample = _SAMPLE_INPUTS.format(model)
        if sample in names and not _loads_weights_only(reader.get_record(sample)):
            found.append(f"{sample} (sample inputs not loadable with weights_only=True)")
    if any(n.startswith(_AOTI_DIR) for n in names):
        found.append(f"{_AOTI_DIR} (compiled AOTInductor libraries)")
    return found


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


def load_pt2_safely(path: str | os.PathLike, *, trust_pickle: bool = False) -> Any:
    """`torch.export.load(path)`, refusing an archive that would unpickle or execute code (see module doc).

    Errors are InputError naming the file; pickled members are listed, and the
    message says that ``--trust-pickle`` (API: ``trust_pickle=True``) loads it anyway.
    """
    p = Path(path)
    label = repr(str(p))
    try:
        data = p.read_bytes()
    except OSError as e:
        raise InputError(f"model file {label} cannot be read ({e.strerror})") from None
    if not trust_pickle:
        try:
            unsafe = unsafe_members(data)
        except InputError as e:
            raise InputError(f"model file {label}: {e}") from None
        if unsafe:
            shown = "; ".join(unsafe[:3]) + (f"; and {len(unsafe) - 3} more" if len(unsafe) > 3 else "")
            raise InputError(
                f"model file {label} holds members that torch.export.load would unpickle or execute ({shown}); "
                "loading it runs code from the file, so pass --trust-pickle (trust_pickle=True) only if you trust it"
            )
    elif not zipfile.is_zipfile(io.BytesIO(data)):
        raise InputError(f"model file {label} is not a torch.export archive (.pt2)")
    try:
        with quiet_torch_export():
            return torch.export.load(io.BytesIO(data))
    except Exception as e:  # noqa: BLE001 - corrupt or foreign archive
        raise InputError(f"model file {label} cannot be loaded with torch.export.load: {_first_line(e)}") from None

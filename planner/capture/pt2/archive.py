"""Loading a `torch.export` archive (.pt2) from a source you do not trust, without running code from it.

`torch.export.load` (torch 2.13, `torch/export/pt2_archive/_package.py`) runs
code a crafted archive carries in several ways:

* it loads every member under ``models/`` as a model (the name is the member's
  name less its last five characters), each with its own weights, constants
  and sample inputs;
* it unpickles weights and tensor constants marked ``use_pickle`` with
  ``weights_only=False``, constants named ``custom_obj_*`` / ``opaque_obj_*``
  with plain pickle, legacy ``data/weights/<model>.pt`` files, and sample
  inputs ``data/sample_inputs/<model>.pt``, which it retries with
  ``weights_only=False`` when ``weights_only=True`` fails;
* it loads AOTInductor libraries (``data/aotinductor/``) and, for archives of
  the older layout (a top-level ``version``), pickled state dicts;
* it hands every size expression of the serialized graph (``expr_str``) to
  ``sympy.sympify``, which evaluates it as Python;
* it inflates every member it reads, whatever its size.

`load_pt2_safely` opens only a regular file no larger than memory allows, and
refuses one that does not end with a zip end record before reading the rest; it
reads the file once, and before torch sees the bytes:

* the archive must be laid out so that torch's reader and Python's `zipfile`
  read the same members from the same bytes (`zipcheck.py`): the central
  directory where the end record states it, no archive comment, no data before
  the first member, no two members overlapping, every name UTF-8, and each
  member's data where torch's reader finds it;
* every member must be on an allowlist (`_classify`): the one model
  ``models/model.json`` that `torch.export.save` writes, its weights and
  constants configs, the raw tensor files those configs name (never pickled),
  its sample inputs (loadable with ``weights_only=True``; when they are a
  ``torch.save`` zip, that zip passes the same layout checks and its inflated
  sizes count against the same caps before ``torch.load`` sees it), the archive's
  small format files and ``extra/`` text; anything else is refused;
* every ``expr_str`` and range-constraint symbol must follow the grammar of
  `symexpr.py` (parsed with `ast`, never evaluated);
* each member's inflated size is capped by its kind and the total by
  `MAX_TOTAL_BYTES`; compressed members may inflate by `MAX_INFLATION_BYTES`
  in all (`torch.export.save` stores every member uncompressed); the caps are
  checked on the zip headers and again while reading, since headers can lie.

torch then loads the very same bytes with ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` set,
so even a fallback to ``weights_only=False`` inside torch cannot unpickle code.
``trust_pickle=True`` skips the allowlist and the grammar (the layout checks and
the size caps stay). `open_torch_save_file` applies the layout checks and caps
to a ``torch.save`` file (the command line's ``--inputs``) before it is loaded.
The custom operators the graph calls are registered by their installed library
first (`custom_ops.py`); a load that fails is told in one line (`load_errors.py`).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch

from ...errors import InputError
from .custom_ops import graph_operators, register_operators
from .load_errors import load_failure, logged_errors, quiet_torch_export
from .symexpr import ExprError, check_expr, check_symbol_name
from .zipcheck import MAX_MEMBERS, ZIP_MAGIC, LayoutError, end_record, memory_bytes, open_regular, open_zip

__all__ = ["MAX_MEMBERS", "unsafe_members", "load_pt2_safely", "open_torch_save_file", "memory_bytes"]

MAX_SMALL_BYTES = 1024
"""archive_format, archive_version, byteorder, .data/version, .data/serialization_id."""
MAX_JSON_BYTES = 512 << 20
"""The serialized graph and the weights / constants configs, each."""
MAX_EXTRA_BYTES = 16 << 20
"""Each ``extra/`` text member."""
MAX_SAMPLE_INPUTS_BYTES = 4 << 30
MAX_MEMBER_BYTES = 64 << 30
"""Any other member (a raw weight or constant)."""
MAX_TOTAL_BYTES = 256 << 30
"""All members together, inflated."""
MAX_INFLATION_BYTES = 256 << 20
"""Bytes all compressed members together may add when inflated."""
MAX_JSON_DEPTH = 200

_MODEL = "model"  # torch.export.save writes one model, and torch.export.load returns only this one
_SMALL = {"archive_format", "archive_version", ".data/version", "byteorder", ".data/serialization_id"}
_GRAPH = f"models/{_MODEL}.json"
_WEIGHTS_CONFIG = f"data/weights/{_MODEL}_weights_config.json"
_CONSTANTS_CONFIG = f"data/constants/{_MODEL}_constants_config.json"
_SAMPLE_INPUTS = f"data/sample_inputs/{_MODEL}.pt"
_PAYLOAD_NAME = {"data/weights/": re.compile(r"weight_[0-9]{1,9}"), "data/constants/": re.compile(r"tensor_[0-9]{1,9}")}
_CHUNK = 1 << 20


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)[:300]


def _cap(inner: str) -> int:
    if inner in _SMALL:
        return MAX_SMALL_BYTES
    if inner.endswith(".json"):
        return MAX_JSON_BYTES
    if inner.startswith("extra/"):
        return MAX_EXTRA_BYTES
    if inner == _SAMPLE_INPUTS:
        return MAX_SAMPLE_INPUTS_BYTES
    return MAX_MEMBER_BYTES


def _check_sizes(infos: list[zipfile.ZipInfo], inner: dict[str, str]) -> int:
    """The caps on the headers' sizes (InputError naming the member); returns the bytes inflation adds."""
    total = inflation = 0
    worst = max(infos, key=lambda i: i.file_size - i.compress_size, default=None)
    for info in infos:
        name = inner[info.filename]
        if info.file_size > _cap(name):
            raise InputError(f"member {name!r} inflates to {info.file_size} bytes, over the {_cap(name)}-byte limit")
        if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
            raise InputError(f"member {name!r}: its header gives two sizes for an uncompressed member")
        total += info.file_size
        inflation += max(0, info.file_size - info.compress_size)
    if total > MAX_TOTAL_BYTES:
        raise InputError(f"members inflate to {total} bytes in all, over the {MAX_TOTAL_BYTES}-byte limit")
    if inflation > MAX_INFLATION_BYTES:
        raise InputError(
            f"compressed members inflate by {inflation} bytes in all ({inner[worst.filename]!r} from "
            f"{worst.compress_size} to {worst.file_size}), over the {MAX_INFLATION_BYTES}-byte limit "
            "(torch.export.save stores members uncompressed)"
        )
    return inflation


def _read(z: zipfile.ZipFile, info: zipfile.ZipInfo, name: str, *, cap: int | None = None, keep: bool = True) -> bytes:
    """A member's bytes (b"" unless `keep`), read in chunks and stopped past its header size or its cap
    (headers can lie)."""
    limit = min(info.file_size, _cap(name) if cap is None else cap)
    chunks, size = [], 0
    try:
        with z.open(info) as f:
            while chunk := f.read(_CHUNK):
                size += len(chunk)
                if size > limit:
                    raise InputError(f"member {name!r} inflates past the size its header gives ({info.file_size} bytes)")
                if keep:
                    chunks.append(chunk)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as e:
        raise InputError(f"member {name!r} cannot be read ({_first_line(e)})") from None
    return b"".join(chunks)


# -- torch.save archives and the file itself, checked before anything is read whole or inflated ---


def _check_torch_save(f: IO[bytes], size: int, cap: int, inflation_left: int) -> None:
    """A `torch.save` file, before `torch.load` inflates it (InputError): when it is a zip (torch.load's own
    test: its first bytes), the layout checks of `zipcheck.open_zip`, its members' inflated sizes at most `cap` in all, and
    what compressed members add at most `inflation_left`, on the headers and again by inflating them.
    Files in torch's older format are raw pickles and storages: nothing in them is compressed."""
    f.seek(0)
    if f.read(len(ZIP_MAGIC)) != ZIP_MAGIC:
        return
    z, infos, inner, _ = open_zip(f, size)
    with z:
        total = sum(i.file_size for i in infos)
        if total > cap:
            raise InputError(f"its members inflate to {total} bytes in all, over the {cap}-byte limit")
        inflation = 0
        for info in infos:
            if info.compress_type == zipfile.ZIP_STORED and info.file_size != info.compress_size:
                raise InputError(f"member {inner[info.filename][:80]!r}: its header gives two sizes for an "
                                 "uncompressed member")
            inflation += max(0, info.file_size - info.compress_size)
        if inflation > inflation_left:
            raise InputError(
                f"its compressed members inflate by {inflation} bytes, over the {inflation_left} bytes left of the "
                f"{MAX_INFLATION_BYTES}-byte limit on inflation (torch.save stores members uncompressed)"
            )
        for info in infos:
            if info.compress_type != zipfile.ZIP_STORED:
                _read(z, info, inner[info.filename], cap=info.file_size, keep=False)


def open_torch_save_file(path: str | os.PathLike) -> IO[bytes]:
    """A `torch.save` file opened for `torch.load`, checked first: a regular file that fits in memory and,
    when a zip, laid out and capped as `_check_torch_save` says. Errors are InputError, to be prefixed with
    what the file is."""
    f, size = open_regular(path)
    try:
        limit = memory_bytes()
        if limit is not None and size > limit:
            raise InputError(f"is {size} bytes, more than the {limit} bytes of memory this process may use; "
                             "give smaller inputs")
        try:
            _check_torch_save(f, size, cap=limit or MAX_TOTAL_BYTES, inflation_left=MAX_INFLATION_BYTES)
        except InputError as e:
            raise InputError(f"is not a torch.save file torch can read safely ({e}); write it again with torch.save") from None
        f.seek(0)
    except BaseException:
        f.close()
        raise
    return f


def _read_archive(path: str | os.PathLike) -> bytes:
    """The whole file, read once its size is known to fit in memory and its end to be a zip end record."""
    f, size = open_regular(path)
    with f:
        try:
            end_record(f, size)
        except InputError as e:
            if str(e) == "not a zip file" or str(e).startswith("not a zip file as"):
                raise InputError(f"not a torch.export archive (.pt2): {e}") from None
            raise
        limit = memory_bytes()
        if size > MAX_TOTAL_BYTES or (limit is not None and 2 * size > limit):
            raise InputError(
                f"the file is {size} bytes; loading it takes about twice that in memory, more than the "
                f"{min(limit or MAX_TOTAL_BYTES, MAX_TOTAL_BYTES)} bytes this process may use; load it where "
                "more memory is free"
            )
        f.seek(0)
        try:
            data = f.read(size + 1)
        except MemoryError:
            raise InputError(f"the file ({size} bytes) does not fit in memory") from None
        except OSError as e:
            raise InputError(f"cannot be read ({e.strerror})") from None
    if len(data) != size:
        raise InputError("the file changed size while it was read")
    return data


def _json(z: zipfile.ZipFile, info: zipfile.ZipInfo, name: str) -> Any:
    try:
        return json.loads(_read(z, info, name).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:
        raise InputError(f"member {name!r} is not valid JSON ({_first_line(e)})") from None


def _expressions(graph: Any) -> list[str]:
    """Problems with the graph's size expressions and range constraints (walked without recursion)."""
    found: list[str] = []
    stack: list[tuple[Any, int]] = [(graph, 0)]
    while stack and len(found) < 5:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return [f"{_GRAPH} nested deeper than {MAX_JSON_DEPTH} levels"]
        if isinstance(value, dict):
            for key, item in value.items():
                if key == "expr_str":
                    try:
                        check_expr(item)
                    except ExprError as e:
                        found.append(f"{_GRAPH}: size expression {str(item)[:60]!r} ({e}; torch would evaluate it as code)")
                elif key == "range_constraints" and isinstance(item, dict):
                    for symbol, bounds in item.items():
                        try:
                            check_symbol_name(symbol)
                            for end in ("min_val", "max_val"):
                                v = bounds.get(end) if isinstance(bounds, dict) else 0
                                if v is not None and (type(v) is not int or abs(v) >= 1 << 63):
                                    raise ExprError(f"{end} is not a 64-bit integer")
                        except ExprError as e:
                            found.append(f"{_GRAPH}: range constraint {str(symbol)[:40]!r} ({e})")
                else:
                    stack.append((item, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)
    return found


def _payloads(config: Any, name: str, directory: str) -> tuple[set[str], list[str]]:
    """(raw tensor files a weights/constants config names, its pickled or code entries)."""
    entries = config.get("config") if isinstance(config, dict) else None
    if not isinstance(entries, dict):
        raise InputError(f"member {name!r} is not a torch.export payload config")
    files: set[str] = set()
    bad: list[str] = []
    for fqn, meta in entries.items():
        path = meta.get("path_name") if isinstance(meta, dict) else None
        if not isinstance(path, str):
            raise InputError(f"member {name!r}: entry {str(fqn)[:60]!r} has no path_name")
        if meta.get("use_pickle") is not False or not isinstance(meta.get("tensor_meta"), dict):
            bad.append(f"{str(fqn)[:60]!r} in {name} ({directory}{path[:60]}, pickled)")
        elif not _PAYLOAD_NAME[directory].fullmatch(path):
            bad.append(f"{str(fqn)[:60]!r} in {name} ({directory}{path[:60]}, not a raw tensor file)")
        else:
            files.add(directory + path)
    return files, bad


def _sample_inputs(z: zipfile.ZipFile, by_name: dict[str, zipfile.ZipInfo], inflation_left: int) -> bytes:
    """The sample inputs' bytes; when they are a torch.save zip, checked as one before torch.load inflates
    them (InputError), with what the outer archive already inflates counted against the same limit."""
    data = _read(z, by_name[_SAMPLE_INPUTS], _SAMPLE_INPUTS)
    try:
        _check_torch_save(io.BytesIO(data), len(data), cap=MAX_SAMPLE_INPUTS_BYTES, inflation_left=inflation_left)
    except InputError as e:
        raise InputError(f"member {_SAMPLE_INPUTS!r} (a torch.save archive): {e}") from None
    return data


def _loads_weights_only(data: bytes) -> bool:
    """True when `torch.load(weights_only=True)` reads these bytes as torch's sample inputs (a tuple or dict)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the pickle protocol notice torch prints for every export
            value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - any failure means torch would retry with weights_only=False
        return False
    return isinstance(value, (tuple, dict))


def _classify(z: zipfile.ZipFile, by_name: dict[str, zipfile.ZipInfo], inflation_left: int) -> list[str]:
    """The members the allowlist refuses, each with the reason."""
    if "archive_format" not in by_name:
        return ["the whole archive (an older torch.export layout, read with pickle)"]
    if _read(z, by_name["archive_format"], "archive_format") != b"pt2":
        return ["the whole archive (archive_format is not 'pt2'; torch would retry it as the older, pickled layout)"]
    for required in ("archive_version", _GRAPH, _WEIGHTS_CONFIG, _CONSTANTS_CONFIG, _SAMPLE_INPUTS):
        if required not in by_name:
            raise InputError(f"not a torch.export archive: member {required!r} is missing")
    found = _expressions(_json(z, by_name[_GRAPH], _GRAPH))
    weights, bad_w = _payloads(_json(z, by_name[_WEIGHTS_CONFIG], _WEIGHTS_CONFIG), _WEIGHTS_CONFIG, "data/weights/")
    constants, bad_c = _payloads(_json(z, by_name[_CONSTANTS_CONFIG], _CONSTANTS_CONFIG), _CONSTANTS_CONFIG,
                                 "data/constants/")
    found += [f"weight {b}" for b in bad_w] + [f"constant {b}" for b in bad_c]
    if not _loads_weights_only(_sample_inputs(z, by_name, inflation_left)):
        found.append(f"{_SAMPLE_INPUTS} (sample inputs not loadable with weights_only=True)")
    known = _SMALL | {_GRAPH, _WEIGHTS_CONFIG, _CONSTANTS_CONFIG, _SAMPLE_INPUTS} | weights | constants
    for name, info in by_name.items():
        if name in known:
            continue
        if name.startswith("extra/") and not name.endswith("/"):
            try:
                _read(z, info, name).decode("utf-8")
                continue
            except UnicodeDecodeError:
                pass
        if name.startswith("data/aotinductor/"):
            found.append(f"{name[:80]} (a compiled AOTInductor library)")
        elif name.startswith(("models/", "data/")):
            found.append(f"{name[:80]} (not part of the one model torch.export.save writes; torch would load it)")
        else:
            found.append(f"{name[:80]} (unknown member)")
    for name in (weights | constants) - by_name.keys():
        found.append(f"{name[:80]} (named by a config but missing)")
    return found


def _open_archive(data: bytes) -> tuple[zipfile.ZipFile, dict[str, zipfile.ZipInfo], int]:
    """(the archive, its members by their names inside the root folder, the bytes inflation may still add),
    its layout and sizes checked (InputError)."""
    try:
        z, infos, inner, one_root = open_zip(io.BytesIO(data), len(data))
    except InputError as e:
        if str(e) == "not a zip file":
            raise InputError("not a torch.export archive (.pt2): not a zip file") from None
        raise
    inflation = _check_sizes(infos, inner)
    return z, {inner[i.filename]: i for i in infos}, MAX_INFLATION_BYTES - inflation


def unsafe_members(data: bytes) -> list[str]:
    """Members of a .pt2 archive (its bytes) that the allowlist refuses: code, pickles, unknown members.

    Raises InputError when the bytes are not an archive, a member is over its size cap, or the archive
    is malformed (these are refused whatever the caller trusts).
    """
    z, by_name, inflation_left = _open_archive(data)
    with z:
        if any("/" not in n for n in z.namelist()) or len({n.split("/", 1)[0] for n in z.namelist()}) != 1:
            # torch.export.load retries any archive it fails to read as the older layout, whose
            # top-level `version` member leads to pickled state dicts, constants and inputs.
            outside = sorted(n for n in z.namelist() if "/" not in n)
            return [f"{', '.join(outside[:3]) or 'members'} outside the archive's root folder "
                    "(an older torch.export layout, read with pickle)"]
        return _classify(z, by_name, inflation_left)


def _graph_bytes(data: bytes) -> bytes:
    """The serialized graph (models/model.json), its size capped; b"" when there is none."""
    z, by_name, _ = _open_archive(data)
    with z:
        return _read(z, by_name[_GRAPH], _GRAPH) if _GRAPH in by_name else b""


@contextlib.contextmanager
def _weights_only_loads() -> Iterator[None]:
    """Every `torch.load` inside is `weights_only=True`, whatever its caller asks (torch's own switch)."""
    keys = ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def load_pt2_safely(path: str | os.PathLike, *, trust_pickle: bool = False) -> Any:
    """`torch.export.load(path)`, refusing an archive that would run code or exhaust memory (see module doc).

    Errors are InputError naming the file; refused members are listed, and the
    message says that ``--trust-pickle`` (API: ``trust_pickle=True``) loads it anyway.
    """
    label = repr(str(Path(path)))
    try:
        data = _read_archive(path)
        if trust_pickle:
            z, by_name, inflation_left = _open_archive(data)
            with z:
                if _SAMPLE_INPUTS in by_name:  # the size caps hold for a trusted file too
                    _sample_inputs(z, by_name, inflation_left)
            unsafe = []
        else:
            unsafe = unsafe_members(data)
    except LayoutError as e:
        raise InputError(f"model file {label}: {e}; torch.export.save never writes such a file, so export and "
                         "save the model again") from None
    except InputError as e:
        raise InputError(f"model file {label}: {e}") from None
    if unsafe:
        shown = "; ".join(unsafe[:3]) + (f"; and {len(unsafe) - 3} more" if len(unsafe) > 3 else "")
        raise InputError(
            f"model file {label} holds members that torch.export.load would unpickle or execute, or that a "
            f"torch.export.save archive never has ({shown}); loading it may run code from the file, so pass "
            "--trust-pickle (trust_pickle=True) only if you trust it"
        )
    try:  # the custom operators its graph calls, registered by their installed library (custom_ops.py)
        register_operators(graph_operators(_graph_bytes(data)))
    except InputError as e:
        raise InputError(f"model file {label}: {e}") from None
    guard = contextlib.nullcontext() if trust_pickle else _weights_only_loads()
    logged: list[BaseException] = []
    try:
        with quiet_torch_export(), logged_errors(logged), guard:
            return torch.export.load(io.BytesIO(data))
    except Exception as e:  # noqa: BLE001 - corrupt or foreign archive
        raise InputError(f"model file {label} cannot be loaded with torch.export.load: {load_failure(e, logged)}") from None

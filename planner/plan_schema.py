"""The one schema of a plan file, checked wherever a plan is read (`Plan.load` / `Plan.from_dict`, and so
`report`, `apply`, `rebuild`, `load_applied` and the training callbacks, which all read plans through them).

A plan file may come from anywhere, so before any field is used:

* the file is at most `MAX_FILE_BYTES`, UTF-8 JSON;
* every value, at any depth: nesting at most `MAX_DEPTH`, at most `MAX_VALUES` values in all, strings
  (keys too) at most `MAX_STRING` characters with no lone surrogate (they cannot be written back out),
  lists at most `MAX_LIST` items, numbers finite, integers below 2**63 in size;
* every field the planner reads (`_FIELDS`, `_REGION`, `_STATS`) has its type and range.

Every failure is a PlanFileError naming the file and the field (`regions[0].start`,
`stats.sharding.world_size`). Unknown fields pass the generic checks and are otherwise kept as they are.

Writing (`Plan.save`, and every file the command line writes, through `cli/outputs.py`): `write_file`
replaces only a regular file or nothing (never a device node, fifo, socket, folder or link), keeps a
replaced file's mode, and on any OSError (a full disk) raises one OutputError line and leaves the old
file as it was, with nothing half-written.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import OutputError, PlanFileError

__all__ = ["MAX_FILE_BYTES", "read_plan_file", "read_bounded", "check_plan", "check_json_limits", "write_file",
           "not_a_file"]

MAX_FILE_BYTES = 256 << 20
MAX_DEPTH = 32
MAX_VALUES = 5_000_000
MAX_STRING = 100_000
MAX_LIST = 1_000_000
MAX_INT = 1 << 63
MAX_BYTES = 1 << 62  # any byte count: 4 EiB
MAX_SECONDS = 1e9  # any time in a plan: about 30 years
MAX_NODES = 1 << 31  # a graph's node count, a node position


class _Bad(Exception):
    def __init__(self, path: str, what: str) -> None:
        super().__init__(path, what)
        self.path, self.what = path, what


def _kind(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _walk(data: Any) -> None:
    """The generic limits, without recursion (a hostile file is as deep as the JSON reader allows)."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    seen = 0
    while stack:
        value, path, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise _Bad(path or "(file)", f"one of more than {MAX_VALUES} values in the file")
        if depth > MAX_DEPTH:
            raise _Bad(path, f"nested too deeply (more than {MAX_DEPTH} levels)")
        if isinstance(value, str):
            _string(value, path)
        elif isinstance(value, bool) or value is None:
            pass
        elif isinstance(value, int):
            if abs(value) >= MAX_INT:
                raise _Bad(path, "an integer too large (at most 2**63 - 1 in size)")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise _Bad(path, f"{value} (numbers must be finite)")
        elif isinstance(value, list):
            if len(value) > MAX_LIST:
                raise _Bad(path, f"a list of {len(value)} items (at most {MAX_LIST})")
            stack.extend((v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value))
        elif isinstance(value, dict):
            for k, v in value.items():
                _string(k, f"{path}.<key>" if path else "<key>")
                stack.append((v, f"{path}.{k}" if path else k, depth + 1))
        else:
            raise _Bad(path, f"{_kind(value)}, not a JSON value")


def _string(text: str, path: str) -> None:
    if len(text) > MAX_STRING:
        raise _Bad(path, f"a string of {len(text)} characters (at most {MAX_STRING})")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _Bad(path, "a string holding a lone surrogate (not text)") from None


# -- typed fields ---------------------------------------------------------------------------------

Check = Callable[[Any, str], None]


def _int(lo: int, hi: int, *, null: bool = False) -> Check:
    def check(v: Any, path: str) -> None:
        if v is None and null:
            return
        if type(v) is not int or not lo <= v <= hi:
            raise _Bad(path, f"must be an integer from {lo} to {hi}{' or null' if null else ''}, got {_shown(v)}")
    return check


def _num(lo: float, hi: float) -> Check:
    def check(v: Any, path: str) -> None:
        if type(v) not in (int, float) or not lo <= v <= hi:
            raise _Bad(path, f"must be a number from {lo:g} to {hi:g}, got {_shown(v)}")
    return check


def _str(limit: int = MAX_STRING, *, null: bool = False) -> Check:
    def check(v: Any, path: str) -> None:
        if v is None and null:
            return
        if not isinstance(v, str) or len(v) > limit:
            raise _Bad(path, f"must be a string of at most {limit} characters, got {_shown(v)}")
    return check


def _list(item: Check) -> Check:
    def check(v: Any, path: str) -> None:
        if not isinstance(v, list):
            raise _Bad(path, f"must be a list, got {_shown(v)}")
        for i, x in enumerate(v):
            item(x, f"{path}[{i}]")
    return check


def _obj(fields: dict[str, Check], *, values: Check | None = None) -> Check:
    """An object whose named fields (when present) pass their checks, and every other value `values`."""
    def check(v: Any, path: str) -> None:
        if not isinstance(v, dict):
            raise _Bad(path, f"must be an object, got {_shown(v)}")
        for k, x in v.items():
            sub = f"{path}.{k}" if path else k
            if k in fields:
                fields[k](x, sub)
            elif values is not None:
                values(x, sub)
    return check


def _any(v: Any, path: str) -> None:
    return None


def _shown(v: Any) -> str:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        text = repr(v) if abs(v) < 1e30 else f"{float(v):.3g}"
        return f"{_kind(v)} ({text})"
    return _kind(v)


_BYTES = _int(0, MAX_BYTES)
_SECONDS = _num(0.0, MAX_SECONDS)
_RATIO = _num(-MAX_SECONDS, MAX_SECONDS)
_NAME = _str(10_000)
_NAMES = _list(_NAME)

_REGION = _obj({
    # start and end: any number here; Plan.from_dict's region check says what is wrong with one (negative,
    # not an integer, inverted, outside the graph, overlapping) in its own words
    "start": _num(-MAX_NODES, MAX_NODES), "end": _num(-MAX_NODES, MAX_NODES), "first_node": _NAME, "last_node": _NAME,
    "modules": _NAMES, "depth": _int(0, 10_000), "recompute_s": _SECONDS, "saved_bytes": _BYTES,
    "saved_ops": _NAMES, "saved_positions": _list(_int(0, MAX_NODES)),
})
_SERIES = _obj({"bytes": _list(_num(-MAX_BYTES, MAX_BYTES)), "phase": _NAMES, "peak_bytes": _num(0, MAX_BYTES),
                "events": _int(0, MAX_INT - 1)})
_POINT = _obj({"budget_bytes": _num(0, MAX_BYTES), "peak_bytes": _num(0, MAX_BYTES), "recompute_s": _SECONDS,
               "overhead": _RATIO, "regions": _int(0, MAX_NODES), "solver": _NAME})
def _chunk(v: Any, path: str) -> None:
    """One chunked region (lower/chunk.py ChunkSpec): its nodes, at least one, and its chunk count."""
    _obj({"nodes": _NAMES, "chunks": _int(1, 1 << 20), "why": _str()})(v, path)
    for key in ("nodes", "chunks"):
        if key not in v:
            raise _Bad(f"{path}.{key}", "missing")
    if not v["nodes"]:
        raise _Bad(f"{path}.nodes", "an empty list (a chunked region runs at least one node)")


_OFFLOAD = _obj({"storage": _int(0, MAX_NODES), "node": _NAME, "output": _int(0, 1 << 20), "bytes": _BYTES,
                 "fetch_step": _int(-1, MAX_NODES), "use_step": _int(-1, MAX_NODES)})


def _offloaded(v: Any, path: str) -> None:
    """One offloaded activation (lower/offload.py OffloadTarget): every field present."""
    _OFFLOAD(v, path)
    for key in ("storage", "node", "output", "bytes"):
        if key not in v:
            raise _Bad(f"{path}.{key}", "missing")


_STATS = _obj({
    "chunks": _list(_chunk),
    "sharding": _obj({"world_size": _int(1, 1 << 24), "sharding": _str(100, null=True)}),
    "no_checkpoint_peak_bytes": _BYTES,
    "own_checkpointing": _any,
    "profile": _str(100),
    "captured_on": _str(100),
    "outputs": _str(100),
    "compiled": _obj({"lowering": _str(100), "knapsack": _obj({
        "estimated_recompute_s": _SECONDS, "candidates": _int(0, MAX_NODES), "kept_saved": _int(0, MAX_NODES),
        "saved_bytes": _num(0, MAX_BYTES), "candidate_bytes": _num(0, MAX_BYTES)})}),
    "timeline": _obj({}, values=_SERIES),
    "curves": _obj({"solvers": _obj({}, values=_list(_POINT)), "baseline": _POINT, "plan": _POINT,
                    "forward_s": _SECONDS}),
    "cli": _obj({"model": _str(), "model_kind": _str(100), "seed": _int(0, (1 << 64) - 1)}),
    "offload": _obj({"d2h_bytes_per_s": _num(0, 1e18), "h2d_bytes_per_s": _num(0, 1e18), "host_budget_bytes": _BYTES,
                     "exposed_copy_s": _SECONDS, "source": _str(100), "d2h_fixed_s": _SECONDS, "h2d_fixed_s": _SECONDS}),
})
_FIELDS: dict[str, Check] = {
    "model": _str(10_000), "fingerprint": _str(1_000), "capture_method": _str(100), "num_nodes": _int(0, MAX_NODES),
    "solver": _str(1_000), "solver_options": _obj({}), "solve_time_s": _SECONDS, "budget_bytes": _int(0, MAX_BYTES, null=True),
    "baseline_peak_bytes": _BYTES, "predicted_peak_bytes": _BYTES, "predicted_recompute_s": _SECONDS,
    "baseline_step_s": _SECONDS, "predicted_step_s": _SECONDS, "eager_step_s": _SECONDS, "predicted_overhead": _RATIO,
    "call_overhead_s": _SECONDS, "graph_overhead_s": _SECONDS, "time_source": _str(100),
    "breakdown": _obj({}, values=_num(-MAX_BYTES, MAX_BYTES)),
    "baseline_breakdown": _obj({"optimizer": _num(0, MAX_BYTES)}, values=_num(-MAX_BYTES, MAX_BYTES)),
    "measured_peak_bytes": _int(0, MAX_BYTES, null=True), "baseline_measured_peak_bytes": _int(0, MAX_BYTES, null=True),
    "notes": _NAMES, "stats": _STATS, "regions": _list(_REGION),
    "offloaded": _list(_offloaded),  # optional: plans before offload have none
}
_REQUIRED = ("fingerprint", "capture_method", "solver", "budget_bytes", "baseline_peak_bytes", "predicted_peak_bytes",
             "predicted_recompute_s", "regions")


def check_json_limits(data: Any, source: str) -> None:
    """The generic limits alone (depth, sizes, finite numbers, 64-bit integers, no lone surrogates), for
    any JSON file the planner reads; PlanFileError naming `source` and the field."""
    try:
        _walk(data)
    except _Bad as e:
        raise PlanFileError(f"{source}: field {e.path or '(top level)'} is malformed: {e.what}") from None


def check_plan(data: Any, source: str) -> None:
    """Raise PlanFileError (naming `source` and the field) unless `data` is a plan within the schema."""
    if not isinstance(data, dict):
        raise PlanFileError(f"{source}: not a ckpt-planner plan (a JSON {_kind(data)}, not an object)")
    check_json_limits(data, source)
    try:
        for name in _REQUIRED:
            if name not in data:
                raise _Bad(name, "missing")
        _obj(_FIELDS)(data, "")
    except _Bad as e:
        raise PlanFileError(f"{source}: field {e.path} is malformed: {e.what}") from None


def read_plan_file(path: str | os.PathLike, source: str) -> Any:
    """The JSON in a plan file, read within the limits: PlanFileError for anything else (missing, too
    large, not UTF-8, not JSON, numbers Python will not read, nesting the reader cannot follow)."""
    p = Path(path)
    try:
        if not p.is_file():
            raise PlanFileError(f"{source} does not exist")
        if p.stat().st_size > MAX_FILE_BYTES:
            raise PlanFileError(f"{source} is larger than {MAX_FILE_BYTES >> 20} MiB; not a plan file")
        with p.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise PlanFileError(f"{source} cannot be read ({e.strerror or type(e).__name__})") from None
    if len(raw) > MAX_FILE_BYTES:
        raise PlanFileError(f"{source} is larger than {MAX_FILE_BYTES >> 20} MiB; not a plan file")
    try:
        return json.loads(raw.decode("utf-8"))
    except RecursionError:
        raise PlanFileError(f"{source} is nested too deeply to be a plan file") from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError, and Python's limit on an integer's digits
        first = next((ln for ln in str(e).splitlines() if ln.strip()), "")[:200]
        raise PlanFileError(f"{source} is not valid JSON ({type(e).__name__}: {first})") from None


# -- writing: plan files, and every file the command line writes -------------------------

_KINDS = {stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFIFO: "a fifo",
          stat.S_IFSOCK: "a socket", stat.S_IFLNK: "a symbolic link", stat.S_IFDIR: "a directory"}


def not_a_file(path: Path) -> str | None:
    """What is at `path` when it is something other than a regular file (None: a file, or nothing)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"unreadable ({e.strerror})"
    return None if stat.S_ISREG(mode) else _KINDS.get(stat.S_IFMT(mode), "not a regular file")


_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def read_bounded(path: str | os.PathLike, limit: int) -> bytes | None:
    """At most `limit` bytes of the regular file at `path`, from one descriptor; None when it is missing,
    unreadable, a link (not followed), not a regular file (a fifo's open does not wait), or larger than
    `limit`, before or while it is read (a sparse 10 GiB file costs one fstat, not 10 GiB)."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        chunks, size = [], 0
        while size <= limit:  # bounded even if the file grows after fstat
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks) if size <= limit else None
    except OSError:
        return None
    finally:
        os.close(fd)


def _new_file_mode() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def write_file(path: str | os.PathLike, text: str | bytes, what: str = "output") -> None:
    """Write `text` to `path` through a temporary file renamed into place; OutputError on any failure."""
    p = Path(path)
    kind = not_a_file(p)
    if kind is not None:  # it changed since check_output_file
        raise OutputError(f"{what} {str(p)!r} is {kind}; only a regular file is replaced, so name a file path")
    data = text.encode("utf-8") if isinstance(text, str) else text
    try:
        mode = stat.S_IMODE(os.stat(p).st_mode) if p.exists() else _new_file_mode()
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}-", dir=p.parent if str(p.parent) else ".")
    except OSError as e:
        raise OutputError(f"{what} {str(p)!r} could not be written ({e.strerror or e}); nothing was written") from None
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, p)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OutputError(f"{what} {str(p)!r} could not be written ({e.strerror or e}); nothing was written") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise

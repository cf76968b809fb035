"""The device's timing store: measured times kept on disk, so that planning the same model twice gives
the same plan.

Measured node times follow the machine's load: two profiles of one model on a busy machine can
differ by several times, and near-equal plans swap places. The store keeps, per device, the fitted
time of each op on given sizes (timing.anchor_times), the timings the checkpoint call costs are
derived from (timing.call_timings), and per captured graph the step times its calibration is derived
from (choose/race/calibration.py with_step_times). The first profile that meets an entry measures it and
stores it; every later one reads it, so the plan is a function of the model, the inputs and the budget alone.

`copies` keeps the device's host copy times (profile/copy_bandwidth.py: seconds per GiB each way, a
snapshot that heals like the others), from which offload's bandwidths are derived.

It also keeps, per graph and budget, the plan the last run chose (`plans`): a later run keeps that
plan unless its own solve beats it, on this run's figures, by more than a measurement can tell apart
(choose/plan_store.py). A heal that moves a near-equal plan ahead then leaves the plan alone.

Every entry is a time measured directly, or a snapshot of times measured side by side in one run,
and load only ever adds time: a later run that measures one clearly lower (a first run that load
slowed down) replaces it, so a bad first profile does not stay. A snapshot heals whole, by its total,
so that the differences taken between its times (a call's cost, the calibration) always come from one
run. For node times and snapshots "clearly" is two steps of the time grid (x0.71), beyond the one-step
flicker of quiet runs, so the plan stays put; the eager and graph step times are plan-neutral and take
any lower figure.

Where: the directory `$CKPT_PLANNER_TIMINGS` names, else `$XDG_CACHE_HOME/ckpt-planner`, else
`~/.cache/ckpt-planner`; one JSON file per device, torch version and thread count. An empty (or blank)
`CKPT_PLANNER_TIMINGS` counts as unset: the default folder, never the working directory.
`CKPT_PLANNER_TIMINGS=off` (or `ProfileConfig(timing_store=False)`) measures afresh and stores
nothing; deleting the file measures again. A store that cannot be read is ignored; one that cannot be
written is not an error (the plan is made from this run's measurements).

Processes share the file: `save` holds an exclusive `flock` on the store's folder while it reads the file
as it is then, merges its own entries in and renames a complete new file into place, so concurrent runs
(a sweep of six planners) lose none of each other's entries, and a reader never sees half a file.

A store is data from disk, so nothing in it is taken on trust: a stored time that is not a finite
number of seconds in (`MIN_TIME_S`, `MAX_TIME_S`] (negative, zero, 1e-300, NaN, a year) is dropped and
measured again, and never stored; a file that another user owns or that others may write, or that is
nested too deeply to read, is ignored with one `TimingStoreWarning` naming it. So is one that is not a
regular file (a fifo, which would block a plain open forever; a folder; a device) or larger than
`MAX_STORE_BYTES` (a link to a huge sparse file): it is opened without blocking and judged by `fstat`
before a byte is read, and nothing is written over it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import re
import stat
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["TimingStore", "TimingStoreWarning", "open_store", "store_dir", "STORE_ENV"]

STORE_ENV = "CKPT_PLANNER_TIMINGS"
FORMAT = 5  # 5: the selective figures time the kept-node mode of selective.py, not torch's policy mode
_OFF = {"off", "0", "no", "false", "none"}
MIN_TIME_S = 1e-9  # seconds: below any op's launch; 0, negatives and 1e-300 are not measurements
MAX_TIME_S = 3600.0  # seconds: no op, call or step of one training step takes an hour
_MAY_BE_ZERO = {"recomputed", "calls", "split_recomputed", "split_calls"}  # a calibration snapshot's predicted figures
_TIMED_TABLES = ("ops", "overheads", "graphs", "steps", "copies")
MAX_STORE_BYTES = 64 << 20  # bytes: thousands of entries take well under 1 MB; a file beyond this is not ours
LOCK_WAIT_S = 10.0  # seconds: another run holds the lock for one read-merge-write; past this, this run stores nothing


class TimingStoreWarning(UserWarning):
    """A timing store file that is ignored (not the user's, writable by others, unreadable); names the file."""


_warned: set[str] = set()


def _warn_once(path: Path, why: str, then: str = "it is ignored (times are measured afresh)") -> None:
    if str(path) not in _warned:
        _warned.add(str(path))
        warnings.warn(f"timing store {str(path)!r} {why}; {then}", TimingStoreWarning, stacklevel=4)


def store_dir() -> Path | None:
    """The store's directory, or None when the environment turns it off."""
    env = os.environ.get(STORE_ENV)
    if env is not None and env.strip():  # empty counts as unset: Path("") would be the working directory
        if env.strip().lower() in _OFF:
            return None
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME")
    try:
        return (Path(base).expanduser() if base else Path.home() / ".cache") / "ckpt-planner"
    except RuntimeError:  # no home folder to be found: nothing is stored
        return None


def _device_label(device: torch.device) -> str:
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        name = torch.cuda.get_device_name(index)
    else:
        name = f"{device.type}-{platform.machine()}-{_cpu_model()}-{os.cpu_count()}"
    name = f"{name}-torch{torch.__version__}-t{torch.get_num_threads()}"
    return re.sub(r"[^A-Za-z0-9_.+-]+", "_", name)


def _cpu_model() -> str:
    """The processor's model name (Linux: /proc/cpuinfo), so that machines sharing a home folder keep
    apart; platform.processor() is empty on most Linux systems."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


class TimingStore:
    """One device's stored times: ops (fitted node times by op key), overheads (the call-cost timings),
    graphs (per graph signature, the calibration's step timings) and steps (per graph, its eager and
    graph step); and plans (per graph and budget, the plan last chosen). Reads at construction; `save`
    merges what this run added into the file as it is then, keeping the times already there unless this
    run's heal them; a plan this run chose replaces the one there."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.data = _read(path) if path is not None else _empty()
        self._added: dict[str, dict[str, tuple[Any, float | None]]] = _empty()  # key -> (value, heal or None: kept)

    def get(self, table: str, key: str) -> Any:
        return self.data[table].get(key)

    def settle(self, table: str, key: str, value: Timing, heal: float) -> Timing:
        """A time measured directly, or a snapshot of times measured in one run ({name: seconds}): the
        stored one, unless this one is at most `heal` times it (by its total: a measurement that load
        inflated), which replaces it whole. Returns what is now stored."""
        old = _comparable(self.data[table].get(key), value)
        if old is not None and not _total(value) <= heal * _total(old):
            return old
        if not _valid(value):  # a failed measurement is this run's alone
            return value
        self.data[table][key] = value
        self._added[table][key] = (value, heal)
        return value

    def set_aside(self, table: str, key: str) -> None:
        """Forget `key` for this run (a stale entry): the file keeps it until this run stores its own."""
        self.data[table].pop(key, None)

    def keep(self, table: str, key: str, value: Any) -> None:
        """Store `value` (JSON) under `key`, replacing what is there: a record, not a measurement."""
        self.data[table][key] = value
        self._added[table][key] = (value, None)

    def save(self) -> None:
        """Merge this run's entries into the file under its lock (see the module docstring)."""
        if self.path is None or not any(self._added.values()):
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with _locked(self.path) as held:
                if held:
                    self._merge_and_write()
        except OSError:
            pass  # a read-only home or full disk: this run's plan stands on its own measurements

    def _merge_and_write(self) -> None:
        """Read the file as it is now, add this run's entries, and rename a complete new file over it."""
        kind = _not_regular(self.path)
        if kind is not None:  # a fifo, folder or link where the store goes: the user's, left as it is
            _warn_once(self.path, f"is {kind}, not a regular file", "nothing is stored in it")
            return
        current = _read(self.path)
        for table, entries in self._added.items():
            for key, (value, heal) in entries.items():
                there = None if heal is None else _comparable(current[table].get(key), value)
                if there is None or _total(value) <= heal * _total(there):
                    current[table][key] = value  # new, or healed against what another run stored
        fd, tmp = tempfile.mkstemp(prefix=".timings-", suffix=".json", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"format": FORMAT, **current}, f, indent=0, sort_keys=True)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.data = current
        self._added = _empty()


Timing = float | dict[str, float]


def _total(value: Timing) -> float:
    return float(sum(value.values())) if isinstance(value, dict) else float(value)


def _comparable(stored: Any, value: Timing) -> Timing | None:
    """`stored` when it has `value`'s shape (a number, or a snapshot of the same names), else None: an
    entry some other version wrote is measured again."""
    if isinstance(value, dict):
        ok = isinstance(stored, dict) and set(stored) == set(value)
        return {k: float(v) for k, v in stored.items()} if ok and all(_number(v) for v in stored.values()) else None
    return float(stored) if _number(stored) else None


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v


def _time(v: Any, *, zero: bool = False) -> bool:
    """A stored time in seconds: finite, in (MIN_TIME_S, MAX_TIME_S] (or exactly 0 where `zero`)."""
    return _number(v) and (MIN_TIME_S < v <= MAX_TIME_S or (zero and v == 0))


def _valid(value: Any) -> bool:
    """A time, or a snapshot {name: seconds} of them (its predicted figures may be 0)."""
    if isinstance(value, dict):
        return bool(value) and all(isinstance(k, str) and _time(v, zero=k in _MAY_BE_ZERO) for k, v in value.items())
    return _time(value)


def _empty() -> dict[str, dict[str, Any]]:
    return {"ops": {}, "overheads": {}, "graphs": {}, "steps": {}, "plans": {}, "learned": {}, "copies": {}}


_KINDS = {stat.S_IFIFO: "a fifo", stat.S_IFDIR: "a folder", stat.S_IFLNK: "a symbolic link",
          stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def _kind(mode: int) -> str:
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def _not_regular(path: Path) -> str | None:
    """What is at `path` when it is there and is not a regular file (a link is not followed)."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:  # missing, or its folder is not one: nothing there to keep
        return None
    return None if stat.S_ISREG(mode) else _kind(mode)


_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _read_own(path: Path) -> str | None:
    """The file's text, read from one descriptor: None (with a warning) when it is not a regular file,
    is larger than MAX_STORE_BYTES, another user owns it or its group or others may write it, so its
    times could be anyone's; None when it is missing or unreadable.

    Opened without blocking (a fifo's open would wait for a writer forever) and without following a
    link, then judged by fstat on that descriptor before anything is read."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        return None
    except OSError:
        kind = _not_regular(path)  # O_NOFOLLOW refuses a link (ELOOP): name it
        if kind is not None:
            _warn_once(path, f"is {kind}, not a regular file")
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            _warn_once(path, f"is {_kind(st.st_mode)}, not a regular file")
            return None
        if st.st_size > MAX_STORE_BYTES:
            _warn_once(path, f"is {st.st_size} bytes, more than a timing store's {MAX_STORE_BYTES}")
            return None
        if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            _warn_once(path, f"belongs to another user (uid {st.st_uid})")
            return None
        if st.st_mode & (stat.S_IWOTH | stat.S_IWGRP):  # a group member's times would be read as ours
            who = "other users" if st.st_mode & stat.S_IWOTH else "its group"
            _warn_once(path, f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):o})")
            return None
        chunks, size = [], 0
        while size <= MAX_STORE_BYTES:  # bounded even if the file grows after fstat
            chunk = os.read(fd, min(1 << 20, MAX_STORE_BYTES + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_STORE_BYTES:
            _warn_once(path, f"grew past a timing store's {MAX_STORE_BYTES} bytes while read")
            return None
        return b"".join(chunks).decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    finally:
        os.close(fd)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[bool]:
    """Hold an exclusive flock on the store's folder while one run reads, merges and replaces its file.

    The folder itself is the lock (Linux and the BSDs flock a directory), so nothing is left beside the
    store and no lock file can be swapped for a fifo or a link. Yields False when the lock cannot be had
    within LOCK_WAIT_S (a run stuck holding it): this run then stores nothing. Without fcntl (not POSIX),
    or on a file system without flock, it yields True unlocked: the write is still atomic, only a
    concurrent merge may be lost."""
    try:
        import fcntl
    except ImportError:
        yield True
        return
    fd = os.open(path.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        deadline, held = time.monotonic() + LOCK_WAIT_S, True
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    yield False
                    return
                time.sleep(0.002)
            except OSError:  # a file system without flock (ENOLCK): as without fcntl
                held = False
                break
        try:
            yield True
        finally:
            if held:
                fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _read(path: Path) -> dict[str, dict[str, Any]]:
    empty = _empty()
    text = _read_own(path)
    if text is None:
        return empty
    try:
        raw = json.loads(text)
    except ValueError:
        return empty
    except RecursionError:
        _warn_once(path, "is nested too deeply to read")
        return empty
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        return empty
    tables = {k: dict(raw[k]) if isinstance(raw.get(k), dict) else {} for k in empty}
    for table in _TIMED_TABLES:  # a bad time (hand-edited, another tool's) is measured again
        tables[table] = {k: v for k, v in tables[table].items() if _valid(v)}
    return tables


def open_store(device: torch.device | str, enabled: bool = True) -> TimingStore:
    """The store of `device`; an empty one that saves nothing when disabled, off in the environment, or
    on meta tensors (nothing is timed there)."""
    device = torch.device(device)
    folder = store_dir() if enabled and device.type != "meta" else None
    if folder is None:
        return TimingStore(None)
    return TimingStore(folder / f"timings-{_device_label(device)}.json")


def signature(keys: list[str]) -> str:
    """A captured graph's identity for the store: its nodes' op keys in order."""
    return hashlib.sha256("\n".join(keys).encode()).hexdigest()[:32]

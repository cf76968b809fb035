"""The layout of a zip file, checked so that torch's reader and Python's `zipfile` read the same members.

Python's `zipfile` takes the central directory just before the end record and
shifts every member's offset by the difference from the offset the record
states; torch's reader (``torch._C.PyTorchFileReader``, miniz) takes the stated
offset. A crafted file can therefore show `zipfile` (and any check built on it)
one set of members and torch another. `open_zip` refuses such a file before
anything is inflated: the end record must be the file's last bytes, with the
central directory where both readers look for it; no data before the first
member, no two members overlapping, every name UTF-8; and torch's reader must
list the same members and find each one's data at the same byte.

`open_regular` opens only a regular file (a fifo would block, a device never
ends), and `memory_bytes` says how much memory this process may hold, so that
callers can bound a file before they read it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import struct
import zipfile
from typing import IO

import torch

from ...errors import InputError

__all__ = ["MAX_MEMBERS", "ZIP_MAGIC", "LayoutError", "end_record", "open_zip", "open_regular", "memory_bytes"]

MAX_MEMBERS = 100_000
ZIP_MAGIC = b"PK\x03\x04"  # a local header: torch.load's own test of a zip file, and the first bytes of any archive
_END = struct.Struct("<4s4H2IH")  # end of central directory record (22 bytes)
_LOCATOR = struct.Struct("<4sIQI")  # zip64 end record locator (20 bytes)
_END64 = struct.Struct("<4sQ2H2I4Q")  # zip64 end record (56 bytes, as Python's zipfile reads it)
_LOCAL = struct.Struct("<4s5H3I2H")  # local file header (30 bytes)


class LayoutError(InputError):
    """An archive laid out as no torch writer lays one out (where its two readers could disagree)."""


def _first_line(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), type(e).__name__)[:300]


def end_record(f: IO[bytes], size: int) -> int:
    """The central directory's offset as the end record states it, checked to be where Python's zipfile
    finds the directory: just before that record (InputError).

    Python's zipfile takes the directory just before the end record and shifts every member's offset by
    the difference; torch's reader takes the stated offset. The record must be the file's last 22 bytes
    (torch writes no archive comment; a comment could hold a second record that the readers pick apart),
    and a zip64 record must sit where Python reads it, which is also where its locator points.
    """
    if size < _END.size:
        raise LayoutError("not a zip file")
    f.seek(size - _END.size)
    sig, disk, cd_disk, here, entries, cd_size, cd_offset, comment = _END.unpack(f.read(_END.size))
    if sig != b"PK\x05\x06" or comment:
        raise LayoutError("not a zip file as torch writes it: its last 22 bytes are not a zip end record "
                         "(an archive comment is refused too)")
    end = size - _END.size
    if end >= _LOCATOR.size:
        f.seek(end - _LOCATOR.size)
        lsig, ldisk, at, disks = _LOCATOR.unpack(f.read(_LOCATOR.size))
        if lsig == b"PK\x06\x07":
            if at != end - _LOCATOR.size - _END64.size or ldisk or disks != 1:
                raise LayoutError("its zip64 end record is not where both zip readers look for it")
            f.seek(at)
            sig64, _, _, _, *wide = _END64.unpack(f.read(_END64.size))
            if sig64 != b"PK\x06\x06":
                raise LayoutError("its zip64 locator points at no zip64 end record")
            narrow = (disk, cd_disk, here, entries, cd_size, cd_offset)
            markers = (0xFFFF, 0xFFFF, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF)
            if any(n not in (w, m) for n, w, m in zip(narrow, wide, markers)):
                raise LayoutError("its end record and zip64 end record disagree")
            disk, cd_disk, here, entries, cd_size, cd_offset = wide
            end = at
    if disk or cd_disk or here != entries:
        raise LayoutError("it spans several disks")
    if cd_offset + cd_size != end:
        raise LayoutError(
            f"its end record puts the central directory at byte {cd_offset}, but it lies at byte {end - cd_size} "
            "(torch's zip reader and Python's would read different members)"
        )
    return cd_offset


def _check_layout(f: IO[bytes], size: int, infos: list[zipfile.ZipInfo]) -> dict[str, int]:
    """Where each member's data starts (by its full name), once the archive is checked to hold nothing
    but its members, in order, each where its directory entry says and nowhere else (InputError)."""
    cd_offset = end_record(f, size)
    spans: list[tuple[int, int, str]] = []
    starts: dict[str, int] = {}
    for info in infos:
        name = info.orig_filename
        if name != info.filename or not (info.flag_bits & 0x800 or name.isascii()):
            raise LayoutError(f"member name {ascii(name[:80])} is not UTF-8 text, or holds a NUL")
        f.seek(info.header_offset)
        head = f.read(_LOCAL.size)
        if len(head) < _LOCAL.size or not head.startswith(ZIP_MAGIC):
            raise LayoutError(f"member {name[:80]!r}: no local header where the central directory points")
        name_len, extra_len = _LOCAL.unpack(head)[-2:]
        if f.read(name_len) != name.encode("utf-8"):
            raise LayoutError(f"member {name[:80]!r}: its local header names another member")
        starts[name] = info.header_offset + _LOCAL.size + name_len + extra_len
        spans.append((info.header_offset, starts[name] + info.compress_size, name))
    spans.sort()
    if spans and spans[0][0]:
        raise LayoutError(f"{spans[0][0]} bytes of other data come before its first member")
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise LayoutError(f"members {a[:80]!r} and {b[:80]!r} overlap")
    if spans and spans[-1][1] > cd_offset:
        raise LayoutError(f"member {spans[-1][2][:80]!r} runs into the central directory")
    return starts


def _check_torch_reads_the_same(f: IO[bytes], starts: dict[str, int]) -> None:
    """torch's own reader must list the same members and find each one's data at the same byte."""
    try:
        f.seek(0)  # torch's reader takes the stream from where it stands
        reader = torch._C.PyTorchFileReader(f)
        found = {name: reader.get_record_offset(name) for name in reader.get_all_records()}
    except (RuntimeError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise LayoutError(f"torch's zip reader cannot read it ({_first_line(e)})") from None
    if found != starts:
        raise LayoutError("torch's zip reader and Python's find different members or read them from different "
                         "bytes; the archive is malformed")


def open_zip(f: IO[bytes], size: int) -> tuple[zipfile.ZipFile, list[zipfile.ZipInfo], dict[str, str], bool]:
    """(the zip, its members, each one's name inside the archive's root folder, whether there is one root),
    its layout checked before anything is inflated (InputError)."""
    if not zipfile.is_zipfile(f):
        raise LayoutError("not a zip file")
    end_record(f, size)
    try:
        z = zipfile.ZipFile(f)
        infos = z.infolist()
    except UnicodeDecodeError:
        raise LayoutError("a member name is not UTF-8 text") from None
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError) as e:
        raise LayoutError(f"not a readable zip archive ({_first_line(e)})") from None
    if len(infos) > MAX_MEMBERS:
        raise LayoutError(f"the archive has {len(infos)} members, over the limit of {MAX_MEMBERS}")
    names = [i.filename for i in infos]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise LayoutError(f"the archive lists member {dup[:80]!r} twice")
    starts = _check_layout(f, size, infos)
    roots = {n.split("/", 1)[0] if "/" in n else "" for n in names}
    one_root = len(roots) == 1 and "" not in roots
    # Members outside one root folder (the older layout's top-level `version`) keep their full names.
    inner = {n: n.split("/", 1)[1] if one_root else n for n in names}
    if one_root:  # torch's reader strips the root folder (and refuses an archive without one)
        _check_torch_reads_the_same(f, {inner[n]: at for n, at in starts.items()})
    return z, infos, inner, one_root


def memory_bytes() -> int | None:
    """Bytes this process may hold: physical memory, or less where a limit on its address space or data
    (ulimit -v, -d) says so; None when unknown."""
    limits = []
    with contextlib.suppress(AttributeError, ValueError, OSError):
        limits.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    with contextlib.suppress(ImportError, AttributeError, ValueError, OSError):
        import resource

        for kind in (resource.RLIMIT_AS, resource.RLIMIT_DATA):
            soft = resource.getrlimit(kind)[0]
            if soft != resource.RLIM_INFINITY and soft > 0:
                limits.append(soft)
    return min(limits) if limits else None


def open_regular(path: str | os.PathLike) -> tuple[IO[bytes], int]:
    """(the open file, its size); only a regular file is opened (a fifo would block, a device never ends)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise InputError(f"cannot be read ({e.strerror})") from None
    f = os.fdopen(fd, "rb", )
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        f.close()
        raise InputError("is not a regular file")
    return f, info.st_size

"""Where the command line writes (`-o FILE`, `apply -o DIR`), without losing or changing what is there.

* Only a regular file, or nothing, is replaced by a file: a device node (a copy of /dev/null or
  /dev/full), a fifo, a socket, a folder or a symbolic link at the path is refused, since renaming a
  file over it would replace the node itself.
* The file is written beside the target and renamed into place; a replaced file keeps its mode (a
  0600 plan stays 0600), a new one gets the usual 0666 less the umask.
* Every OSError while writing (a full disk: ENOSPC, EIO, EDQUOT) is one `OutputError` line (exit 2),
  and the temporary file is removed: nothing half-written is left and the old file is as it was.
* An `apply` folder records a digest of every file it wrote (`written`, in its manifest); `apply -o`
  over it refuses, naming them, when it holds files apply did not write or that were changed since
  (notes, a weight file, an edited load.py). Python's `__pycache__` folders are not counted.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import OutputError
from ..plan_schema import not_a_file, write_file

__all__ = ["OutputError", "check_output_file", "write_file", "digests", "foreign_files"]


def check_output_file(path: str | os.PathLike, what: str) -> Path:
    """Refuse, before any work, an output that is not a regular file or cannot be written (OutputError)."""
    p = Path(path)
    check_parent(p, what)
    kind = not_a_file(p)
    if kind is not None:
        raise OutputError(f"{what} {str(p)!r} is {kind}; only a regular file is replaced, so name a file path")
    return p


def check_parent(p: Path, what: str) -> None:
    """The folder `p` goes in exists and takes a new file (OutputError naming it otherwise)."""
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise OutputError(f"{what} {str(p)!r}: directory {str(parent)!r} does not exist")
    try:
        fd, probe = tempfile.mkstemp(prefix=".ckpt-planner-probe-", dir=parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise OutputError(f"{what} {str(p)!r}: directory {str(parent)!r} is not writable ({e.strerror})") from None


def digests(folder: Path) -> dict[str, str]:
    """{path inside the folder: sha256} of every regular file under `folder`."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[p.relative_to(folder).as_posix()] = _sha256(p)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def foreign_files(folder: Path, manifest: dict[str, Any], written_by_older: dict[str, str],
                  earlier: Callable[[bytes], bool] = lambda data: False) -> list[str]:
    """Entries of an earlier apply folder that apply did not write, or that changed since it wrote them.

    `manifest["written"]` lists what apply wrote with digests; a folder from before it was recorded is
    judged by name and, for the text files, content (`written_by_older`: {name: the text apply writes},
    or `earlier(data)`: what an earlier release wrote under that name).
    """
    recorded = manifest.get("written") if isinstance(manifest.get("written"), dict) else None
    found = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if "__pycache__" in p.relative_to(folder).parts or rel == "manifest.json":
            continue
        if p.is_dir() and not p.is_symlink():
            continue
        if not p.is_file() or p.is_symlink():
            found.append(rel)
        elif recorded is not None:
            if recorded.get(rel) != _sha256(p):
                found.append(rel)
        elif rel in written_by_older:
            data = p.read_bytes()
            if data != written_by_older[rel].encode() and not earlier(data):
                found.append(rel)
        elif not (rel in ("plan.json", "state_dict.pt", "inputs.pt", "model.pt2", "model.pt")
                  or (rel.startswith("code/") and rel.endswith(".py"))):
            found.append(rel)
    return found

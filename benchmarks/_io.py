"""The one writer of benchmark results: `--out` may name a folder someone else made on a shared machine.

A result is written through a temporary file in its folder renamed over the name (never half-written;
an existing file keeps its mode). A name that is a link, a folder or a device is refused, not written
through, and so is an output folder that is itself a link: every name of one call is checked before
the first is written, so a refusal writes nothing. A refusal is one line on stderr and exit 2.
"""

from __future__ import annotations

import io
import os
import stat
import sys
from pathlib import Path
from typing import Any

from ckpt_planner.errors import OutputError
from ckpt_planner.plan_schema import not_a_file, write_file

__all__ = ["out_dir", "write_files", "write_text", "figure_png"]


def _refuse(message: str) -> None:
    print(f"benchmark output: {message}", file=sys.stderr)
    raise SystemExit(2)


def out_dir(path: str | os.PathLike) -> Path:
    """`path` as a folder to write results in, made where missing; refused where it is a link (its
    target is not ours to write in) or something other than a folder."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        mode = os.lstat(p).st_mode
    except OSError as e:
        _refuse(f"folder {str(p)!r} cannot be made ({e.strerror or e})")
    if stat.S_ISLNK(mode) or not stat.S_ISDIR(mode):
        _refuse(f"folder {str(p)!r} is {'a symbolic link' if stat.S_ISLNK(mode) else 'not a folder'}; "
                "results are written only into a real folder: name another --out")
    return p


def write_files(folder: str | os.PathLike, files: dict[str, str | bytes]) -> None:
    """Write each `files` name (inside `folder`) with its text or bytes, after checking every one of them."""
    d = out_dir(folder)
    for name in files:
        kind = not_a_file(d / name)
        if kind is not None:
            _refuse(f"{str(d / name)!r} is {kind}; only a regular file is replaced, so nothing was written")
    for name, data in files.items():
        try:
            write_file(d / name, data, "benchmark output")
        except OutputError as e:
            _refuse(str(e))


def write_text(path: str | os.PathLike, text: str | bytes) -> None:
    """One file: `write_files(path.parent, {path.name: text})`."""
    p = Path(path)
    write_files(p.parent if str(p.parent) else Path("."), {p.name: text})


def figure_png(fig: Any, **savefig_options: Any) -> bytes:
    """A matplotlib figure as PNG bytes, for `write_files` (savefig itself would follow a link)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", **savefig_options)
    return buf.getvalue()

"""Where the command line writes (`-o FILE`, `apply -o DIR`), without losing or changing what is there.

* Only a regular file, or nothing, is replaced by a file: a device node (a copy of /dev/null or
  /dev/full), a fifo, a socket, a folder or a symbolic link at the path is refused, since renaming a
  file over it would replace the node itself.
* The file is written beside the target and renamed into place; a replaced file keeps its mode (a
  0600 plan stays 0600), a new one gets the usual 0666 less the umask.
* Every OSError while writing (a full disk: ENOSPC, EIO, EDQUOT) is one `OutputError` line (exit 2),
  and the temporary file is removed: nothing half-written is left and the old file is as it was.
* An output that is the same file as one of the command's inputs (the same path, another path to it,
  a hard link) is refused: writing it would replace the input (`report plan.json -o plan.json`). A
  file with other hard links is refused too: the rename would split it, leaving the other names with
  the old content.
* An `apply` folder records a digest of every file it wrote (`written`, in its manifest); `apply -o`
  over it refuses, naming them, when it holds files apply did not write or that were changed since
  (notes, a weight file, an edited load.py). Python's `__pycache__` caches are not counted. A folder
  from a release that recorded no digests is refused whole: what in it is the user's cannot be told.
* Text the command line prints or writes into a report goes through `printable`: names come from plan
  files, graphs and archives, and a control character in one (an OSC sequence sets the terminal's
  title or clipboard, a bidi override reorders what is shown) is shown escaped, never sent as is.
* What it prints: results on the real stdout (`out`, `say`: user code runs with stdout sent to stderr),
  errors and notices as one line on stderr (`err`, `note`, `one_line_warnings`), a progress bar there
  (`progress_bar`), and torch's own logging silenced (`no_logs`).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..errors import OutputError
from ..plan_schema import not_a_file, write_file

__all__ = ["OutputError", "check_output_file", "write_file", "digests", "foreign_files", "remove_written",
           "printable", "command_output", "out", "err", "say", "note", "progress_bar", "bar_stage", "one_line", "one_line_warnings",
           "no_logs"]

# C0 controls but tab and newline, DEL, C1 controls (0x9b is a one-byte CSI), the bidi marks, embeddings,
# overrides and isolates, and lone surrogates (which a UTF-8 console cannot even encode).
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"
                          "\ud800-\udfff]")


def _escaped(m: re.Match) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


def printable(text: str) -> str:
    """`text` with every control character but tab and newline, and every bidi control, written as a
    visible escape (ESC as \\x1b, U+202E as \\u202e): safe to print on a terminal or put in a report."""
    return _UNPRINTABLE.sub(_escaped, text)


def check_output_file(path: str | os.PathLike, what: str, inputs: tuple[str | os.PathLike, ...] = ()) -> Path:
    """Refuse, before any work, an output that is not a regular file, cannot be written, is one of the
    command's `inputs`, or has other hard links (OutputError)."""
    p = Path(path)
    check_parent(p, what)
    kind = not_a_file(p)
    if kind is not None:
        raise OutputError(f"{what} {str(p)!r} is {kind}; only a regular file is replaced, so name a file path")
    check_not_an_input(p, what, inputs)
    try:
        links = os.lstat(p).st_nlink
    except FileNotFoundError:
        return p
    except OSError as e:
        raise OutputError(f"{what} {str(p)!r} cannot be examined ({e.strerror}); name another file") from None
    if links > 1:
        raise OutputError(
            f"{what} {str(p)!r} has {links - 1} other hard link(s); writing it would give this name a new file "
            "and leave the others with the old content: remove the other links or name another file"
        )
    return p


def command_output(path: str, what: str, args: Any) -> Path:
    """A command's `-o` file, refused before any work when it cannot be written or is one of the files the
    command reads (its model, a file.py:factory spec's file, inputs, plan, bench)."""
    model = getattr(args, "model", None)
    paths = [model, model.rpartition(":")[0] if model and ":" in model else None,
             getattr(args, "inputs", None), getattr(args, "plan", None), getattr(args, "bench", None)]
    return check_output_file(Path(path), what, tuple(str(p) for p in paths if p))


def check_not_an_input(p: Path, what: str, inputs: tuple[str | os.PathLike, ...]) -> None:
    """Refuse an output that is the same file as an input: by path, through a link, or a hard link."""
    for source in inputs:
        try:
            same = os.path.samefile(p, source)
        except (OSError, ValueError):  # either is missing (a new output, a module name), or unreadable
            continue
        if same:
            raise OutputError(
                f"{what} {str(p)!r} is the same file as the input {str(source)!r}; writing it would replace "
                "the input, so name another output file"
            )


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


def _ours_to_skip(rel_parts: tuple[str, ...], p: Path) -> bool:
    """The manifest itself, and Python's byte-code caches of load.py (never the user's data)."""
    if rel_parts == ("manifest.json",):
        return True
    return "__pycache__" in rel_parts[:-1] and p.suffix == ".pyc" and p.is_file() and not p.is_symlink()


def foreign_files(folder: Path, manifest: dict[str, Any]) -> list[str]:
    """Entries of an earlier apply folder that apply did not write, or that changed since it wrote them.

    `manifest["written"]` lists what apply wrote, with digests; every other file, link or folder (one that
    holds none of them) is foreign. A manifest without `written` (a release that recorded none) makes
    every entry foreign: nothing there can be told apart from the user's.
    """
    recorded = manifest.get("written") if isinstance(manifest.get("written"), dict) else {}
    holders = {parent.as_posix() for rel in recorded if isinstance(rel, str) for parent in Path(rel).parents}
    found = []
    for p in sorted(folder.rglob("*")):
        parts = p.relative_to(folder).parts
        rel = "/".join(parts)
        if _ours_to_skip(parts, p):
            continue
        if p.is_dir() and not p.is_symlink():
            if rel not in holders and parts[-1] != "__pycache__":
                found.append(rel + "/")
            continue
        if not p.is_file() or p.is_symlink() or recorded.get(rel) != _sha256(p):
            found.append(rel)
    # a folder's own files need no second mention
    return [rel for rel in found if not any(rel != d and rel.startswith(d) for d in found if d.endswith("/"))]


def remove_written(folder: Path, manifest: dict[str, Any]) -> bool:
    """Delete from `folder` only what apply wrote and nobody changed since (digests in
    `manifest["written"]`, the manifest, Python's caches), then the folders left empty. True when the
    folder is gone; anything else is left where it is."""
    recorded = manifest.get("written") if isinstance(manifest.get("written"), dict) else {}
    for p in sorted(folder.rglob("*"), key=lambda q: len(q.parts), reverse=True):
        parts = p.relative_to(folder).parts
        if p.is_dir() and not p.is_symlink():
            with contextlib.suppress(OSError):
                p.rmdir()  # only when empty
        elif _ours_to_skip(parts, p) or (p.is_file() and not p.is_symlink()
                                         and recorded.get("/".join(parts)) == _sha256(p)):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
    with contextlib.suppress(OSError):
        folder.rmdir()
    return not os.path.lexists(folder)


# -- what the command prints ----------------------------------------------------------------


def out(args: argparse.Namespace, text: str) -> None:
    """The command's result on the real stdout (user code runs with stdout sent to stderr); names from
    files and graphs in it are shown with their control characters escaped (printable)."""
    print(printable(text), file=getattr(args, "stdout", None) or sys.stdout)


def err(text: str) -> None:
    """One line on stderr, its control characters escaped: error messages quote names from the files."""
    print(f"ckpt-planner: {printable(text)}", file=sys.stderr)


def say(args: argparse.Namespace, text: str) -> None:
    """Human-readable output: stdout, unless --quiet or --json."""
    if not args.quiet and not args.json:
        out(args, text)


def note(args: argparse.Namespace, text: str) -> None:
    if not args.quiet:
        err(text)


def progress_bar(args: argparse.Namespace, total: int, desc: str):
    """A tqdm bar on stderr; off with --quiet or when stderr is not a terminal."""
    from tqdm import tqdm

    return tqdm(
        total=total, desc=desc, file=sys.stderr, leave=False, disable=args.quiet or not sys.stderr.isatty(),
        bar_format="{desc:<30} {bar} {n_fmt}/{total_fmt} [{elapsed}]",
    )


@contextlib.contextmanager
def bar_stage(bar, desc: str) -> Iterator[None]:
    """One step of `bar`, shown as `desc` while it runs."""
    bar.set_description_str(desc)
    yield
    bar.update(1)


def one_line(e: BaseException) -> str:
    return " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip()) or type(e).__name__


@contextlib.contextmanager
def no_logs() -> Iterator[None]:
    """torch logs tracebacks (fake tensors, export, dynamo) before errors we report in one line."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(previous)


def one_line_warnings(show: Callable[..., None]) -> Callable[..., None]:
    """warnings.showwarning that gives the planner's own notices (a timing store it ignores) one line like
    its errors, and passes every other warning to `show` (catch_warnings puts the original back)."""
    from ..profile.timing_store import TimingStoreWarning

    def shown(message, category, filename, lineno, file=None, line=None) -> None:
        if issubclass(category, TimingStoreWarning):
            err(f"warning: {one_line(message) if isinstance(message, BaseException) else message}")
        else:
            show(message, category, filename, lineno, file, line)

    return shown

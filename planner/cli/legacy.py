"""What earlier releases wrote that this one still loads: the `load.py` of their apply folders.

Plan files need nothing here: the schema reads every version (`plan_schema.py`), and a plan saved by
the flat layout of `planner/` rebuilds as it is. An apply folder's data (manifest, plan, state, inputs)
loads as it is too. Its `load.py`, though, imports the module paths of the layout that wrote it
(`ckpt_planner.loading`, `ckpt_planner.capture.capture`, `ckpt_planner.verify`), which are gone. So
`load_applied` replaces a `load.py` that is byte for byte one an earlier apply wrote (never one a user
edited) with today's, and records its digest. Today's imports only `ckpt_planner.cli.loading`, whose
names stay put for it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["EARLIER_LOAD_SCRIPTS", "is_earlier_load_script", "refresh_load_script"]

EARLIER_LOAD_SCRIPTS = frozenset({
    "02b3500878b3f323081fe6069f576a4c67a0957d9ca3f0e4ac2fa14b3a365c83",  # stage folders (cli/, capture/, ...)
    "932140f4936c8eb6884fb4d0281039f4790771054da96212959f796d0271c57d",  # flat layout, trust flags named
    "567311bd9f19ecda22f52513f16767a7d8b2faaa6a2fc1d7d188bd924d6a2f7d",  # flat layout, first apply folders
})
"""sha256 of each `load.py` an earlier `ckpt-planner apply` wrote."""


def is_earlier_load_script(data: bytes) -> bool:
    return hashlib.sha256(data).hexdigest() in EARLIER_LOAD_SCRIPTS


def _replace_text(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in its folder: never half-written."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def refresh_load_script(folder: Path, manifest: dict[str, Any], current: str) -> bool:
    """Replace `folder`'s load.py with `current` where an earlier apply wrote it unchanged; True if replaced.
    A folder that cannot be written (read-only, another user's) loads all the same and is left as it is."""
    script = folder / "load.py"
    try:
        if script.is_symlink() or not script.is_file() or not is_earlier_load_script(script.read_bytes()):
            return False
        _replace_text(script, current)
        written = manifest.get("written")
        if isinstance(written, dict) and "load.py" in written:
            written["load.py"] = hashlib.sha256(current.encode()).hexdigest()
            _replace_text(folder / "manifest.json", json.dumps(manifest, indent=2))
    except OSError:
        return False
    return True

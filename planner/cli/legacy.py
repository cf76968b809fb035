"""What earlier releases wrote that this one still loads: the `load.py` of their apply folders.

Plan files need nothing here: the schema reads every version (`plan_schema.py`), and a plan saved by
the flat layout of `planner/` rebuilds as it is. An apply folder's data (manifest, plan, state, inputs)
loads as it is too. Its `load.py`, though, imports the module paths of the layout that wrote it
(`ckpt_planner.loading`, `ckpt_planner.capture.capture`, `ckpt_planner.verify`), which are gone. So
`load_applied`, once the folder has loaded, replaces a `load.py` that is byte for
byte one an earlier apply wrote (never one a user edited) with today's, and records its digest; each file
keeps its mode, a link is never written through, and a folder that does not load is left as it was.
Today's imports only `ckpt_planner.cli.loading`, whose names stay put for it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ..errors import OutputError
from ..plan_schema import read_bounded, write_file

__all__ = ["EARLIER_LOAD_SCRIPTS", "is_earlier_load_script", "refresh_load_script"]

EARLIER_LOAD_SCRIPTS = frozenset({
    "02b3500878b3f323081fe6069f576a4c67a0957d9ca3f0e4ac2fa14b3a365c83",  # stage folders (cli/, capture/, ...)
    "932140f4936c8eb6884fb4d0281039f4790771054da96212959f796d0271c57d",  # flat layout, trust flags named
    "567311bd9f19ecda22f52513f16767a7d8b2faaa6a2fc1d7d188bd924d6a2f7d",  # flat layout, first apply folders
})
"""sha256 of each `load.py` an earlier `ckpt-planner apply` wrote."""


MAX_LOAD_SCRIPT_BYTES = 64 << 10
"""The most of a `load.py` read to compare it with the earlier ones (each is under 2 KiB)."""


def is_earlier_load_script(data: bytes) -> bool:
    return hashlib.sha256(data).hexdigest() in EARLIER_LOAD_SCRIPTS


def refresh_load_script(folder: Path, manifest: dict[str, Any], current: str) -> bool:
    """Replace `folder`'s load.py with `current` where an earlier apply wrote it unchanged; True if replaced.
    Call it only after the folder has loaded. Each file keeps its mode; a link is neither read nor
    written through. A folder that cannot be written (read-only, another user's) is left as it is."""
    script = folder / "load.py"
    data = read_bounded(script, MAX_LOAD_SCRIPT_BYTES)  # a link, a fifo, a 10 GiB file: not an earlier script
    if data is None or not is_earlier_load_script(data):
        return False
    try:
        write_file(script, current, "load.py")
        written = manifest.get("written")
        if isinstance(written, dict) and "load.py" in written:
            written["load.py"] = hashlib.sha256(current.encode()).hexdigest()
            write_file(folder / "manifest.json", json.dumps(manifest, indent=2), "manifest.json")
    except OutputError:
        return False
    return True

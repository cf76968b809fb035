"""What the command line prints and writes cannot hurt the user: names from files and graphs are shown with
their control characters escaped, `apply -o` deletes only what apply wrote (even when a file lands in the
folder while it runs), a folder apply cannot vouch for is refused, and no output replaces an input."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch
from ckpt_planner.cli import outputs
from ckpt_planner.cli.commands import main

from .cli_checks import one_line, run
from .test_outputs import FACTORY, PLAN_ARGS, leftovers

# What a terminal must never receive raw: C0 (ESC, BEL, CR), DEL, C1 (a one-byte CSI), bidi controls,
# and a lone surrogate (which a UTF-8 console cannot even encode).
RAW = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ud800-\udfff]")
TITLE = "\x1b]0;pwned\x07"  # sets the terminal's title
CLIPBOARD = "\x1b]52;c;cHduZWQ=\x07"  # OSC 52: writes the clipboard
HOSTILE = f"{TITLE}{CLIPBOARD}\x9b31m\u202eevil\r\x7f"
MODULE_NAME = HOSTILE.replace("\r", "")  # a line break in a name breaks the graph's generated code

EVIL_MODULE = f'''
import torch
from torch import nn


class Evil(nn.Module):
    def __init__(self):
        super().__init__()
        self.add_module({MODULE_NAME!r}, nn.Linear(8, 8))
        self.tail = nn.Linear(8, 8)

    def forward(self, x):
        return self.tail(getattr(self, {MODULE_NAME!r})(x).relu())


def make():
    torch.manual_seed(0)
    return Evil(), (torch.randn(4, 8),)
'''


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("safety")
    (d / "factory.py").write_text(FACTORY)
    fac = f"{d}/factory.py:make"
    plan = d / "plan.json"
    assert main(["plan", fac, *PLAN_ARGS, "-o", str(plan)]) == 0
    return {"factory": fac, "plan": plan}


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# -- item 4: control characters ----------------------------------------------------------------


@pytest.mark.parametrize("text, shown", [
    ("plain ascii, é and 中", "plain ascii, é and 中"),
    ("lines\nand\ttabs", "lines\nand\ttabs"),
    (TITLE, "\\x1b]0;pwned\\x07"),
    ("\x00\x08\x0b\x0c\r\x1f\x7f", "\\x00\\x08\\x0b\\x0c\\x0d\\x1f\\x7f"),
    ("\x80\x9b\x9f", "\\x80\\x9b\\x9f"),
    ("\u202eabc\u2066\u200f\u061c", "\\u202eabc\\u2066\\u200f\\u061c"),
    ("\udc80", "\\udc80"),
])
def test_printable_escapes_every_control_character(text, shown):
    assert outputs.printable(text) == shown
    assert not RAW.search(outputs.printable(text))


def test_a_plan_files_fingerprint_reaches_the_terminal_escaped(made, tmp_path, capsys):
    data = json.loads(made["plan"].read_text())
    data["fingerprint"] = HOSTILE + data["fingerprint"]
    evil = tmp_path / "evil.json"
    evil.write_text(json.dumps(data))
    code, err = run(["apply", made["factory"], evil, "-o", tmp_path / "out"], capsys)
    line = one_line(err)
    assert code == 2 and "\\x1b]0;pwned\\x07" in line and "\\x1b]52;c;" in line, line
    assert not RAW.search(err), repr(err)


def test_graph_names_are_printed_escaped(tmp_path, capsys):
    (tmp_path / "evil.py").write_text(EVIL_MODULE)
    code = main(["profile", f"{tmp_path}/evil.py:make"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "\\x1b]0;pwned\\x07" in out and not RAW.search(out) and not RAW.search(err), repr(out)


@pytest.mark.parametrize("fmt", ["md", "html"])
def test_reports_write_names_escaped(made, tmp_path, capsys, fmt):
    data = json.loads(made["plan"].read_text())
    data["model"] = HOSTILE
    data["notes"] = [f"a note {HOSTILE}"]
    data["regions"][0]["modules"] = [HOSTILE]
    evil = tmp_path / "evil.json"
    evil.write_text(json.dumps(data))
    out = tmp_path / f"r.{fmt}"
    code, err = run(["report", evil, "--format", fmt, "-o", out, "--quiet"], capsys)
    assert code == 0, err
    text = out.read_text()
    assert not RAW.search(text), repr(RAW.search(text))
    assert "\\x1b" in text and "pwned" in text and "\\u202eevil" in text  # shown, not sent


# -- item 9: a file that lands in the output folder while apply runs --------------------------------


def _lands_during_apply(monkeypatch, path: Path, content: str) -> None:
    """The user's file appears in the output folder after apply's check, before its folder is swapped in
    (torch.save writes the new folder's state dict in between)."""
    real = torch.save

    def save(*a, **k):
        if not path.exists():
            path.write_text(content)
        return real(*a, **k)

    monkeypatch.setattr(torch, "save", save)


def test_a_file_that_lands_in_an_empty_output_folder_is_kept(made, tmp_path, capsys, monkeypatch):
    out = tmp_path / "applied"
    out.mkdir()
    _lands_during_apply(monkeypatch, out / "late.txt", "written while apply ran")
    code, err = run(["apply", made["factory"], made["plan"], "-o", out], capsys)
    line = one_line(err)
    assert code == 2 and "late.txt" in line, line
    assert snapshot(out) == {"late.txt": b"written while apply ran"}
    assert leftovers(tmp_path) == []


def test_a_file_that_lands_in_an_earlier_apply_folder_is_kept(made, tmp_path, capsys, monkeypatch):
    out = tmp_path / "applied"
    argv = ["apply", made["factory"], made["plan"], "-o", out, "--quiet"]
    assert run(argv, capsys)[0] == 0
    before = snapshot(out)
    _lands_during_apply(monkeypatch, out / "code" / "notes.py", "# mine")
    code, err = run(argv, capsys)
    line = one_line(err)
    assert code == 2 and "code/notes.py" in line, line
    assert snapshot(out) == {**before, "code/notes.py": b"# mine"}
    assert leftovers(tmp_path) == []
    monkeypatch.undo()
    (out / "code" / "notes.py").unlink()
    assert run(argv, capsys)[0] == 0  # only apply's own files: replaced


def test_replacing_deletes_only_what_apply_wrote(tmp_path):
    """Files that appear in the old folder after it was judged (through a handle opened before) stay."""
    folder = tmp_path / "old"
    (folder / "code").mkdir(parents=True)
    (folder / "plan.json").write_text("{}")
    (folder / "code" / "module.py").write_text("# generated")
    manifest = {"format": "ckpt-planner/applied", "written": outputs.digests(folder)}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    (folder / "code" / "late.py").write_text("# the user's")
    (folder / "plan.json").write_text('{"edited": true}')
    assert not outputs.remove_written(folder, manifest)
    assert snapshot(folder) == {"code/late.py": b"# the user's", "plan.json": b'{"edited": true}'}


# -- item 10: a folder from a release that recorded no digests ----------------------------------


def test_an_apply_folder_without_digests_is_never_replaced(made, tmp_path, capsys):
    out = tmp_path / "applied"
    argv = ["apply", made["factory"], made["plan"], "-o", out, "--quiet"]
    assert run(argv, capsys)[0] == 0
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["written"]  # as an earlier release wrote it
    (out / "manifest.json").write_text(json.dumps(manifest))
    (out / "state_dict.pt").write_bytes(b"the user's fine-tuned weights")
    (out / "code" / "notes.py").write_text("# the user's notes")
    before = snapshot(out)
    code, err = run(argv, capsys)
    line = one_line(err)
    assert code == 2 and "recorded no digests" in line and str(out) in line, line
    assert snapshot(out) == before and leftovers(tmp_path) == []
    # unchanged files do not help: apply cannot tell them from the user's
    (out / "code" / "notes.py").unlink()
    code, err = run(argv, capsys)
    assert code == 2 and "recorded no digests" in one_line(err)


def test_a_folder_inside_an_apply_folder_that_apply_did_not_make_is_named(made, tmp_path, capsys):
    out = tmp_path / "applied"
    argv = ["apply", made["factory"], made["plan"], "-o", out, "--quiet"]
    assert run(argv, capsys)[0] == 0
    (out / "runs").mkdir()
    code, err = run(argv, capsys)
    assert code == 2 and "runs/" in one_line(err)
    assert (out / "runs").is_dir()


# -- item 11: an output that is an input --------------------------------------------------------


def test_report_over_its_own_plan_file_is_refused(made, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_bytes(made["plan"].read_bytes())
    for target in (plan, tmp_path / "." / "plan.json"):
        code, err = run(["report", plan, "-o", target], capsys)
        line = one_line(err)
        assert code == 2 and "same file as the input" in line, line
    hard = tmp_path / "report.html"
    os.link(plan, hard)  # another name for the plan: writing it would replace the plan's content
    code, err = run(["report", plan, "-o", hard], capsys)
    assert code == 2 and "same file as the input" in one_line(err)
    assert plan.read_bytes() == made["plan"].read_bytes() == hard.read_bytes()
    assert leftovers(tmp_path) == []


def test_plan_over_its_factory_file_is_refused(tmp_path, capsys):
    (tmp_path / "factory.py").write_text(FACTORY)
    code, err = run(["plan", f"{tmp_path}/factory.py:make", *PLAN_ARGS, "-o", tmp_path / "factory.py"], capsys)
    assert code == 2 and "same file as the input" in one_line(err)
    assert (tmp_path / "factory.py").read_text() == FACTORY


def test_a_hard_linked_output_is_refused_not_split(made, tmp_path, capsys):
    out = tmp_path / "report.md"
    out.write_text("the old report")
    os.link(out, tmp_path / "published.md")
    code, err = run(["report", made["plan"], "-o", out], capsys)
    line = one_line(err)
    assert code == 2 and "hard link" in line and str(out) in line, line
    assert out.read_text() == (tmp_path / "published.md").read_text() == "the old report"
    assert os.stat(out).st_ino == os.stat(tmp_path / "published.md").st_ino

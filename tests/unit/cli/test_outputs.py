"""Output paths lose nothing: -o never replaces a device node, fifo or socket, keeps a file's mode, says a
full disk in one line (exit 2) with nothing half-written, and `apply -o` never deletes the user's files."""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
from pathlib import Path

import pytest
import torch
from ckpt_planner.cli import outputs
from ckpt_planner.cli.commands import main

from .cli_checks import one_line, run

FACTORY = '''
import torch
from ckpt_planner.cli.examples import MLPChain


def make():
    torch.manual_seed(0)
    return MLPChain(d=32, blocks=4), (torch.randn(64, 32),)
'''
PLAN_ARGS = ["--solver", "uniform", "--activation-budget", "0.7", "--curve-points", "0", "--quiet"]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("outputs")
    (d / "factory.py").write_text(FACTORY)
    fac = f"{d}/factory.py:make"
    plan = d / "plan.json"
    assert main(["plan", fac, *PLAN_ARGS, "-o", str(plan)]) == 0
    return {"factory": fac, "plan": plan}




def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def _special_files(tmp_path: Path) -> list[tuple[Path, str]]:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    made = [(fifo, "a fifo")]
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(tmp_path / "sock"))
    made.append((tmp_path / "sock", "a socket"))
    if os.geteuid() == 0:  # a copy of /dev/null, made here: the real /dev is never touched
        os.mknod(tmp_path / "null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        made.append((tmp_path / "null", "a character device"))
    (tmp_path / "target").write_text("the user's file")
    (tmp_path / "link").symlink_to(tmp_path / "target")
    made.append((tmp_path / "link", "a symbolic link"))
    return made


def test_device_nodes_fifos_sockets_and_links_are_never_replaced(made, tmp_path, capsys):
    for path, kind in _special_files(tmp_path):
        before = os.lstat(path)
        for argv in (["plan", made["factory"], *PLAN_ARGS, "-o", path],
                     ["report", made["plan"], "-o", path, "--format", "md"]):
            code, err = run(argv, capsys)
            line = one_line(err)
            assert code == 2 and kind in line and str(path) in line, line
            after = os.lstat(path)
            assert stat.S_IFMT(after.st_mode) == stat.S_IFMT(before.st_mode) and after.st_ino == before.st_ino
    assert (tmp_path / "target").read_text() == "the user's file"
    assert leftovers(tmp_path) == []


def test_an_existing_files_mode_is_kept(made, tmp_path, capsys):
    out = tmp_path / "plan.json"
    out.write_text("old")
    os.chmod(out, 0o600)
    code, err = run(["plan", made["factory"], *PLAN_ARGS, "-o", out], capsys)
    assert code == 0, err
    assert stat.S_IMODE(out.stat().st_mode) == 0o600 and json.loads(out.read_text())["regions"]
    report = tmp_path / "r.md"
    report.write_text("old")
    os.chmod(report, 0o640)
    assert run(["report", out, "-o", report], capsys)[0] == 0
    assert stat.S_IMODE(report.stat().st_mode) == 0o640
    fresh = tmp_path / "fresh.md"
    umask = os.umask(0o027)
    try:
        assert run(["report", out, "-o", fresh], capsys)[0] == 0
    finally:
        os.umask(umask)
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o640  # a new file: 0666 less the umask


def _full_disk(monkeypatch) -> None:
    """Every write to a file fails as on a full disk (the console's writes go through Python's streams)."""
    real = os.write

    def write(fd, data):
        if fd > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)


def test_a_full_disk_is_one_line_exit_2_and_nothing_half_written(made, tmp_path, capsys, monkeypatch):
    out = tmp_path / "plan.json"
    out.write_text("the previous plan")
    report = tmp_path / "r.html"
    with monkeypatch.context() as m:
        _full_disk(m)
        for argv in (["plan", made["factory"], *PLAN_ARGS, "-o", out], ["report", made["plan"], "-o", report]):
            code, err = run(argv, capsys)
            line = one_line(err)
            assert code == 2 and "No space left on device" in line and "nothing was written" in line, line
    assert out.read_text() == "the previous plan" and not report.exists()
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"),
                                     RuntimeError("PytorchStreamWriter failed writing file data/0: file write failed")])
def test_apply_on_a_full_disk_leaves_the_earlier_folder(made, tmp_path, capsys, monkeypatch, failure):
    out = tmp_path / "applied"
    assert run(["apply", made["factory"], made["plan"], "-o", out, "--quiet"], capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}

    def save(*a, **k):
        raise failure

    monkeypatch.setattr(torch, "save", save)
    code, err = run(["apply", made["factory"], made["plan"], "-o", out], capsys)
    line = one_line(err)
    assert code == 2 and "could not be written" in line and "left as it was" in line, line
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert leftovers(tmp_path) == []


def test_reapply_refuses_and_names_the_users_files_then_replaces_its_own(made, tmp_path, capsys):
    out = tmp_path / "applied"
    argv = ["apply", made["factory"], made["plan"], "-o", out, "--quiet"]
    assert run(argv, capsys)[0] == 0
    (out / "notes.txt").write_text("my notes")
    (out / "finetuned.pt").write_bytes(b"my weights")
    edited = (out / "load.py").read_text() + "\n# my change\n"
    (out / "load.py").write_text(edited)
    (out / "__pycache__").mkdir()
    (out / "__pycache__" / "load.cpython-311.pyc").write_bytes(b"cache")

    code, err = run(argv, capsys)
    line = one_line(err)
    assert code == 2 and all(n in line for n in ("notes.txt", "finetuned.pt", "load.py")), line
    assert (out / "notes.txt").read_text() == "my notes" and (out / "load.py").read_text() == edited
    assert (out / "finetuned.pt").read_bytes() == b"my weights"

    (out / "notes.txt").unlink()
    (out / "finetuned.pt").unlink()
    (out / "load.py").write_text(edited.removesuffix("\n# my change\n"))
    assert run(argv, capsys)[0] == 0  # only its own files, unchanged (and Python's cache): replaced
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["written"]) >= {"plan.json", "load.py", "state_dict.pt", "inputs.pt", "code/module.py"}


def test_write_file_refuses_a_path_that_became_a_fifo(tmp_path):
    """Checked again at write time: the path may have changed since the command started."""
    path = tmp_path / "out.json"
    outputs.check_output_file(path, "output")
    os.mkfifo(path)
    with pytest.raises(outputs.OutputError, match="a fifo"):
        outputs.write_file(path, "{}")
    assert stat.S_ISFIFO(os.lstat(path).st_mode) and leftovers(tmp_path) == []


def test_a_manifest_with_a_5000_digit_number_is_not_ours_and_is_one_line(made, tmp_path, capsys):
    out = tmp_path / "applied"
    out.mkdir()
    (out / "manifest.json").write_text('{"format": "ckpt-planner/applied", "version": ' + "9" * 5000 + "}")
    code, err = run(["apply", made["factory"], made["plan"], "-o", out], capsys)
    assert code == 2 and "not an empty folder" in one_line(err)
    assert [p.name for p in out.iterdir()] == ["manifest.json"]


def test_plan_save_in_python_never_replaces_a_node_and_keeps_a_files_mode(made, tmp_path):
    """`Plan.save` writes through the same writer as the command line."""
    from ckpt_planner.plan import Plan

    plan = Plan.load(made["plan"])
    for path, kind in _special_files(tmp_path):
        before = os.lstat(path)
        with pytest.raises(outputs.OutputError, match=kind):
            plan.save(path)
        after = os.lstat(path)
        assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino)
    assert (tmp_path / "target").read_text() == "the user's file"
    private = tmp_path / "private.json"
    private.write_text("{}")
    private.chmod(0o600)
    plan.save(private)
    assert stat.S_IMODE(private.stat().st_mode) == 0o600 and Plan.load(private).spans() == plan.spans()
    assert leftovers(tmp_path) == []

"""Members torch.export.load would unpickle, or that the allowlist (capture/pt2/archive.py) does not know:
refused before torch reads the archive, in one line naming the member, and no payload runs; with the user's
trust (--trust-pickle) torch runs it, which shows each file really is hostile.

A second model with a pickled weight or sample inputs; a weight or the sample inputs of the model itself
pickled; a pickled constant; the older layout torch retries; an apply folder's load.py over such an archive;
a range constraint that is code, and members no exporter writes.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import zipfile

import pytest
from ckpt_planner.capture.pt2.archive import unsafe_members
from ckpt_planner.cli.commands import main
from ckpt_planner.cli.loading import load_model
from ckpt_planner.errors import InputError

from ..cli.cli_checks import one_line, run
from .pt2_checks import (
    Payload,
    members,
    pickled_constant,
    pickled_sample_inputs,
    pickled_weight,
    rewrite,
    second_model,
    write,
)


@pytest.mark.parametrize("payload_in", ["weight", "sample_inputs"])
def test_second_model_with_pickled_payload_runs_nothing(clean_pt2, tmp_path, capsys, payload_in):
    marker = tmp_path / "ran"
    evil = second_model(clean_pt2, tmp_path / "evil.pt2", marker, payload_in=payload_in)

    code, err = run(["profile", evil], capsys)
    assert not marker.exists(), "the payload ran"
    line = one_line(err)
    assert code == 2 and "--trust-pickle" in line and "models/pwnXXXXX" in line, line
    code, err = run(["plan", evil, "--curve-points", "0", "-o", tmp_path / "plan.json"], capsys)
    assert not marker.exists(), "the payload ran"
    assert code == 2 and "--trust-pickle" in one_line(err)
    assert not (tmp_path / "plan.json").exists()

    # The file really is hostile: torch.export.load runs the payload when the user trusts the file.
    try:
        load_model(str(evil), trust_pickle=True)
    except InputError:
        pass
    assert marker.exists()


@pytest.mark.parametrize("make_edit", [pickled_weight, pickled_sample_inputs])
def test_pt2_with_pickled_member_is_refused_and_runs_nothing(clean_pt2, tmp_path, capsys, make_edit):
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.pt2"
    rewrite(clean_pt2, evil, make_edit(marker))
    out = tmp_path / "plan.json"

    code, err = run(["plan", evil, "--curve-points", "0", "-o", out], capsys)
    line = one_line(err)
    assert code == 2 and "--trust-pickle" in line and "unpickle" in line, line
    assert not marker.exists() and not out.exists()

    # The file is really hostile: with the user's consent, torch.export.load runs the payload.
    with pytest.raises(InputError):
        load_model(str(evil), trust_pickle=True)
    assert marker.exists()


def test_pt2_pickled_constant_and_older_layout_are_listed(clean_pt2, tmp_path):
    from ckpt_planner.capture.pt2.archive import unsafe_members

    assert unsafe_members(clean_pt2.read_bytes()) == []
    evil = tmp_path / "const.pt2"
    rewrite(clean_pt2, evil, pickled_constant(tmp_path / "ran"))
    assert any("constant 'evil'" in m for m in unsafe_members(evil.read_bytes()))
    # torch.export.load retries a failed archive as the older layout if a top-level `version` exists
    legacy = tmp_path / "legacy.pt2"
    with zipfile.ZipFile(clean_pt2) as zin, zipfile.ZipFile(legacy, "w") as zout:
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))
        zout.writestr("version", "1")
        zout.writestr("serialized_state_dict.pt", pickle.dumps(Payload(tmp_path / "ran")))
    assert unsafe_members(legacy.read_bytes())
    with pytest.raises(InputError, match="--trust-pickle"):
        load_model(str(legacy))
    assert not (tmp_path / "ran").exists()


def test_clean_pt2_loads_without_trust(clean_pt2):
    loaded = load_model(str(clean_pt2))
    assert loaded.kind == "pt2" and loaded.example_inputs[0].shape == (64, 32)


def test_apply_folder_holding_the_hostile_archive_runs_nothing_from_load_py(clean_pt2, tmp_path, capsys):
    """`python load.py` in an apply folder whose model.pt2 was swapped for the attack: exit 2, one line, no code."""
    plan, out = tmp_path / "plan.json", tmp_path / "applied"
    assert main(["plan", str(clean_pt2), "--solver", "uniform", "--activation-budget", "0.7", "--curve-points", "0",
                 "--quiet", "-o", str(plan)]) == 0
    assert main(["apply", str(clean_pt2), str(plan), "-o", str(out), "--quiet"]) == 0
    capsys.readouterr()
    marker = tmp_path / "ran"
    second_model(clean_pt2, out / "model.pt2", marker, payload_in="weight")
    proc = subprocess.run([sys.executable, "load.py"], cwd=out, capture_output=True, text=True, timeout=300)
    assert not marker.exists(), "the payload ran"
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "--trust-pickle" in proc.stderr, proc.stderr


def test_range_constraint_and_unknown_members_are_refused(clean_pt2, tmp_path):
    root, files = members(clean_pt2)
    graph = json.loads(files["models/model.json"])
    graph["range_constraints"] = {"__import__('os')": {"min_val": 0, "max_val": None}}
    bad_range = write(tmp_path / "range.pt2", root, {**files, "models/model.json": json.dumps(graph).encode()})
    assert any("range constraint" in m for m in unsafe_members(bad_range.read_bytes()))
    for extra in ("notes.txt", "data/aotinductor/model/x.so", "data/weights/weight_99", "models/other.json"):
        odd = write(tmp_path / "odd.pt2", root, {**files, extra: b"x"})
        assert any(extra in m for m in unsafe_members(odd.read_bytes())), extra
    assert unsafe_members(clean_pt2.read_bytes()) == []

"""A crafted .pt2 from an untrusted source runs no code and cannot exhaust memory.

Each test builds the hostile archive the way an attacker would (members torch.export.load reads
that our old check did not: a second model, its pickled weight or sample inputs, a size expression
that sympy evaluates, a zip bomb) and checks that the payload, which would create a marker file,
never ran, and that the command line says so in one line with exit code 2.
"""

from __future__ import annotations

import json
import pickle
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from ckpt_planner.capture.pt2.archive import unsafe_members
from ckpt_planner.cli.commands import main
from ckpt_planner.cli.loading import load_model
from ckpt_planner.errors import InputError

from tests.models.examples import MLPChain

from .cli_checks import one_line, run


class EvalPayload:
    """Unpickling this evaluates Python that creates the marker file (`__reduce__` is `eval`), then
    returns `value` (Python source) so that loading goes on as if nothing happened."""

    def __init__(self, marker: Path, value: str) -> None:
        self.marker, self.value = str(marker), value

    def __reduce__(self):
        return (eval, (f"(open({self.marker!r}, 'w').close(), {self.value})[1]",))




@pytest.fixture(scope="module")
def clean_pt2(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("pt2") / "clean.pt2"
    torch.export.save(torch.export.export(MLPChain(d=32, blocks=4), (torch.randn(64, 32),)), path)
    return path


def members(src: Path) -> tuple[str, dict[str, bytes]]:
    """(root folder, {name inside the root: bytes})."""
    with zipfile.ZipFile(src) as z:
        root = z.namelist()[0].split("/", 1)[0]
        return root, {n.split("/", 1)[1]: z.read(n) for n in z.namelist()}


def write(dst: Path, root: str, files: dict[str, bytes], *, deflated: tuple[str, ...] = ()) -> Path:
    with zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as z:
        for name, data in files.items():
            method = zipfile.ZIP_DEFLATED if name in deflated else zipfile.ZIP_STORED
            z.writestr(f"{root}/{name}", data, compress_type=method)
    return dst


def second_model(clean: Path, dst: Path, marker: Path, *, payload_in: str) -> Path:
    """The issue's attack: `models/pwnXXXXX` (torch loads every models/* member, naming it by cutting five
    characters), with its own weights config, constants config and sample inputs; the payload is a weight
    marked use_pickle or the sample inputs."""
    root, files = members(clean)
    files["models/pwnXXXXX"] = files["models/model.json"]
    weights = json.loads(files["data/weights/model_weights_config.json"])
    if payload_in == "weight":
        weights["config"]["evil"] = {"path_name": "evil_0", "is_param": False, "use_pickle": True, "tensor_meta": None}
        files["data/weights/evil_0"] = pickle.dumps(EvalPayload(marker, "__import__('torch').zeros(1)"))
        files["data/sample_inputs/pwn.pt"] = files["data/sample_inputs/model.pt"]
    else:
        files["data/sample_inputs/pwn.pt"] = pickle.dumps(EvalPayload(marker, "((), {})"))
    files["data/weights/pwn_weights_config.json"] = json.dumps(weights).encode()
    files["data/constants/pwn_constants_config.json"] = files["data/constants/model_constants_config.json"]
    return write(dst, root, files)


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


def with_size_expression(clean: Path, dst: Path, expr: str) -> Path:
    """The graph's first size written as {"as_expr": {"expr_str": expr}} (`{hint}` in `expr` becomes the
    size): torch passes it to sympify."""
    root, files = members(clean)
    graph = json.loads(files["models/model.json"])
    for meta in graph["graph_module"]["graph"]["tensor_values"].values():
        if meta["sizes"] and "as_int" in meta["sizes"][0]:
            hint = meta["sizes"][0]["as_int"]
            meta["sizes"][0] = {"as_expr": {"expr_str": expr.replace("{hint}", str(hint)), "hint": {"as_int": hint}}}
            break
    files["models/model.json"] = json.dumps(graph).encode()
    return write(dst, root, files)


def test_size_expression_that_sympy_would_evaluate_runs_nothing(clean_pt2, tmp_path, capsys):
    marker = tmp_path / "ran"
    expr = f"__import__('pathlib').Path({str(marker)!r}).touch() or {{hint}}"
    evil = with_size_expression(clean_pt2, tmp_path / "expr.pt2", expr)
    code, err = run(["plan", evil, "--curve-points", "0", "-o", tmp_path / "plan.json"], capsys)
    assert not marker.exists(), "the payload ran"
    line = one_line(err)
    assert code == 2 and "size expression" in line and "models/model.json" in line, line
    assert not (tmp_path / "plan.json").exists()

    load_model(str(evil), trust_pickle=True)  # trusted: torch evaluates it, and the model loads
    assert marker.exists()


def test_size_expressions_torch_writes_pass_and_code_does_not():
    from ckpt_planner.capture.pt2.symexpr import ExprError, check_expr

    for ok in ("Symbol('s77', positive=True, integer=True)",
               "Add(Mul(Integer(4), Symbol('s77', positive=True, integer=True)), "
               "FloorDiv(Symbol('s77', positive=True, integer=True), Integer(2)))",
               "Max(Integer(4), Symbol('s0', integer=True))", "Mod(Symbol('u1', integer=True), Integer(-3))",
               "s0 * 2 + s1 // 3 - s2 % 4", "Min(s0, 8)", "-s0",
               "Pow(Symbol('s70', positive=True, integer=True), Integer(2))", "s0 ** 3"):
        check_expr(ok)
    for bad in ("__import__('os').system('true')", "s0.__class__", "Symbol('E')", "Symbol('s0', evil=1)",
                "Integer('1')", "s0 ** s1", "Pow(Integer(10), Integer(10 ** 18))", "Pow(s0, 99)", "s0 / 2", "[s0]", "lambda: 1", "Float(1.5)", "1.5", "E", "pi",
                "Mod(s0)", "Max(s0, key=1)", "f'{s0}'", "s0 if s0 else 1", "9" * 25, "(" * 300 + "1" + ")" * 300,
                "Add(" * 2000 + "1" + ")" * 2000, "s0 + " * 5000 + "1", 7):
        with pytest.raises(ExprError):
            check_expr(bad)


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


def bomb(clean: Path, dst: Path, size: int) -> Path:
    """weight_0, a name the allowlist accepts, deflated from `size` zero bytes."""
    root, files = members(clean)
    files.pop("data/weights/weight_0")
    write(dst, root, files)
    with zipfile.ZipFile(dst, "a", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        with z.open(f"{root}/data/weights/weight_0", "w", force_zip64=True) as f:
            zeros = bytes(1 << 20)
            for _ in range(size >> 20):
                f.write(zeros)
    return dst


def test_zip_bomb_is_refused_from_its_headers(clean_pt2, tmp_path, capsys):
    evil = bomb(clean_pt2, tmp_path / "bomb.pt2", 300 << 20)  # 300 MiB of zeros in about 1.4 MB
    assert evil.stat().st_size < 4 << 20
    code, err = run(["plan", evil, "--curve-points", "0"], capsys)
    line = one_line(err)
    assert code == 2 and "weight_0" in line and "limit" in line, line
    with pytest.raises(InputError, match="limit"):
        load_model(str(evil), trust_pickle=True)  # a size limit holds even for a trusted file


def test_member_whose_header_lies_about_its_size_is_stopped_while_reading(clean_pt2, tmp_path, capsys):
    """The graph JSON's headers claim 100 bytes; inflating stops there and the file is refused."""
    root, files = members(clean_pt2)
    files["models/model.json"] = files["models/model.json"] + b" " * (8 << 20)
    path = write(tmp_path / "liar.pt2", root, files, deflated=("models/model.json",))
    data = bytearray(path.read_bytes())
    name = f"{root}/models/model.json".encode()
    for sig, size_at in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):
        pos = 0
        while (pos := data.find(sig, pos)) >= 0:
            start = pos + (30 if sig == b"PK\x03\x04" else 46)
            if data[start:start + len(name)] == name:
                data[pos + size_at:pos + size_at + 4] = struct.pack("<I", 100)
            pos += 4
    path.write_bytes(bytes(data))
    with zipfile.ZipFile(path) as z:
        assert z.getinfo(f"{root}/models/model.json").file_size == 100
    code, err = run(["plan", path, "--curve-points", "0"], capsys)
    line = one_line(err)
    assert code == 2 and "models/model.json" in line, line

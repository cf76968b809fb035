"""Size expressions in a .pt2's graph (capture/pt2/symexpr.py): torch passes them to sympify, which
evaluates Python. Those torch writes pass (sizes, and the conditions on a size the data decides); code, and
values no machine computes, are refused in one line before torch reads them, and no payload runs.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from ckpt_planner.capture.pt2.symexpr import ExprError, check_expr
from ckpt_planner.cli.loading import load_model
from ckpt_planner.errors import InputError

from ..cli.cli_checks import one_line, run
from .pt2_checks import members, with_size_expression


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


def test_size_expression_past_the_magnitude_bound_is_refused(clean_pt2, tmp_path, capsys):
    with pytest.raises(ExprError, match="bits"):
        check_expr("((((10**64)**64)**64)**64)**64")  # sympy would compute 10**(64**5): it never ends
    for tower in ("Pow(Pow(s0, 64), 64)", "Mul(" + ", ".join(["s0"] * 80) + ")"):
        with pytest.raises(ExprError, match="bits"):
            check_expr(tower)
    # a tower sympy still computes (in a moment), folded away by `* 0`: refused by its bound, not its value
    path = with_size_expression(clean_pt2, tmp_path / "tower.pt2", "((10**64)**64) * 0 + {hint}")
    code, err = run(["profile", path], capsys)
    line = one_line(err)
    assert code == 2 and "size expression" in line and "bits" in line, line


def test_conditions_on_data_dependent_sizes_pass_and_code_inside_them_does_not():
    """torch writes the checks on a size the data decides (u0, a boolean mask's count) as relations."""
    u0 = "Symbol('u0', integer=True)"
    for ok in (f"LessThan({u0}, Integer(64))", f"GreaterThan({u0}, Integer(0))",
               f"And(StrictGreaterThan({u0}, Integer(1)), StrictLessThan({u0}, Integer(3)))",
               f"Not(Equality({u0}, Integer(1)))", f"Unequality(Mod({u0}, Integer(2)), Integer(0))",
               "Or(false, Eq(s0, 2))", "true", "Le(Mul(s0, s1), 4096)"):
        check_expr(ok)
    for bad in ("LessThan(__import__('os').system('true'), 1)", "Eq(s0.__class__, 1)", "true.__class__",
                "And(Symbol('u0'), 1)", "Not(s0)", "Eq(s0)", "LessThan(s0, 1, evaluate=False)", "And()",
                "Add(LessThan(s0, 1), 1)", "Max(true, 1)", "Eq(true, s0)", "Or(Eq(s0, 1), Lambda(s0, s0))",
                "LessThan(Pow(Pow(s0, 64), 64), 1)", "Not(" * 3000 + "true" + ")" * 3000):
        with pytest.raises(ExprError):
            check_expr(bad)


def test_code_inside_a_relation_runs_nothing(clean_pt2, tmp_path, capsys):
    marker = tmp_path / "ran"
    expr = f"LessThan(__import__('pathlib').Path({str(marker)!r}).touch() or {{hint}}, Integer(64))"
    evil = with_size_expression(clean_pt2, tmp_path / "relation.pt2", expr)
    code, err = run(["plan", evil, "--curve-points", "0", "-o", tmp_path / "plan.json"], capsys)
    assert not marker.exists(), "the payload ran"
    line = one_line(err)
    assert code == 2 and "size expression" in line and "LessThan" in line, line

    with contextlib.suppress(InputError):  # trusted: torch evaluates it (a condition where a size belongs)
        load_model(str(evil), trust_pickle=True)
    assert marker.exists()


class MaskedLoss(torch.nn.Module):
    """A token-classification loss over the rows a mask selects: a size the data decides (u0 <= 64)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(x).view(-1, 3)
        active = mask.view(-1) == 1
        return torch.nn.functional.cross_entropy(logits[active], labels.view(-1)[active])


def test_archive_with_a_data_dependent_size_loads(tmp_path):
    torch.manual_seed(0)
    model = MaskedLoss()
    x, labels = torch.randn(4, 16, 8), torch.randint(0, 3, (4, 16))
    mask = (torch.rand(4, 16) > 0.3).long()
    path = tmp_path / "masked.pt2"
    torch.export.save(torch.export.export(model, (x, mask, labels)), path)
    graph = members(path)[1]["models/model.json"].decode()
    assert "Symbol('u0'" in graph and re.search(r"(LessThan|GreaterThan)\(Symbol\('u0'", graph)

    loaded = load_model(str(path))  # untrusted, as the command line loads it
    assert torch.equal(loaded.model(x, mask, labels), model(x, mask, labels))

"""A graph has a bound on its size: past it, capture stops as it goes (it does not record the rest, nor
try torch.export on the same graph) and says in one line how to plan it; the bound is set with
CKPT_PLANNER_MAX_NODES. Before it, a 300,000-node graph ran for minutes without a word."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from ckpt_planner import optimize
from ckpt_planner.capture.trace import MAX_NODES_ENV, GraphTooLargeError, capture
from ckpt_planner.cli.commands import main
from ckpt_planner.errors import InputError


class Loop(nn.Module):
    """`n` additions after one Linear: a graph of about n + 4 nodes, whatever n."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.lin = nn.Linear(4, 4)
        self.traced = 0  # additions recorded by a symbolic trace: how far the trace got before it stopped

    def forward(self, x):
        x = self.lin(x)
        for _ in range(self.n):
            self.traced += isinstance(x, torch.fx.Proxy)
            x = x + 1
        return x


FACTORY = '''
import torch
from tests.unit.plan.test_plan_file_graph_bound import Loop


def make():
    return Loop(5_000), (torch.randn(2, 4),)
'''


def test_a_graph_past_the_bound_is_refused_as_it_is_traced(monkeypatch):
    monkeypatch.setenv(MAX_NODES_ENV, "1000")
    huge = Loop(100_000)
    with pytest.raises(GraphTooLargeError, match=r"more than 1,000 nodes \(stopped while tracing\)") as info:
        capture(huge, (torch.randn(2, 4),))
    assert "\n" not in str(info.value) and MAX_NODES_ENV in str(info.value)
    # Stopped at the bound, not after: one node per addition, so the trace ran about 1,000 of the 100,000.
    assert 900 <= huge.traced <= 1_100, huge.traced
    with pytest.raises(GraphTooLargeError):
        capture(Loop(2_000), (torch.randn(2, 4),), method="export")  # export's graph is bounded too
    assert capture(Loop(500), (torch.randn(2, 4),)).method == "symbolic_trace"  # within it: planned


def test_the_bound_refuses_with_exit_2_on_the_command_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(MAX_NODES_ENV, "1000")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "loopfactory.py").write_text(FACTORY)
    out = tmp_path / "plan.json"
    assert main(["plan", f"{tmp_path}/loopfactory.py:make", "--quiet", "-o", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "more than 1,000 nodes" in err
    assert not out.exists()


def test_a_bound_that_is_not_a_number_is_refused(monkeypatch):
    monkeypatch.setenv(MAX_NODES_ENV, "lots")
    with pytest.raises(InputError, match=MAX_NODES_ENV):
        optimize(Loop(3), (torch.randn(2, 4),))

"""Custom operators in a .pt2 (capture/pt2/custom_ops.py): one transformers registers is registered by
importing the installed module a fixed table names, before torch loads the file; any other operator that is
not registered is refused in one line naming it, and a file never chooses what is imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from ckpt_planner.capture.pt2 import custom_ops
from ckpt_planner.capture.pt2.archive import load_pt2_safely
from ckpt_planner.errors import InputError

from ..cli.cli_checks import one_line, run
from .pt2_checks import members, write


def _with_target(clean, dst, target: str):
    """The clean archive with its first aten node calling `target` instead."""
    root, files = members(clean)
    graph = json.loads(files["models/model.json"])
    node = next(n for n in graph["graph_module"]["graph"]["nodes"] if n["target"].startswith("torch.ops.aten."))
    node["target"] = target
    files["models/model.json"] = json.dumps(graph).encode()
    return write(dst, root, files)


def test_operator_no_library_here_registers_is_named_in_one_line(clean_pt2, tmp_path, capsys):
    odd = _with_target(clean_pt2, tmp_path / "odd.pt2", "torch.ops.cktest_absent.relu.default")
    code, err = run(["plan", odd, "--curve-points", "0", "-o", tmp_path / "plan.json"], capsys)
    line = one_line(err)
    assert code == 2 and "cktest_absent::relu" in line and "import the library" in line, line
    assert len(line) < 400 and "Node(" not in line, line


def test_known_operator_whose_library_is_missing_says_to_install_it(clean_pt2, tmp_path, monkeypatch):
    odd = _with_target(clean_pt2, tmp_path / "odd.pt2", "torch.ops.cktest_absent.relu.default")
    monkeypatch.setitem(custom_ops.KNOWN, "cktest_absent::relu", "cktest_no_such_library.ops")
    with pytest.raises(InputError, match="cktest_absent::relu.*cktest_no_such_library is not installed"):
        load_pt2_safely(odd)
    assert "cktest_no_such_library" not in sys.modules


def test_graph_operators_lists_custom_ones_only():
    graph = json.dumps({"nodes": [{"target": "torch.ops.aten.mm.default"},
                                  {"target": "torch.ops.transformers.grouped_mm_fallback.default"},
                                  {"target": "_operator.getitem"}, {"target": "torch.ops.__x__.y.default"}]})
    assert custom_ops.graph_operators(graph.encode()) == {"transformers::grouped_mm_fallback"}


# The exporting process registers transformers' operator (its MoE layers do, on import); the loading
# process has imported nothing of transformers, as the command line's has not.
_EXPORT = """
import sys, torch
import transformers.integrations.moe  # registers torch.ops.transformers.grouped_mm_fallback

class Experts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(2, 8, 4))
        self.register_buffer("offs", torch.tensor([3, 6]))

    def forward(self, x):
        return torch.ops.transformers.grouped_mm_fallback(x, self.weight, self.offs).square().sum()

torch.manual_seed(0)
model, x = Experts(), torch.randn(6, 8)
torch.export.save(torch.export.export(model, (x,)), sys.argv[1])
torch.save({"x": x, "loss": model(x).detach()}, sys.argv[2])
"""
_LOAD = """
import sys, torch
from ckpt_planner.capture.pt2.archive import load_pt2_safely

assert "transformers" not in sys.modules
ref = torch.load(sys.argv[2])
loss = load_pt2_safely(sys.argv[1]).module()(ref["x"])
assert torch.equal(loss, ref["loss"]), (loss, ref["loss"])
assert "transformers.integrations.moe" in sys.modules
print("loaded")
"""


def test_operator_transformers_registers_loads_where_transformers_is_not_imported(tmp_path):
    pytest.importorskip("transformers.integrations.moe")
    pt2, ref = tmp_path / "experts.pt2", tmp_path / "ref.pt"
    for script, args in ((_EXPORT, [pt2, ref]), (_LOAD, [pt2, ref])):
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *map(str, args)], capture_output=True,
                              text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "loaded"



def test_torchs_unresolved_node_is_told_by_its_operator():
    """Where the graph hides an operator from the look-up (JSON escapes), torch's SerializeError prints the
    whole node; the line names the operator instead."""
    from ckpt_planner.capture.pt2.load_errors import load_failure

    node = "Failed deserializing node Node(target='torch.ops.cktest_absent.relu.default', inputs=[" + "x" * 5000
    line = load_failure(RuntimeError(node), [])
    assert "cktest_absent::relu" in line and "Node(" not in line and len(line) < 400, line
    # a registered operator is not the cause: torch's own first line stays
    registered = load_failure(RuntimeError("Failed deserializing node Node(target='torch.ops.aten.mm.default', x"), [])
    assert registered.startswith("RuntimeError: Failed deserializing node Node(target='torch.ops.aten.mm"), registered

"""`ckpt-planner plan` plans through `api.plan_model`, the one place that branches: a model the capture cannot
take whole is planned in parts, as `optimize()` plans it, and the progress bar still steps through capture,
solve and the report's data."""

from __future__ import annotations

import json

from ckpt_planner.cli.commands import main

FACTORY = '''
import torch
import torch.nn as nn


class Branchy(nn.Module):
    """A branch on the values around its layers: neither symbolic_trace nor torch.export takes it whole."""

    def __init__(self, d: int = 32, blocks: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(16, d)
        self.stack = nn.Sequential(*[nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(),
                                                   nn.Linear(4 * d, d)) for _ in range(blocks)])
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        h = self.embed(x)
        h = self.stack(h) if h.mean() > 0 else self.stack(-h)
        return self.head(h).logsumexp(-1).mean()


def make():
    torch.manual_seed(0)
    return Branchy(), (torch.randn(128, 16),)
'''


def test_a_model_the_capture_cannot_take_whole_is_planned_in_parts(tmp_path, capsys):
    (tmp_path / "branchy.py").write_text(FACTORY)
    out = tmp_path / "plan.json"
    code = main(["plan", f"{tmp_path / 'branchy.py'}:make", "--solver", "uniform", "--no-autotune", "--quiet",
                 "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 0, err  # it was a capture error (exit 1): the command line never planned in parts
    plan = json.loads(out.read_text())
    assert plan["capture_method"] == "partial" and plan["regions"]
    assert all(r["first_node"].startswith("stack/") for r in plan["regions"])
    assert plan["stats"]["timeline"]["plan"]["peak_bytes"] == plan["predicted_peak_bytes"]  # the report's data
    assert plan["stats"]["cli"]["optimizer"] == "none"


def test_the_progress_bar_steps_through_plan_models_stages(monkeypatch, tmp_path):
    """Capture and profile, then solve (when plan_model's solve stage starts), then the report's data."""
    from ckpt_planner.cli import commands

    shown: list[tuple[str, int]] = []

    class Bar:
        n = 0

        def __init__(self, *a, **k) -> None:
            self.desc = ""

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

        def set_description_str(self, desc: str) -> None:
            self.desc = desc
            shown.append((desc, self.n))

        def update(self, k: int) -> None:
            self.n += k

    monkeypatch.setattr(commands, "progress_bar", Bar)
    code = main(["plan", "tests.models.small:mlp", "--solver", "dp", "--no-autotune", "--quiet",
                 "--activation-budget", "0.5"])
    assert code == 0
    assert shown[:3] == [("capturing and profiling", 0), ("solving (dp)", 1), ("memory timeline", 2)]

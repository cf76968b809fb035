"""The zoo's plans as a record, to show that a change to the code leaves every plan as it was.

Each zoo model (tests/models/zoo.py) is planned on FLOP times (plans depend on the graph alone) with
the safety net on, by every deterministic solver at two fractions of its activation memory, at the
smallest budget an infeasible call names, and at the knee (no budget). `--compare` lists the records
that differ between two snapshots; `auto` runs a MILP that stops on a wall-clock limit, so its figures
may move between runs while the other solvers' must not.

    python -m benchmarks.plan_snapshot --out before.json         # on the old tree
    python -m benchmarks.plan_snapshot --out after.json          # on the new one
    python -m benchmarks.plan_snapshot --compare before.json after.json
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path
from typing import Any

from ._io import write_text

SOLVERS = ("auto", "dp", "greedy", "uniform", "selective", "structured")
FRACTIONS = (0.75, 0.25)
FIELDS = ("regions", "predicted_peak_bytes", "budget_bytes", "baseline_peak_bytes", "predicted_recompute_s",
          "notes", "fingerprint", "stats")


def _record(plan: Any) -> dict[str, Any]:
    data = plan.to_dict()
    return {k: data[k] for k in FIELDS}


def snapshot(names: list[str]) -> dict[str, Any]:
    """{model|solver|fraction[|smallest]: the plan's record, or the error's text}."""
    import torch
    from ckpt_planner.api import Planner
    from ckpt_planner.profile.profiler import ProfileConfig
    from ckpt_planner.solvers.registry import InfeasibleBudgetError

    from tests.models.zoo import build

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for name in names:
        model, inputs = build(name)
        planner = Planner(model, inputs, profile_config=ProfileConfig(flop_times=True))
        for solver in SOLVERS:
            for fraction in FRACTIONS:
                key = f"{name}|{solver}|{fraction}"
                try:
                    out[key] = _record(planner.plan(activation_budget=fraction, solver=solver, autotune=False))
                except InfeasibleBudgetError as e:
                    out[key] = f"infeasible, smallest {e.smallest_bytes}"
                    smallest = planner.plan(budget_bytes=e.smallest_bytes, solver=solver, autotune=False)
                    out[f"{key}|smallest"] = _record(smallest)
                print(key, "plan" if isinstance(out[key], dict) else out[key], flush=True)
        out[f"{name}|knee"] = _record(planner.plan(solver="auto", autotune=False))
    return out


def compare(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """One line per record that differs, naming the fields."""
    lines = [f"{k}: only in one snapshot" for k in sorted(set(before) ^ set(after))]
    for key in sorted(set(before) & set(after)):
        a, b = before[key], after[key]
        if a == b:
            continue
        fields = [f for f in FIELDS if a.get(f) != b.get(f)] if isinstance(a, dict) and isinstance(b, dict) else ["all"]
        lines.append(f"{key}: {', '.join(fields)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.plan_snapshot", description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=None, help="comma-separated zoo model names (default: all)")
    parser.add_argument("--out", help="write the snapshot here (JSON)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"), help="list the records that differ")
    args = parser.parse_args(argv)
    if args.compare:
        before, after = (json.loads(Path(p).read_text()) for p in args.compare)
        lines = compare(before, after)
        print(f"{len(before) - len(lines)} of {len(before)} records identical")
        print("\n".join(lines))
        return 0
    if not args.out:
        parser.error("give --out FILE or --compare BEFORE AFTER")
    from tests.models.zoo import ZOO

    warnings.simplefilter("ignore")
    names = args.models.split(",") if args.models else list(ZOO)
    write_text(args.out, json.dumps(snapshot(names), indent=1, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

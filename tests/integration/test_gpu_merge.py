"""Merging device runs: the zoo's rows, one per model, merge model by model (a run that reached a few
models keeps the others' earlier figures, each row dated by its run)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.gpu import merge_runs

ENV = {"status": "ok", "seconds": 1, "rows": [{"device": "NVIDIA H100 80GB HBM3", "torch": "2.11"}]}


def _zoo_row(model: str, precision: str, error: float) -> dict:
    return {"model": model, "precision": precision, "budget_bytes": 2000, "predicted_bytes": 1000,
            "measured_bytes": 1000, "prediction_error": error, "within_budget": True, "exact": True,
            "max_abs_grad_diff": 0.0}


def test_zoo_rows_merge_model_by_model(tmp_path: Path):
    first = {"command": "a", "date": "d1", "seconds": 10, "sections": {"env": ENV, "zoo": {
        "status": "ok", "seconds": 5, "date": "d1",
        "rows": [_zoo_row("gpt2", "fp32", 0.01), _zoo_row("vit", "fp32", 0.02),
                 {"model": "unet", "precision": "fp32", "skipped": "not reached"}]}}}
    second = {"command": "b", "date": "d2", "seconds": 20, "sections": {"env": ENV, "zoo": {
        "status": "out of time after 60 s", "seconds": 60, "date": "d2",
        "rows": [_zoo_row("vit", "fp32", -0.03), {"model": "gpt2", "precision": "fp32", "skipped": "not reached"},
                 _zoo_row("unet", "fp32", 0.04)]}}}
    paths = []
    for i, run in enumerate((first, second)):
        paths.append(tmp_path / f"run{i}.json")
        paths[-1].write_text(json.dumps(run))
    out = tmp_path / "out"
    out.mkdir()
    merge_runs(paths, out, [])
    rows = {(r["model"], r["precision"]): r for r in json.loads((out / "gpu-h100.json").read_text())["sections"]["zoo"]["rows"]}
    assert set(rows) == {("gpt2", "fp32"), ("vit", "fp32"), ("unet", "fp32")}
    assert rows["gpt2", "fp32"]["prediction_error"] == 0.01 and rows["gpt2", "fp32"]["date"] == "d1"  # skipped later: kept
    assert rows["vit", "fp32"]["prediction_error"] == -0.03 and rows["vit", "fp32"]["date"] == "d2"  # reached later: replaced
    assert rows["unet", "fp32"]["prediction_error"] == 0.04 and "skipped" not in rows["unet", "fp32"]
    md = (out / "gpu-h100.md").read_text()
    assert "| vit | fp32 |" in md and "| d2 |" in md and "| d1 |" in md
    # merging the merged file again with nothing new changes no row
    again = tmp_path / "again"
    again.mkdir()
    merge_runs([out / "gpu-h100.json"], again, [])
    assert json.loads((again / "gpu-h100.json").read_text())["sections"]["zoo"]["rows"] == list(rows.values())

"""The conformance matrix's held-out models on CUDA: the `conformance` section of benchmarks.gpu.

Each model is planned the way a user plans it on the device: `optimize(model, inputs, activation_budget=0.5)`,
below its plain step, so the profile is the stage-wise one with node times measured on the device. Autotune is
off: the figures checked are the planner's own predictions, not a race's pick. Paths, per model:

- `fp32` under `torch.use_deterministic_algorithms` (warnings only: an op without a deterministic kernel is
  reported through the gradients, not refused);
- `bf16_autocast`: the step under `torch.autocast("cuda", torch.bfloat16)`;
- `bf16_model`: `model.to(torch.bfloat16)` and its floating inputs.

Per cell: the predicted peak against `torch.cuda.max_memory_allocated` (verify()), within its budget, gradients
bitwise against the model's own step, and the step-time model: the plan's predicted overhead against the
measured one (CUDA events around forward and backward, median of ROUNDS interleaved pairs after one warm-up
pair). A refusal is planned again at the smallest budget it names, as the CPU matrix does.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

FRACTION = 0.5
PATHS = ("fp32", "bf16_autocast", "bf16_model")
ROUNDS = 10
EXTRA = ("tv_resnet", "unet", "segformer", "electra", "tied_autoencoder", "mixtral")
"""Models that are not held out, run after the held-out ones where time is left: the ones an earlier review
found failing on the CPU (in-place ops in the stage-wise profile, masked losses, tied weights, nested regions)."""
WITHIN = 1.5


def chosen_paths() -> tuple[str, ...]:
    named = tuple(p for p in os.environ.get("GPU_CONFORMANCE_PATHS", "").split(",") if p)
    return named or PATHS


def chosen(dry: bool) -> list[str]:
    from benchmarks.conformance_models import HELD_OUT, MODELS

    named = [m for m in os.environ.get("GPU_CONFORMANCE_MODELS", "").split(",") if m]
    if named:
        return named
    if dry:
        return ["tv_vgg", "albert"]
    return [m for m in MODELS if m in HELD_OUT] + list(EXTRA)


def _bf16(x):
    import torch
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda t: t.to(torch.bfloat16) if isinstance(t, torch.Tensor) and t.is_floating_point()
                           else t, x)


def _overhead(model, module, inputs, device, ctx, rounds: int) -> tuple[float, float]:
    """(plain step ms, plan's step ms): medians of `rounds` interleaved pairs, CUDA events on a device (the host
    clock on the CPU's dry run)."""
    import torch
    from ckpt_planner.capture.trace import normalize_inputs
    from ckpt_planner.model_state import ModelState
    from ckpt_planner.verification import default_loss

    args, kwargs = normalize_inputs(inputs, model)
    params = list(model.parameters())
    cuda = device.type == "cuda"

    def step(m):
        for p in params:
            p.grad = None
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        with ctx():
            default_loss(m(*args, **kwargs)).backward()
        if cuda:
            end.record()
            return start, end
        return (time.perf_counter() - t0) * 1e3

    pairs = []
    with ModelState(model).preserved():
        for i in range(rounds + 1):
            b, o = (step(model), step(module)) if i % 2 else tuple(reversed((step(module), step(model))))
            if i:
                pairs.append((b, o))
        if cuda:
            torch.cuda.synchronize(device)
            pairs = [(b[0].elapsed_time(b[1]), o[0].elapsed_time(o[1])) for b, o in pairs]
    for p in params:
        p.grad = None
    return statistics.median(b for b, _ in pairs), statistics.median(o for _, o in pairs)


def _cell(name: str, path: str, device, dry: bool) -> dict:
    import torch
    from ckpt_planner import optimize
    from ckpt_planner.errors import InfeasibleBudgetError
    from ckpt_planner.verification import verify

    from benchmarks.conformance_models import build
    from benchmarks.gpu import _to

    model, inputs = build(name)
    model, inputs = model.to(device), _to(inputs, device)
    if path == "bf16_model":
        model, inputs = model.to(torch.bfloat16), _bf16(inputs)

    def ctx():
        return torch.autocast(device.type, dtype=torch.bfloat16) if path == "bf16_autocast" else contextlib.nullcontext()

    torch.use_deterministic_algorithms(True, warn_only=True)
    row: dict = {}
    t0 = time.perf_counter()
    with ctx():
        try:
            plan = optimize(model, inputs, activation_budget=FRACTION, autotune=False)
        except InfeasibleBudgetError as e:
            row.update(refusal=str(e).splitlines()[0], smallest_bytes=e.smallest_bytes)
            plan = optimize(model, inputs, budget_bytes=e.smallest_bytes, autotune=False)
            row["at_smallest"] = True
        row["plan_s"] = time.perf_counter() - t0
        report = verify(model, plan, inputs, repeats=1)
    plain_ms, ours_ms = _overhead(model, plan.module, inputs, device, ctx, 2 if dry else ROUNDS)
    measured = ours_ms / plain_ms - 1.0
    predicted = plan.predicted_overhead
    budget = plan.budget_bytes
    row.update(
        profile=plan.stats.get("profile", "whole"), regions=len(plan.regions), offloaded=len(plan.offloaded),
        budget_bytes=budget,
        predicted_bytes=report.predicted_peak_bytes, measured_bytes=report.measured_peak_bytes,
        baseline_measured_bytes=report.baseline_measured_peak_bytes, prediction_error=report.prediction_error,
        within_budget=budget is None or report.measured_peak_bytes <= budget, exact=report.exact,
        max_abs_grad_diff=report.max_abs_grad_diff, plain_ms=plain_ms, ours_ms=ours_ms,
        predicted_overhead=predicted, measured_overhead=measured,
        overhead_ratio=(predicted / measured) if measured >= 0.05 else None,
    )
    return row


def section_conformance(sizes: dict, dry: bool, emit, log) -> None:
    """The held-out models, then EXTRA, each on every path, while the section's time lasts."""
    import torch

    from benchmarks.conformance_models import HELD_OUT
    from benchmarks.gpu import _device, _free, _where, time_left

    device = _device(dry)
    for name in chosen(dry):
        for path in chosen_paths()[:1] if dry and name != "tv_vgg" else chosen_paths():
            if time_left() < 10:
                emit({"model": name, "path": path, "skipped": "out of the section's time"})
                continue
            t0 = time.perf_counter()
            try:
                row = _cell(name, path, device, dry)
            except Exception as e:  # noqa: BLE001 - a cell's failure is its row
                row = {"failed": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", "where": _where(3)}
            emit({"model": name, "path": path, "held_out": name in HELD_OUT, "seconds": time.perf_counter() - t0, **row})
            log(f"conformance: {name} {path}: {row.get('prediction_error', row.get('failed'))} "
                f"overhead {row.get('predicted_overhead')} vs {row.get('measured_overhead')}")
            _free()
    torch.use_deterministic_algorithms(False)


def _ratio_line(rows: list[dict], label: str) -> str:
    ratios = [r["overhead_ratio"] for r in rows if r.get("overhead_ratio") is not None]
    if not ratios:
        return f"- {label}: no cell with a measured overhead of 5 % or more."
    inside = sum(1 / WITHIN <= x <= WITHIN for x in ratios)
    return (f"- {label}: step-time model within {WITHIN}x of the measured overhead on {inside} of {len(ratios)} "
            f"(median predicted/measured {statistics.median(ratios):.2f}).")


def markdown(rows: list[dict]) -> list[str]:
    """The section's table and summary lines (for benchmarks.gpu's page)."""
    rows = [r for r in rows if "model" in r]
    if not rows:
        return []
    out = ["", "## The conformance matrix's held-out models on CUDA", "",
           f"`optimize(model, inputs, activation_budget={FRACTION}, autotune=False)` on the device; fp32 under "
           "deterministic algorithms, bf16 autocast, the whole model in bf16. Error: (predicted - "
           "`max_memory_allocated` peak) / measured. Overhead: the plan's step over the plain step, minus one, "
           f"CUDA events, median of {ROUNDS} interleaved pairs; ratio predicted / measured where measured >= 5 %.", "",
           "| model | path | held out | profile | regions | offloaded | budget KB | predicted KB | measured KB | error | within "
           "| exact | pred overhead | meas overhead | ratio | plan s |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['model']} | {r['path']} | {'yes' if r.get('held_out') else 'no'} "
        if r.get("failed") or r.get("skipped"):
            out.append(head + f"| {r.get('failed') or r.get('skipped')} | | | | | | | | | | | | |")
            continue
        exact = "yes" if r["exact"] else f"no ({r['max_abs_grad_diff']:.1e})"
        ratio = "-" if r.get("overhead_ratio") is None else f"{r['overhead_ratio']:.2f}"
        at = " @min" if r.get("at_smallest") else ""
        out.append(head + f"| {r['profile']} | {r['regions']} | {r.get('offloaded', '-')} | {r['budget_bytes'] / 1e3:,.1f}{at} "
                   f"| {r['predicted_bytes'] / 1e3:,.1f} | {r['measured_bytes'] / 1e3:,.1f} "
                   f"| {r['prediction_error'] * 100:+.1f} % | {'yes' if r['within_budget'] else 'NO'} | {exact} "
                   f"| {r['predicted_overhead'] * 100:+.0f} % | {r['measured_overhead'] * 100:+.0f} % | {ratio} "
                   f"| {r['plan_s']:.1f} |")
    planned = [r for r in rows if "prediction_error" in r]
    held = [r for r in planned if r.get("held_out")]
    out.append("")
    for label, group in (("held out", held), ("the others", [r for r in planned if not r.get("held_out")])):
        if not group:
            continue
        errors = [abs(r["prediction_error"]) for r in group]
        out.append(f"- {label}: {len(group)} cells planned; prediction within 2 % on "
                   f"{sum(e <= 0.02 for e in errors)}, over budget on {sum(not r['within_budget'] for r in group)}, "
                   f"not bitwise on {sum(not r['exact'] for r in group)}.")
        out.append(_ratio_line(group, label))
    failed = [r for r in rows if r.get("failed")]
    if failed:
        out.append(f"- failed: {', '.join(r['model'] + '/' + r['path'] for r in failed)}.")
    return out

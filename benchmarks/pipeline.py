"""Pipeline stages planned for their schedule against per-layer checkpointing on every stage.

A Llama-shaped model (RMSNorm, attention, SwiGLU MLP; tiny sizes) split into `p` stages of equal
blocks, the last with the LM head. For each stage count, microbatch count and per-GPU budget,
`plan_pipeline` plans every stage for the microbatches it holds in flight under Schedule1F1B, and the
predicted pipeline step (the schedule's own action order replayed with each stage's forward, backward
and recompute times, FLOP-based: deterministic) is set against per-layer checkpointing on every stage,
the policy torchtitan applies, and against the bound: the step with every stage at the least recompute
anything found for it at that budget (none where its no-checkpointing peak fits). Budgets are placed
between the two policies' peaks on the first stage (per-layer checkpointing's and no checkpointing's):
there per-layer checkpointing fits and throws room away.

Then one configuration (4 stages, 8 microbatches, a wider model) runs as 4 gloo processes, one torch
thread each: the planned stages and per-layer checkpointing side by side, their measured step times'
ratio and each rank's measured peak against its prediction and the budget. This CPU's clock is noisy,
and 4 processes on fewer cores share them: the ratio is of CPU-bound processes, not of a device per stage.

    python -m benchmarks.pipeline                     # 4 and 8 stages, 8, 16 and 32 microbatches, gloo run
    python -m benchmarks.pipeline --no-gloo           # the predicted table; the last measured section kept

Writes benchmarks/results/pipeline.json and pipeline.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from ._io import write_files  # noqa: E402

RESULTS = Path(__file__).parent / "results"


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class Block(nn.Module):
    """One Llama decoder layer: pre-norm attention (no rotary: it changes no memory figure) and SwiGLU."""

    def __init__(self, d: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        # (b, t, 3d) -> 3 x (b, heads, t, d / heads)
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.softmax((q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5, dim=-1) @ v
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class Stage(nn.Module):
    def __init__(self, d: int, heads: int, hidden: int, n_blocks: int, vocab: int | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, heads, hidden) for _ in range(n_blocks))
        self.head = nn.Linear(d, vocab, bias=False) if vocab else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def llama_stages(p: int, *, seed: int = 0, d: int = 32, heads: int = 2, hidden: int = 64, blocks: int = 2,
                 vocab: int = 16, batch: int = 16, seq: int = 16) -> tuple[list[Stage], torch.Tensor, torch.Tensor]:
    """`p` stages of `blocks` layers each (the last with the LM head), a batch of embeddings (batch, seq, d)
    and regression targets (batch, seq, vocab)."""
    torch.manual_seed(seed)
    stages = [Stage(d, heads, hidden, blocks, vocab if s == p - 1 else None) for s in range(p)]
    return stages, torch.randn(batch, seq, d), torch.randn(batch, seq, vocab)


def stage_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The schedule's loss on the last stage's output (summed squared error)."""
    return nn.functional.mse_loss(output, target, reduction="sum")


SOLVER = "dp"  # the stage search's probes: greedy left stage 0 recomputing 0.031 ms where dp finds 0.026


def _plan(stages, micro, target, n, budget, solver=SOLVER, measured_times=False, **keywords):
    """`plan_pipeline` on Schedule1F1B with per-layer checkpointing's figures beside. Times from FLOPs and bytes
    moved (deterministic) unless `measured_times`: then each op timed on this CPU (one thread), as a user's
    planner would, for a run whose steps are measured."""
    from ckpt_planner import ProfileConfig
    from ckpt_planner.pipeline import plan_pipeline
    from torch.distributed.pipelining import Schedule1F1B

    config = (ProfileConfig(timing_store=False) if measured_times else
              ProfileConfig(warmup=0, repeats=1, flop_times=True))
    return plan_pipeline(stages, (micro,), schedule=Schedule1F1B, n_microbatches=n, budget_bytes=budget,
                         loss_fn=stage_loss, target=target, per_layer="blocks", profile_config=config,
                         check_step=False, solver=solver, **keywords)


def policy_peaks(stages, micro, target, n) -> tuple[list[int], list[int]]:
    """Each stage's peak with no checkpointing and with per-layer checkpointing (bytes): neither depends on
    the budget, so one plan at an unbounded budget reads both."""
    from ckpt_planner.pipeline.stage import stage_figures

    probe = _plan(stages, micro, target, n, 1 << 40, solver="greedy")
    return ([stage_figures(sp.plan.problem, sp.spec).peak_bytes for sp in probe.stages],
            [sp.per_layer.peak_bytes for sp in probe.stages])


def budget_at(none: list[int], layer: list[int], fraction: float) -> int:
    """`fraction` of the way from stage 0's per-layer peak to its no-checkpointing peak, and at least every
    stage's per-layer peak: there per-layer checkpointing fits and throws room away."""
    return int(max(max(layer), layer[0] + fraction * (none[0] - layer[0])))


BOUND_SOLVERS = ("greedy", "dp", "selective", "structured")
"""The solvers whose stage searches the bound takes the least recompute of (each search also judges
`uniform`'s plans and fills every probe's regions with what the stage has room to keep). The ILP is left
out: on an 80-node stage its bisection took 80 to 130 s here, and its model is one microbatch's peak, not
the stage's in flight, so its optimum proves nothing about the stage either."""


def least_recompute_s(sp, budget: int, solvers=BOUND_SOLVERS) -> tuple[float, str]:
    """The least recompute anything found for stage `sp` at `budget` (seconds), and what found it: zero,
    exactly, where the stage's no-checkpointing peak fits; else the least of the stage's own plan and the
    stage search under each of `solvers` (the best found, not a proof that no plan recomputes less)."""
    from ckpt_planner.pipeline.stage import search_inner_budget, stage_figures

    problem = sp.plan.problem
    if stage_figures(problem, sp.spec).peak_bytes <= budget:
        return 0.0, "none"
    best = (sp.figures.recompute_s, "planned")
    for solver in solvers:
        try:
            figs = search_inner_budget(problem, sp.spec, budget, solver)[2]
        except ValueError:  # no plan of this solver's fits the stage: it offers no evidence
            continue
        if figs.recompute_s < best[0]:
            best = (figs.recompute_s, solver)
    return best


def bound_step_s(pp, n: int, least_s: list[float]) -> float:
    """The step of the pipeline with each stage at the least recompute found for it (`least_s`, seconds):
    a stage forced to recompute (its no-checkpointing peak over the budget) is counted at its least, not at
    zero (seconds)."""
    from ckpt_planner.pipeline import pipeline_step_s
    from torch.distributed.pipelining import Schedule1F1B

    backward = [sp.backward_s - sp.figures.recompute_s + least for sp, least in zip(pp.stages, least_s, strict=True)]
    return pipeline_step_s(Schedule1F1B, n, [sp.forward_s for sp in pp.stages], backward)


def run(stage_counts=(4, 8), microbatch_counts=(8, 16, 32), fractions=(0.25, 0.5, 0.75)) -> list[dict]:
    rows = []
    for p in stage_counts:
        for n in microbatch_counts:
            stages, batch, target = llama_stages(p, batch=n * 2)
            micro = batch[:2]
            none, layer = policy_peaks(stages, micro, target[:2], n)
            for f in fractions:
                budget = budget_at(none, layer, f)
                t0 = time.perf_counter()
                pp = _plan(stages, micro, target[:2], n, budget)
                # the plans' own solver's search (with the layer candidates) made the plan: not run again
                least = [least_recompute_s(sp, budget, tuple(x for x in BOUND_SOLVERS if x != SOLVER))
                         for sp in pp.stages]
                bound = bound_step_s(pp, n, [x for x, _ in least])
                rows.append({
                    "stages": p, "microbatches": n, "budget_bytes": budget, "fraction": f,
                    "per_layer_peak_stage0": layer[0], "no_checkpoint_peak_stage0": none[0],
                    "no_checkpoint_peaks": none,
                    "forced": [int(x > budget) for x in none],
                    "planned_peaks": [sp.figures.peak_bytes for sp in pp.stages],
                    "planned_recompute_ms": [round(sp.figures.recompute_s * 1e3, 4) for sp in pp.stages],
                    "per_layer_peaks": [sp.per_layer.peak_bytes for sp in pp.stages],
                    "per_layer_recompute_ms": [round(sp.per_layer.recompute_s * 1e3, 4) for sp in pp.stages],
                    "forward_ms": round(pp.stages[0].forward_s * 1e3, 4),
                    "step_ms": round(pp.step_s * 1e3, 4), "per_layer_step_ms": round(pp.per_layer_step_s * 1e3, 4),
                    "least_recompute_ms": [round(x * 1e3, 4) for x, _ in least],
                    "least_found_by": [by for _, by in least],
                    "bound_step_ms": round(bound * 1e3, 4),
                    "speedup": round(pp.per_layer_step_s / pp.step_s, 3),
                    "bound_speedup": round(pp.per_layer_step_s / bound, 3),
                    "plan_s": round(time.perf_counter() - t0, 1),
                })
                print(json.dumps(rows[-1]), flush=True)
    return rows

class PerLayer(nn.Module):
    """One layer under activation checkpointing (`torch.utils.checkpoint`, non-reentrant): torchtitan's
    per-layer AC, the baseline every stage runs."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False)


GLOO_SHAPE = {"d": 256, "heads": 4, "hidden": 688, "seq": 128, "vocab": 512}
"""The measured run's model: wide enough that a stage's compute, not the processes' messages, fills the step."""


def _gloo_worker(rank: int, world: int, n: int, budget: int, repeats: int, init: str, out: str) -> None:
    import statistics

    import torch.distributed as dist
    from ckpt_planner.pipeline.stage import stage_figures
    from ckpt_planner.profile.memory import LiveMemory
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    stages, batch, target = llama_stages(world, batch=2 * n, **GLOO_SHAPE)
    baseline = llama_stages(world, batch=2 * n, **GLOO_SHAPE)[0]  # the same weights, per-layer checkpointed
    baseline[rank].blocks = nn.ModuleList(PerLayer(b) for b in baseline[rank].blocks)
    # Timed on this CPU: FLOP-based times price the elementwise ops a selective plan recomputes (softmax,
    # SiLU, norms) at their bytes moved, well under what one thread takes over them.
    pp = _plan(stages, batch[:2], target[:2], n, budget, measured_times=True)
    modules = {"planned": pp.stages[rank].module, "per_layer": baseline[rank]}
    schedules = {k: Schedule1F1B(PipelineStage(m, rank, world, torch.device("cpu")), n, loss_fn=stage_loss)
                 for k, m in modules.items()}

    def step(kind: str) -> None:
        for q in modules[kind].parameters():
            q.grad = None
        if rank == 0:
            schedules[kind].step(batch)
        elif rank == world - 1:
            schedules[kind].step(target=target, losses=[])
        else:
            schedules[kind].step()

    peaks = {}
    for kind in schedules:  # each policy's peak on the live-tensor meter, from a step with no gradients yet
        meter = LiveMemory()
        meter.track(*modules[kind].parameters(), *([batch] if rank == 0 else []),
                    *([target] if rank == world - 1 else []))
        with meter:
            step(kind)
        peaks[kind] = meter.peak
    times: dict[str, list[float]] = {k: [] for k in schedules}
    for i in range(repeats + 1):  # alternated, so that a slow spell of the clock falls on both; the first warms up
        for kind in (("planned", "per_layer") if i % 2 else ("per_layer", "planned")):
            dist.barrier()
            t0 = time.perf_counter()
            step(kind)
            dist.barrier()
            if i:
                times[kind].append(time.perf_counter() - t0)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, peaks)
    if rank == 0:
        median = {k: statistics.median(v) for k, v in times.items()}
        result = {
            "stages": world, "microbatches": n, "budget_bytes": budget, "shape": GLOO_SHAPE, "repeats": repeats,
            "threads_per_process": 1, "cores": os.cpu_count(), "times": "measured",
            "step_s": {k: [round(t, 4) for t in v] for k, v in times.items()},
            "median_step_s": {k: round(v, 4) for k, v in median.items()},
            "measured_ratio": round(median["per_layer"] / median["planned"], 3),
            "predicted_ratio": round(pp.per_layer_step_s / pp.step_s, 3),
            "measured_peaks": [g["planned"] for g in gathered],
            "predicted_peaks": [sp.figures.peak_bytes for sp in pp.stages],
            "measured_per_layer_peaks": [g["per_layer"] for g in gathered],
            "predicted_per_layer_peaks": [sp.per_layer.peak_bytes for sp in pp.stages],
            "no_checkpoint_peaks": [stage_figures(sp.plan.problem, sp.spec).peak_bytes for sp in pp.stages],
            "planned_recompute_ms": [round(sp.figures.recompute_s * 1e3, 3) for sp in pp.stages],
        }
        Path(out, "result.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int = 4, n: int = 8, fraction: float = 0.5, repeats: int = 5) -> dict:
    """The planned stages and per-layer checkpointing on every stage, run side by side under gloo (`world`
    processes, one torch thread each): their measured step times' ratio, each rank's measured peak."""
    import tempfile

    import torch.multiprocessing as mp

    stages, batch, target = llama_stages(world, batch=2 * n, **GLOO_SHAPE)
    none, layer = policy_peaks(stages, batch[:2], target[:2], n)
    budget = budget_at(none, layer, fraction)
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_gloo_worker, args=(world, n, budget, repeats, f"file://{d}/rdv", d), nprocs=world,
                           start_method="spawn")
        result = json.loads(Path(d, "result.json").read_text())
    result["fraction"] = fraction
    print(json.dumps(result), flush=True)
    return result


def markdown(rows: list[dict], gloo: dict | None = None) -> str:
    lines = ["# Pipeline stages planned for their schedule (Schedule1F1B) vs per-layer checkpointing", "",
             "Predicted from FLOPs (deterministic); `python -m benchmarks.pipeline`. Budget per GPU, between stage 0's",
             "per-layer and no-checkpointing peaks (`fraction` of the way). Stage figures are listed stage 0 first.",
             f"Stages planned by the stage search with solver `{SOLVER}`. Per-layer checkpointing recomputes each",
             "stage's whole forward (forward and per-layer recompute ms below, stage 0): a third of its forward and",
             "backward, as in a real model under per-layer checkpointing.", "",
             "`forced`: 1 for each stage whose no-checkpointing peak is over the budget, so that it recomputes",
             "whatever the plan. `bound`: the pipeline step with every stage at the least recompute found for it at",
             "this budget (`least recompute ms per stage`): zero where the stage is not forced (exact: no",
             "checkpointing fits); where it is forced, the least of the stage's plan and the stage search run with",
             f"each of {', '.join(BOUND_SOLVERS)} (each search also judging uniform's plans and every probe filled",
             "with the nodes the stage has room to keep). At forced stages that is the best found, not a proof: no",
             "solver here optimises the stage's in-flight peak (k - 1 microbatches held plus one running), and the",
             "ILP, left out (80 to 130 s a stage search on these 80-node stages), is optimal for one microbatch's",
             "peak only. Where `speedup` equals `bound`, nothing found gains more there.", "",
             "| stages | microbatches | budget KB | fraction | forward ms | per-layer recompute ms | planned step ms | "
             "per-layer step ms | speedup | bound step ms | bound | forced | planned recompute ms per stage | "
             "least recompute ms per stage | planned peak KB per stage |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['stages']} | {r['microbatches']} | {r['budget_bytes'] / 1e3:.0f} | {r['fraction']} | "
                     f"{r['forward_ms']:.3f} | {r['per_layer_recompute_ms'][0]:.3f} | "
                     f"{r['step_ms']:.3f} | {r['per_layer_step_ms']:.3f} | {r['speedup']:.2f}x | "
                     f"{r['bound_step_ms']:.3f} | {r['bound_speedup']:.2f}x | "
                     f"{''.join(str(x) for x in r['forced'])} | "
                     f"{', '.join(f'{x:.3f}' for x in r['planned_recompute_ms'])} | "
                     f"{', '.join(f'{x:.3f}' for x in r['least_recompute_ms'])} | "
                     f"{', '.join(f'{x / 1e3:.0f}' for x in r['planned_peaks'])} |")
    reached = sum(r["speedup"] >= 1.15 for r in rows)
    capped = sum(r["bound_speedup"] < 1.15 for r in rows)
    lines += ["", f"{reached} of {len(rows)} cells reach 1.15x; in {capped} the bound itself is under 1.15x: "
              "nothing found reaches 1.15x there."]
    short = [r for r in rows if r["speedup"] < 1.15 <= r["bound_speedup"]]
    if short:
        lines.append("Under 1.15x with the bound over it: " + "; ".join(
            f"{r['stages']} stages, {r['microbatches']} microbatches, fraction {r['fraction']} "
            f"(least recompute found by {', '.join(sorted(set(r['least_found_by']) - {'none', 'planned'}))})"
            for r in short) + ".")
    if gloo:
        g = gloo
        lines += ["", "## Measured under gloo", "",
                  f"`python -m benchmarks.pipeline` also runs {g['stages']} stages, {g['microbatches']} microbatches "
                  f"(Llama-shaped, {g['shape']}) as {g['stages']} gloo processes, one torch thread each, on a "
                  f"{g['cores']}-core CPU: the planned stages and per-layer checkpointing side by side, "
                  f"{g['repeats']} steps each, alternated. This CPU's clock is noisy, and with more processes than "
                  "cores the ratio is that of CPU-bound processes sharing cores (a rank waiting on its neighbour "
                  "gives its core away), not that of a pipeline with a device per stage. The plans here are made "
                  "from each op's time measured on this CPU (one thread), not from FLOPs: FLOP-based times price the "
                  "elementwise ops a selective plan recomputes (softmax, SiLU, norms) at their bytes moved, well "
                  "under what one thread takes over them. `predicted`: the step the planner predicts from those "
                  "times.", "",
                  f"- budget {g['budget_bytes'] / 1e6:.2f} MB per rank ({g['fraction']} of the way on stage 0)",
                  f"- median step: planned {g['median_step_s']['planned']:.3f} s, per-layer "
                  f"{g['median_step_s']['per_layer']:.3f} s: measured {g['measured_ratio']:.2f}x, predicted "
                  f"{g['predicted_ratio']:.2f}x",
                  f"- steps (s): planned {g['step_s']['planned']}, per-layer {g['step_s']['per_layer']}", "",
                  "| rank | measured peak MB | predicted MB | error | budget MB | per-layer measured MB | "
                  "per-layer predicted MB | planned recompute ms |",
                  "|---|---|---|---|---|---|---|---|"]
        for r, (m, pr) in enumerate(zip(g["measured_peaks"], g["predicted_peaks"], strict=True)):
            lines.append(f"| {r} | {m / 1e6:.3f} | {pr / 1e6:.3f} | {(m - pr) / pr * 100:+.2f} % | "
                         f"{g['budget_bytes'] / 1e6:.3f} | {g['measured_per_layer_peaks'][r] / 1e6:.3f} | "
                         f"{g['predicted_per_layer_peaks'][r] / 1e6:.3f} | {g['planned_recompute_ms'][r]:.3f} |")
    return "\n".join(lines) + "\n"


def _last_measured(path: Path) -> dict | None:
    """The gloo section of the results `path` holds, kept by a run that leaves the gloo run out: the
    measured run does not depend on the predicted table."""
    try:
        return json.loads(path.read_text()).get("gloo")
    except (OSError, ValueError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--no-gloo", action="store_true", help="leave out the measured gloo run")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    rows = run(args.stages, args.microbatches)
    gloo = measure() if not args.no_gloo else _last_measured(Path(args.out) / "pipeline.json")
    meta = {"torch": torch.__version__, "machine": platform.machine(), "time_source": "flops", "solver": SOLVER}
    write_files(args.out, {"pipeline.json": json.dumps({"meta": meta, "rows": rows, "gloo": gloo}, indent=1) + "\n",
                           "pipeline.md": markdown(rows, gloo)})


if __name__ == "__main__":
    main()

"""Pipeline stages planned for their schedule against per-layer checkpointing on every stage.

A Llama-shaped model (RMSNorm, attention, SwiGLU MLP; tiny sizes) split into `p` stages of equal
blocks, the last with the LM head. For each stage count, microbatch count and per-GPU budget,
`plan_pipeline` plans every stage for the microbatches it holds in flight under Schedule1F1B, and the
predicted pipeline step (the schedule's own action order replayed with each stage's forward, backward
and recompute times, FLOP-based: deterministic) is set against per-layer checkpointing on every stage,
the policy torchtitan applies. Budgets are placed between the two policies' peaks on the first stage
(per-layer checkpointing's and no checkpointing's): there per-layer checkpointing fits and throws room
away. Times are predictions from FLOPs, not measurements: this CPU's clock is too noisy to compare
steps of a few milliseconds.

    python -m benchmarks.pipeline                     # 4 and 8 stages, 8, 16 and 32 microbatches

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


def run(stage_counts=(4, 8), microbatch_counts=(8, 16, 32), fractions=(0.25, 0.5, 0.75)) -> list[dict]:
    from ckpt_planner import ProfileConfig
    from ckpt_planner.pipeline import plan_pipeline
    from ckpt_planner.pipeline.stage import stage_figures
    from torch.distributed.pipelining import Schedule1F1B

    fast = ProfileConfig(warmup=0, repeats=1, flop_times=True)
    rows = []
    for p in stage_counts:
        for n in microbatch_counts:
            stages, batch, target = llama_stages(p, batch=n * 2)
            micro = batch[:2]
            # the two policies' peaks on stage 0 (which holds the most): per-layer and no checkpointing
            probe = plan_pipeline(stages[:1] + stages[1:], (micro,), schedule=Schedule1F1B, n_microbatches=n,
                                  budget_bytes=1 << 40, loss_fn=stage_loss, target=target[:2],
                                  per_layer="blocks", profile_config=fast, check_step=False, solver="greedy")
            first = probe.stages[0]
            none = stage_figures(first.plan.problem, first.spec).peak_bytes
            layer = first.per_layer.peak_bytes
            layer_worst = max(sp.per_layer.peak_bytes for sp in probe.stages)
            for f in fractions:
                budget = int(max(layer_worst, layer + f * (none - layer)))
                t0 = time.perf_counter()
                pp = plan_pipeline(stages, (micro,), schedule=Schedule1F1B, n_microbatches=n, budget_bytes=budget,
                                   loss_fn=stage_loss, target=target[:2], per_layer="blocks",
                                   profile_config=fast, check_step=False, solver="greedy")
                rows.append({
                    "stages": p, "microbatches": n, "budget_bytes": budget, "fraction": f,
                    "per_layer_peak_stage0": layer, "no_checkpoint_peak_stage0": none,
                    "planned_peaks": [sp.figures.peak_bytes for sp in pp.stages],
                    "planned_recompute_ms": [round(sp.figures.recompute_s * 1e3, 4) for sp in pp.stages],
                    "per_layer_peaks": [sp.per_layer.peak_bytes for sp in pp.stages],
                    "per_layer_recompute_ms": [round(sp.per_layer.recompute_s * 1e3, 4) for sp in pp.stages],
                    "step_ms": round(pp.step_s * 1e3, 4), "per_layer_step_ms": round(pp.per_layer_step_s * 1e3, 4),
                    "speedup": round(pp.per_layer_step_s / pp.step_s, 3), "plan_s": round(time.perf_counter() - t0, 1),
                })
                print(json.dumps(rows[-1]), flush=True)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["# Pipeline stages planned for their schedule (Schedule1F1B) vs per-layer checkpointing", "",
             "Predicted from FLOPs (deterministic); `python -m benchmarks.pipeline`. Budget per GPU, between stage 0's",
             "per-layer and no-checkpointing peaks (`fraction` of the way). Stage figures are listed stage 0 first.", "",
             "| stages | microbatches | budget KB | fraction | planned step ms | per-layer step ms | speedup | "
             "planned recompute ms per stage | planned peak KB per stage |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['stages']} | {r['microbatches']} | {r['budget_bytes'] / 1e3:.0f} | {r['fraction']} | "
                     f"{r['step_ms']:.3f} | {r['per_layer_step_ms']:.3f} | {r['speedup']:.2f}x | "
                     f"{', '.join(f'{x:.3f}' for x in r['planned_recompute_ms'])} | "
                     f"{', '.join(f'{x / 1e3:.0f}' for x in r['planned_peaks'])} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    rows = run(args.stages, args.microbatches)
    meta = {"torch": torch.__version__, "machine": platform.machine(), "time_source": "flops"}
    write_files(args.out, {"pipeline.json": json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n",
                           "pipeline.md": markdown(rows)})


if __name__ == "__main__":
    main()

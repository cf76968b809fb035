"""Reach: the longest sequence and the largest batch each contender trains within one fixed budget.

The budget is transformers per-layer checkpointing's measured peak (allocator meter,
planner/profile/memory.py) at a base shape. For each contender the sequence (batch 1), then the batch
(base length), grows until one step's measured peak exceeds the budget, or our planner names the budget
infeasible; the largest shape measured within the budget is reported. Our contenders re-plan at every
shape (capture, profile on FLOP times, solve) as a user does, and their plan's step is measured like the
others'. Then, at per-layer's own longest sequence, every contender's step time (fastest of a few
interleaved rounds) against no checkpointing's; there our plans are made on measured times (the default).

Contenders: none (no checkpointing), per-layer (HF `activation_checkpointing_enable`, every layer,
non-reentrant), every-2 (`every_n_layers=2`), ours (exact, `optimize(..., budget)`), ours-inexact
(`optimize(..., budget, exact=False)`: token-wise work chunked where the exact plan cannot fit).

Models return the loss only (a wrapper around the HF model, as Mini-Sequence Transformer, Liger and
Cut-Cross-Entropy users write): a model returning its full logits must materialize them as an output.
With --stock the models are the HF models as they come (their output holds the logits, rows named
`<model>-stock`), and two more contenders ask the planner for the loss alone: ours-loss
(`optimize(..., outputs="loss")`) and ours-inexact-loss (the same with exact=False).

    python -m benchmarks.reach --quick            # Llama shape only, coarse search (minutes)
    python -m benchmarks.reach --quick --stock    # the stock Llama, logits returned unless outputs="loss"
    python -m benchmarks.reach                    # every model
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ._io import out_dir, write_files

os.environ.setdefault("KINETO_LOG_LEVEL", "6")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from ckpt_planner import optimize  # noqa: E402
from ckpt_planner.profile.profiler import ProfileConfig  # noqa: E402
from ckpt_planner.solvers import InfeasibleBudgetError  # noqa: E402
from ckpt_planner.verification import measure_step_peaks  # noqa: E402

CONTENDERS = ("none", "per-layer", "every-2", "ours", "ours-inexact")
STOCK_CONTENDERS = (*CONTENDERS, "ours-loss", "ours-inexact-loss")
FLOPS = ProfileConfig(flop_times=True)


class LossOnly(nn.Module):
    """model(**inputs).loss: the training step returns the loss alone."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.model(**inputs).loss


class SmallCNN(nn.Module):
    """Conv-ReLU stages and a classifier with its loss: every op works per sample (batch dimension)."""

    def __init__(self, c: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv2d(3 if i == 0 else c, c, 3, padding=1) for i in range(4))
        self.head = nn.Linear(c, classes)

    def forward(self, pixels: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = pixels
        for conv in self.convs:
            h = F.relu(conv(h))
        return F.cross_entropy(self.head(h.mean(dim=(2, 3))), labels)


def _lm(name: str):
    from transformers import (
        BertConfig,
        BertForMaskedLM,
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    torch.manual_seed(0)
    if name == "llama":  # vocabulary 32x the width (Llama-3-8B: 31x)
        cfg = LlamaConfig(num_hidden_layers=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=344, vocab_size=4096, max_position_embeddings=8192, use_cache=False)
        return LlamaForCausalLM(cfg), "layers"
    if name == "qwen2":  # 32x
        cfg = Qwen2Config(num_hidden_layers=4, hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                          intermediate_size=344, vocab_size=4096, max_position_embeddings=8192, use_cache=False)
        return Qwen2ForCausalLM(cfg), "layers"
    if name == "gpt2":  # 8x (GPT-2 small: 65x; the 8x point of the issue)
        cfg = GPT2Config(n_layer=4, n_embd=128, n_head=4, vocab_size=1024, n_positions=8192, use_cache=False,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2LMHeadModel(cfg), "layers"
    if name == "bert":  # encoder, masked-LM loss on every token, 8x
        cfg = BertConfig(num_hidden_layers=4, hidden_size=128, num_attention_heads=4, intermediate_size=512,
                         vocab_size=1024, max_position_embeddings=8192, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
        return BertForMaskedLM(cfg), "layers"
    raise ValueError(name)


def _inputs(name: str, batch: int, length: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    if name == "cnn":
        return {"pixels": torch.randn(batch, 3, length, length, generator=g), "labels": torch.randint(0, 10, (batch,), generator=g)}
    vocab = 4096 if name in ("llama", "qwen2") else 1024
    ids = torch.randint(0, vocab, (batch, length), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _contender(name: str, model: nn.Module, kind: str, budget: int, inputs: dict, measured: bool = False) -> nn.Module:
    """The module a contender trains at these inputs (ours plan there, on FLOP times unless `measured`);
    InfeasibleBudgetError if none."""
    if kind == "none":
        return model
    if kind in ("per-layer", "every-2"):
        m = copy.deepcopy(model)
        inner = m.model if isinstance(m, LossOnly) else m
        inner.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                              every_n_layers=1 if kind == "per-layer" else 2)
        return m
    config = None if measured else FLOPS
    outputs = "loss" if kind.endswith("-loss") else "all"
    return optimize(model, dict(inputs), budget_bytes=budget, profile_config=config,
                    exact=not kind.startswith("ours-inexact"), outputs=outputs).module


def _loss(out: object) -> torch.Tensor:
    """The step's loss: the output itself (the loss-only wrapper, the CNN) or its `loss` (stock models)."""
    return out if isinstance(out, torch.Tensor) else out.loss


def _peak(module: nn.Module, model: nn.Module, inputs: dict) -> int:
    params = list(model.parameters())
    state = params + list(model.buffers())
    torch.manual_seed(0)
    peaks, _ = measure_step_peaks(module, (), inputs, params, state, _loss, torch.device("cpu"))
    for p in params:
        p.grad = None
    return peaks.allocator


def _search(fits: Callable[[int], bool], start: int, step: int, limit: int) -> tuple[int | None, list[int]]:
    """The largest n in start, start+step, ... (<= limit) with fits(n): doubling, then halving the gap."""
    tried = [start]
    if not fits(start):
        return None, tried
    lo, hi = start, None
    while hi is None:
        nxt = min(limit, lo * 2)
        if nxt == lo:
            return lo, tried
        tried.append(nxt)
        if fits(nxt):
            lo = nxt
        else:
            hi = nxt
    while hi - lo > step:
        mid = lo + max(step, (hi - lo) // 2 // step * step)
        tried.append(mid)
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo, tried


def _time(modules: dict[str, nn.Module], model: nn.Module, inputs: dict, rounds: int) -> dict[str, float]:
    best = {k: float("inf") for k in modules}
    for r in range(rounds + 1):
        for k, m in modules.items():
            t = time.perf_counter()
            _loss(m(**inputs)).backward()
            dt = time.perf_counter() - t
            for p in model.parameters():
                p.grad = None
            if r:  # the first round warms up
                best[k] = min(best[k], dt)
    return best


def run_model(name: str, quick: bool, log: Callable[[str], None], stock: bool = False,
              overhead: bool = True) -> dict:
    cnn = name == "cnn"
    if cnn:
        torch.manual_seed(0)
        model: nn.Module = SmallCNN().train()
        base_len, base_batch = 32, 8
    else:
        hf, _ = _lm(name)
        model = hf.train() if stock else LossOnly(hf.train())
        base_len, base_batch = 256, 1
    kinds = ("none", "ours", "ours-inexact") if cnn else STOCK_CONTENDERS if stock else CONTENDERS
    # the budget: per-layer's peak at the base shape (for the CNN, which has no per-layer flag: no checkpointing's)
    ref_kind = "none" if cnn else "per-layer"
    base = _inputs(name, base_batch, base_len)
    budget = _peak(_contender(name, model, ref_kind, 0, base), model, base)
    log(f"{name}: budget {budget / 1e6:.2f} MB ({ref_kind} at batch {base_batch} x {base_len})")
    result: dict = {"budget_bytes": budget, "budget_from": ref_kind, "base_batch": base_batch,
                    "base_length": base_len, "outputs": "model's own (logits)" if stock else "loss only (wrapper)",
                    "contenders": {}}
    step_len = base_len // (2 if quick else 4)
    limit_len = base_len * (8 if quick else 16)

    for kind in kinds:
        peaks: dict[str, int | None] = {}

        def fits(n: int, dim: str, kind: str = kind, peaks: dict = peaks) -> bool:
            inputs = _inputs(name, n if dim == "batch" else base_batch, base_len if dim == "batch" else n)
            try:
                module = _contender(name, model, kind, budget, inputs)
                peak = _peak(module, model, inputs)
            except InfeasibleBudgetError:
                peaks[f"{dim}={n}"] = None
                log(f"  {kind} {dim} {n}: infeasible")
                return False
            peaks[f"{dim}={n}"] = peak
            log(f"  {kind} {dim} {n}: {peak / 1e6:.2f} MB")
            return peak <= budget

        row: dict = {}
        if not cnn:
            row["longest_sequence"], _ = _search(lambda n: fits(n, "seq"), base_len, step_len, limit_len)
        if not (quick and not cnn):
            row["largest_batch"], _ = _search(lambda n: fits(n, "batch"), base_batch, 1 if base_batch == 1 else base_batch // 2,
                                              base_batch * 16)
        row["measured_peaks"] = peaks
        result["contenders"][kind] = row

    if not overhead:
        result["overhead"] = {}
        return result
    # step-time overhead at the reference contender's own longest sequence (largest batch for the CNN)
    ref = result["contenders"][ref_kind]
    n = ref.get("longest_sequence") or ref.get("largest_batch") or base_len
    inputs = _inputs(name, n if cnn else base_batch, base_len if cnn else n)
    modules = {}
    for kind in kinds:
        try:
            modules[kind] = _contender(name, model, kind, budget if kind.startswith("ours") else 0, inputs, measured=True)
        except InfeasibleBudgetError:
            continue
    times = _time(modules, model, inputs, rounds=5 if quick else 9)
    result["overhead_at"] = {("batch" if cnn else "sequence"): n}
    result["step_s"] = times
    result["overhead"] = {k: times[k] / times["none"] - 1 for k in times}
    return result


def _markdown(results: dict, meta: dict) -> str:
    lines = [
        "# Reach within per-layer checkpointing's peak",
        "",
        f"torch {meta['torch']}, transformers {meta['transformers']}, {meta['machine']}, {meta['mode']} mode. "
        "Budget: per-layer's measured allocator peak at the base shape (the CNN: no checkpointing's). "
        "Our plans are searched on FLOP times; every figure is a measured step. Overhead: step time against "
        "no checkpointing's at per-layer's longest sequence (the CNN: no checkpointing's largest batch), "
        "our plans there made on measured times.",
        "",
        "| model | budget | contender | longest sequence | x per-layer | largest batch | overhead |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        ref = r["contenders"][r["budget_from"]]
        for kind, row in r["contenders"].items():
            seq = row.get("longest_sequence")
            ratio = f"{seq / ref['longest_sequence']:.2f}" if seq and ref.get("longest_sequence") else "-"
            over = r["overhead"].get(kind)
            lines.append(
                f"| {name} | {r['budget_bytes'] / 1e6:.2f} MB | {kind} | {seq if seq else '-'} | {ratio} | "
                f"{row.get('largest_batch', '-') if row.get('largest_batch') is not None else '-'} | "
                f"{'-' if over is None else f'{100 * over:+.1f} %'} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.reach", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true",
                    help="Llama shape only (unless --models), longest sequence only (the CNN: batch), coarse search")
    ap.add_argument("--models", default=None, help="comma-separated: llama,qwen2,gpt2,bert,cnn")
    ap.add_argument("--stock", action="store_true",
                    help="the HF models as they come (logits in the output), plus ours-loss / ours-inexact-loss "
                         "(outputs=\"loss\"); rows named <model>-stock")
    ap.add_argument("--no-overhead", action="store_true", help="skip the step-time comparison")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    a = ap.parse_args(argv)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    names = a.models.split(",") if a.models else (["llama"] if a.quick else ["llama", "qwen2", "gpt2", "bert", "cnn"])
    import transformers

    meta = {"torch": torch.__version__, "transformers": transformers.__version__, "machine": platform.machine(),
            "mode": "quick" if a.quick else "full", "threads": torch.get_num_threads()}
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.0f} s] {msg}", flush=True)

    out = Path(a.out)
    out_dir(out)
    results: dict = {}
    if (out / "reach.json").is_file():  # runs of other models in the same mode add to the file
        old = json.loads((out / "reach.json").read_text())
        if old.get("meta", {}).get("mode") == meta["mode"]:
            results = old["results"]
    for name in names:  # written after each model, so a long run keeps what it measured
        key = f"{name}-stock" if a.stock and name != "cnn" else name
        results[key] = run_model(name, a.quick, log, stock=a.stock and name != "cnn", overhead=not a.no_overhead)
        write_files(out, {"reach.json": json.dumps({"meta": meta, "results": results}, indent=2),
                          "reach.md": _markdown(results, meta)})
    print(_markdown(results, meta))
    return 0


if __name__ == "__main__":
    sys.exit(main())

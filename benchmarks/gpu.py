"""On the GPU: every figure the design promises, checked on CUDA in one prepared run.

Sections, each in its own interpreter under its own time limit (a section that crashes or runs over
leaves the rows it wrote, and the next one starts clean):

- `env`: the device, torch, CUDA and transformers versions.
- `cap`: a Llama-shaped model whose plain step needs twice the cap is planned and trained under
  `torch.cuda.set_per_process_memory_fraction` set to that cap; `cap_segments` the same with
  `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`.
- `frontier`: a ~1B Llama (16 x 2,048, 2,048 tokens, batch 4, bf16) raced against transformers'
  `every_n_layers` n = 1, 2, 4 and its `offload` option (built as transformers 5.24 builds it where the
  installed one has none), ours planned at each of their measured peaks,
  with a twin of each of their points; CUDA events, interleaved, `rounds` steps each.
- `zoo`: every model of tests/models/zoo.py planned at 50 % of its activation memory, in deterministic
  fp32 and in bf16 autocast: predicted peak against `torch.cuda.max_memory_allocated`, within budget,
  gradients bitwise (fp32) or their largest difference (bf16).
- `tests`: the tests marked `cuda` (they skip without a device).
- `compile`: `optimize(compile=True)` at compile@0.5's measured peak, against compile@0.5 (whole regions, then the knapsack lowering where no regions plan fits and time is left).
- `autocast`: bf16 autocast's predicted peaks against the measured ones: zoo models planned at 50 %
  under bf16 autocast, measured as planned (autograd's device thread runs the recompute's autocast block
  outermost, whose exit empties autocast's cache of weight casts: the prediction places them), with the
  backward on the calling thread (against the prediction with the cache held through the step) and with
  checkpoint's early stop off.
- `offload`: the ~1B Llama at per-layer checkpointing's measured peak, at the lowest budget recompute
  alone fits, and halfway from there to the lowest one offload fits: our best recompute-only plan against
  ours with offload (host copy bandwidth measured; simulated in the dry run) and transformers' offload
  option where it has one; peaks, bitwise gradients, predicted and measured steps.
- `conformance`: the conformance matrix's held-out models (then a few others) planned as a user plans them on
  the device, in fp32, bf16 autocast and the whole model in bf16: peaks, gradients and the step-time model
  (benchmarks/gpu_conformance.py).

    python -m benchmarks.gpu                  # on a CUDA device: every section, at most 15 minutes (LIMITS)
    python -m benchmarks.gpu --sections offload,cap,zoo --limits zoo=240   # what a 15-minute device loan holds
    python -m benchmarks.gpu --dry            # the whole run at tiny shapes on the CPU (the tests run it)
    python -m benchmarks.gpu --sections frontier,cap

Writes gpu-<kind>.json and gpu-<kind>.md (kind: h100, h200, ...; `dry` for the dry run) in --out
(default benchmarks/results; the dry run's default is a temporary folder).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from . import gpu_conformance
from ._io import out_dir, write_files
from .gpu_conformance import section_conformance  # noqa: F401 - a section, found by name

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SECTIONS = ("env", "cap", "cap_segments", "frontier", "zoo", "tests", "compile", "offload", "autocast", "conformance")

# Seconds each section may take on the device, in the order they run (at most 15 minutes in all). The
# dry run takes its own, larger limits: it runs on 2 busy CPU cores.
LIMITS = {"env": 15, "cap": 60, "cap_segments": 60, "frontier": 190, "zoo": 170, "tests": 30, "compile": 55,
          "offload": 240, "autocast": 60, "conformance": 240}
DRY_LIMITS = {"env": 60, "cap": 240, "cap_segments": 240, "frontier": 240, "zoo": 240, "tests": 120, "compile": 240,
              "offload": 240, "autocast": 180, "conformance": 240}
DRY_BANDWIDTH = (1e10, 1e10)
"""The dry run's simulated host copy bandwidth (bytes/s each way): the CPU has none to measure."""
# cap_segments: the cap section again under the allocator setting that stops fragmentation (read when CUDA
# starts), to tell the allocator's own overhead from the plan's under a cap equal to the budget
SECTION_ENV = {"cap_segments": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}}

LLAMA_1B = dict(layers=16, d=2048, heads=16, kv=16, ffn=5632, vocab=32000, batch=4, seq=2048)
SIZES = {
    "full": {
        "frontier": {**LLAMA_1B, "rounds": 20, "points": (1, 2, 4)},
        # activations dominate: the plain step needs more than twice per-layer checkpointing's peak
        "cap": dict(layers=8, d=1024, heads=8, kv=8, ffn=2816, vocab=8000, batch=4, seq=4096),
        "compile": {**LLAMA_1B, "layers": 4, "rounds": 20},
        "offload": {**LLAMA_1B, "rounds": 10},
        "zoo": None,  # every model
        "autocast": ("gpt2", "vit", "bert"),
    },
    "dry": {
        "frontier": dict(layers=4, d=64, heads=4, kv=2, ffn=176, vocab=512, batch=2, seq=64, rounds=2, points=(1, 2)),
        "cap": dict(layers=4, d=64, heads=4, kv=4, ffn=176, vocab=256, batch=2, seq=256),
        "compile": dict(layers=2, d=32, heads=2, kv=2, ffn=64, vocab=128, batch=2, seq=32, rounds=2),
        "offload": dict(layers=2, d=64, heads=4, kv=2, ffn=176, vocab=512, batch=2, seq=64, rounds=2),
        "zoo": ("gpt2", "unet"),
        "autocast": ("gpt2",),
    },
}


# -- shared pieces (imported in the section's own interpreter) ----------------------------------


def _device(dry: bool):
    import torch

    return torch.device("cpu" if dry else "cuda")


def llama(s: dict, device, dtype) -> tuple[Any, dict]:
    """A Llama-shaped causal LM with random weights (sdpa attention) and its batch, on `device`."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(num_hidden_layers=s["layers"], hidden_size=s["d"], num_attention_heads=s["heads"],
                         num_key_value_heads=s["kv"], intermediate_size=s["ffn"], vocab_size=s["vocab"],
                         max_position_embeddings=max(512, s["seq"]), use_cache=False, pad_token_id=0,
                         attn_implementation="sdpa")
    with torch.device(device):  # initialised where it runs: a 1B model's init on the host takes long
        model = tf.LlamaForCausalLM(cfg)
    model = model.to(dtype).train()
    ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), device=device)
    return model, {"input_ids": ids, "labels": ids.clone()}


def hf_has_offload(model) -> bool:
    """Whether this transformers' activation checkpointing has its own `offload` option (5.24 on)."""
    fn = getattr(model, "activation_checkpointing_enable", None)
    return fn is not None and "offload" in inspect.signature(fn).parameters


def hf_every(model, n: int, offload: bool = False):
    """A copy of `model` under transformers' own checkpointing at every_n_layers=n (None where this
    transformers has no such knob). Where it has no offload option, offload is built as 5.24 builds it:
    per-layer checkpointing with each checkpoint call inside `torch.autograd.graph.save_on_cpu(pin_memory=True)`,
    so the layer inputs a recompute needs wait in pinned host memory."""
    import copy

    import torch

    m = copy.deepcopy(model)
    if getattr(model, "activation_checkpointing_enable", None) is not None and (hf_has_offload(model) or not offload):
        kwargs = {"offload": True} if offload else {}
        m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=n,
                                          **kwargs)
        return m.train()
    # older transformers: per-layer checkpointing, then every n-th layer kept on, as every_n_layers does
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return m.train() if n == 1 and not offload and m.gradient_checkpointing_enable() is None else None
    device_type = next(model.parameters()).device.type

    def offloaded(function, *args, **kwargs):
        with torch.autograd.graph.save_on_cpu(pin_memory=True, device_type=device_type):
            return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)

    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    layers = [x for x in m.modules() if isinstance(x, GradientCheckpointingLayer)]
    if offload and not layers:
        return None
    for i, layer in enumerate(layers):
        layer.gradient_checkpointing = i % n == 0
        if offload:
            layer._gradient_checkpointing_func = offloaded
    return m.train()


def peak_of(module, owner, inputs: dict, device) -> tuple[int, list]:
    """One training step's allocator peak (resident state included) and its gradients."""
    import torch
    from ckpt_planner.profile.loss import default_loss
    from ckpt_planner.profile.memory import measure_step_peaks

    params = list(owner.parameters())
    torch.manual_seed(1234)
    peaks, _ = measure_step_peaks(module, (), inputs, params, params + list(owner.buffers()), default_loss, device)
    grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    for p in params:
        p.grad = None
    return int(peaks.allocator), grads


def phase_peaks(plan, owner, inputs, device) -> dict:
    """Where a plan's peak parts from its prediction: the allocator's peak in its forward (the loss
    included) and in its backward, resident state included, each with the simulator's for that phase
    (the most bytes of its event timeline there). # bytes"""
    import torch
    from ckpt_planner.profile.loss import default_loss
    from ckpt_planner.profile.memory import AllocatorMeter, LiveMemory, fresh_autocast_cache
    from ckpt_planner.solvers.simulate import replay
    from torch.utils import _pytree as pytree

    from tests.support.steps import as_call

    args, kwargs = as_call(inputs)
    params = list(owner.parameters())
    for p in params:
        p.grad = None
    mem = LiveMemory()
    mem.track(params + list(owner.buffers()), [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)])
    fresh_autocast_cache()
    torch.manual_seed(1234)
    with AllocatorMeter(device) as meter:
        meter.mark("forward")
        loss = default_loss(plan.module(*args, **kwargs))
        meter.mark("backward")
        loss.backward()
    del loss
    for p in params:
        p.grad = None
    measured = {w.name: mem.current + w.peak for w in meter.windows()}
    sim = replay(plan.problem, plan.spans(), saved=plan.saved_indices(), offloaded=plan.offloaded_storages(), timeline=True)
    predicted = {"forward": max((b for ph, _, b in sim.timeline if ph == "forward"), default=0),
                 "backward": max((b for ph, _, b in sim.timeline if ph != "forward"), default=0)}
    return {f"{phase}_{kind}_bytes": figures.get(phase, 0) for kind, figures in (("measured", measured),
            ("predicted", predicted)) for phase in ("forward", "backward")}


def same_grads(a: list, b: list) -> tuple[bool, float]:
    """(bitwise equal, largest absolute difference) of two gradient lists."""
    diff, equal = 0.0, len(a) == len(b)
    for x, y in zip(a, b):
        if x is None or y is None:
            equal = equal and x is None and y is None
            continue
        equal = equal and bool((x == y).all())
        diff = max(diff, float((x.float() - y.float()).abs().max()))
    return equal, diff


class Timer:
    """Step times of one module: CUDA events on a device, the host clock on the CPU."""

    def __init__(self, name: str, module, owner, device) -> None:
        self.name, self.module, self.owner, self.device = name, module, owner, device
        self.pending: list = []
        self.ms: list[float] = []

    def step(self, inputs: dict, timed: bool = True) -> None:
        import torch
        from ckpt_planner.profile.loss import default_loss

        for p in self.owner.parameters():
            p.grad = None
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            default_loss(self.module(**inputs)).backward()
            end.record()
            if timed:
                self.pending.append((start, end))
        else:
            t0 = time.perf_counter()
            default_loss(self.module(**inputs)).backward()
            if timed:
                self.ms.append((time.perf_counter() - t0) * 1e3)

    def settle(self) -> None:
        for start, end in self.pending:
            self.ms.append(start.elapsed_time(end))
        self.pending.clear()

    @property
    def median(self) -> float:
        return statistics.median(self.ms)


def race(timers: list[Timer], inputs: dict, rounds: int, device) -> None:
    """One untimed step each, then `rounds` rounds of one step each, the order rotating every round."""
    import torch

    for t in timers:
        t.step(inputs, timed=False)
    for k in range(rounds):
        for j in range(len(timers)):
            timers[(k + j) % len(timers)].step(inputs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        for t in timers:
            t.settle()
    for t in timers:
        for p in t.owner.parameters():
            p.grad = None


def time_left() -> float:
    """Seconds this section has left of its limit (the parent kills it at zero)."""
    return float(os.environ.get("GPU_SECTION_DEADLINE", "inf")) - time.time()


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- sections ------------------------------------------------------------------------------------


def section_env(sizes: dict, dry: bool, emit: Callable[[dict], None], log) -> None:
    import torch

    row = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "host": platform.machine(), "cpus": os.cpu_count()}
    try:
        import transformers

        row["transformers"] = transformers.__version__
    except ImportError:
        row["transformers"] = None
    for name in ("pulp", "highspy", "networkx"):
        try:
            mod = __import__(name)
            row[name] = getattr(mod, "__version__", "installed")
        except ImportError:
            row[name] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        row.update(device=torch.cuda.get_device_name(0), memory_bytes=p.total_memory,
                   multiprocessors=p.multi_processor_count)
    else:
        row["device"] = f"CPU ({platform.processor() or platform.machine()})"
    emit(row)


def section_cap(sizes: dict, dry: bool, emit, log) -> None:
    """Plan and train under a memory cap half the plain step's peak."""
    import torch
    from ckpt_planner.api import optimize
    from ckpt_planner.profile.loss import default_loss

    device = _device(dry)
    s = sizes["cap"]
    model, inputs = llama(s, device, torch.float32 if dry else torch.bfloat16)
    plain, _ = peak_of(model, model, inputs, device)
    copy = hf_every(model, 1)
    per_layer = peak_of(copy, copy, inputs, device)[0] if copy is not None else None
    del copy
    _free()
    cap = plain // 2
    row: dict[str, Any] = {"shape": s, "plain_bytes": plain, "per_layer_bytes": per_layer, "cap_bytes": cap,
                           "enforced": device.type == "cuda"}
    log(f"cap: plain step {_mb(plain)} MB, per-layer {_mb(per_layer)} MB, cap {_mb(cap)} MB")
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())  # the memory fraction needs an index
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(cap / total, device)
        torch.cuda.reset_peak_memory_stats(device)
        _watch_out_of_memory(row)
    try:
        t0 = time.perf_counter()
        try:
            plan = optimize(model, inputs, budget_bytes=cap)
        except Exception as e:  # recorded, not raised: what a user under this cap would see is the result
            row.update(planned=False, error=f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                       plan_s=time.perf_counter() - t0)
            if device.type == "cuda":
                row["planning_peak_bytes"] = torch.cuda.max_memory_allocated(device)
                row["planning_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
            emit(row)
            return
        row.update(planned=True, plan_s=time.perf_counter() - t0, solver=plan.solver,
                   predicted_peak_bytes=plan.predicted_peak_bytes, regions=len(plan.regions),
                   notes=list(plan.notes)[:6])
        if device.type == "cuda":
            row["planning_peak_bytes"] = torch.cuda.max_memory_allocated(device)
            row["planning_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)
        peaks = []
        for _ in range(3):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            default_loss(plan.module(**inputs)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                peaks.append(torch.cuda.max_memory_allocated(device))
        row.update(trained_steps=3, train_peak_bytes=max(peaks) if peaks else None)
        if device.type != "cuda":  # no cap to enforce: the step's peak on the allocator meter instead
            row["train_peak_bytes"] = peak_of(plan.module, model, inputs, device)[0]
        row["within_cap"] = row["train_peak_bytes"] <= cap and row.get("planning_peak_bytes", 0) <= cap
        emit(row)
    finally:
        if device.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, device)


def _watch_out_of_memory(row: dict) -> None:
    """Record in `row` the first request the caching allocator refuses: its size and, at that moment, the
    bytes allocated, reserved and lying free in split blocks (what tells fragmentation from a plan over its
    prediction). Where this torch has no out-of-memory observer, nothing."""
    import torch

    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None:
        return

    def seen(device, request, limit, free):
        if "first_out_of_memory" not in row:
            stats = torch.cuda.memory_stats(device)
            row["first_out_of_memory"] = {
                "request_bytes": int(request), "allocated_bytes": stats.get("allocated_bytes.all.current"),
                "reserved_bytes": stats.get("reserved_bytes.all.current"),
                "split_free_bytes": stats.get("inactive_split_bytes.all.current")}

    attach(seen)


def section_frontier(sizes: dict, dry: bool, emit, log) -> None:
    """Ours against transformers' every_n_layers and offload, at each of their measured peaks."""
    import torch
    from ckpt_planner.api import Planner
    from ckpt_planner.solvers import InfeasibleBudgetError

    device = _device(dry)
    s = sizes["frontier"]
    model, inputs = llama(s, device, torch.float32 if dry else torch.bfloat16)
    eager = Timer("eager", model, model, device)
    eager_peak, eager_grads = peak_of(model, model, inputs, device)
    again = same_grads(eager_grads, peak_of(model, model, inputs, device)[1])
    emit({"kind": "eager", "shape": {k: v for k, v in s.items() if k != "points"}, "peak_bytes": eager_peak,
          "parameters": sum(p.numel() for p in model.parameters()), "repeatable_bitwise": again[0],
          "repeat_max_abs_diff": again[1]})
    theirs: list[tuple[Timer, int, Timer | None]] = []  # (contender, its peak, its twin)
    # transformers' offload pins host memory: it needs a device
    for n in [n for n in s["points"] if n <= s["layers"]] + (["offload"] if device.type == "cuda" else []):
        try:
            m = hf_every(model, 1, offload=True) if n == "offload" else hf_every(model, n)
        except Exception as e:  # this transformers' knob itself fails: recorded, the race goes on without it
            emit({"kind": "contender", "name": f"hf {n}", "missing": f"{type(e).__name__}: {e}"})
            continue
        if m is None:
            emit({"kind": "contender", "name": f"hf {n}", "missing": "not in this transformers"})
            continue
        name = (f"hf offload (every layer{'' if hf_has_offload(model) else ', built as transformers 5.24 builds it'})"
                if n == "offload"
                else f"hf every_n_layers={n}")
        peak, grads = peak_of(m, m, inputs, device)
        twin_m = hf_every(model, 1, offload=True) if n == "offload" else hf_every(model, n)
        theirs.append((Timer(name, m, m, device), peak, Timer(f"twin of {name}", twin_m, twin_m, device)))
        log(f"frontier: {name}: {peak / 1e6:.0f} MB")
    t0 = time.perf_counter()
    planner = Planner(model, inputs)
    emit({"kind": "profile", "seconds": time.perf_counter() - t0, "nodes": planner.problem.n,
          "predicted_eager_bytes": planner.baseline_peak_bytes})
    log(f"frontier: profiled {planner.problem.n} nodes in {time.perf_counter() - t0:.0f} s")
    ours: dict[str, tuple[Timer, dict]] = {}
    for timer, peak, _ in theirs:
        t1 = time.perf_counter()
        if time_left() < 0.4 * float(os.environ.get("GPU_SECTION_LIMIT", "inf")):  # keep time for the race
            ours[timer.name] = (None, {"infeasible": "not planned: the section's time went to the points before"})
            continue
        try:
            plan = planner.plan(budget_bytes=peak, autotune=True)
        except InfeasibleBudgetError as e:
            ours[timer.name] = (None, {"infeasible": str(e).splitlines()[0]})
            continue
        except Exception as e:  # a planning failure at one point is a finding; the race goes on
            ours[timer.name] = (None, {"infeasible": f"FAILED {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
            continue
        mine_peak, grads = peak_of(plan.module, model, inputs, device)
        bitwise, diff = same_grads(eager_grads, grads)
        rec = plan.stats.get("autotune", {})
        ours[timer.name] = (Timer(f"ours @ {timer.name}", plan.module, model, device), {
            "plan_s": time.perf_counter() - t1, "solver": plan.solver, "chosen": rec.get("chosen"),
            "regions": len(plan.regions), "predicted_peak_bytes": plan.predicted_peak_bytes,
            "ours_peak_bytes": mine_peak, "grads_bitwise": bitwise, "max_abs_grad_diff": diff,
            "predicted_extra_s": plan.predicted_recompute_s,
        })
        log(f"frontier: ours @ {timer.name}: {mine_peak / 1e6:.0f} MB measured, {plan.predicted_peak_bytes / 1e6:.0f} "
            f"predicted, {time.perf_counter() - t1:.0f} s")
    timers = [eager] + [t for t, _, _ in theirs] + [tw for _, _, tw in theirs] + [t for t, _ in ours.values() if t]
    race(timers, inputs, s["rounds"], device)
    base = eager.median
    emit({"kind": "race", "rounds": s["rounds"], "eager_ms": base,
          "medians_ms": {t.name: t.median for t in timers}, "fastest_ms": {t.name: min(t.ms) for t in timers}})
    for timer, peak, twin in theirs:
        mine, info = ours[timer.name]
        theirs_ovh = timer.median / base - 1
        row = {"kind": "point", "contender": timer.name, "contender_peak_bytes": peak, "contender_overhead": theirs_ovh,
               "twin_overhead": twin.median / base - 1, "twin_ratio": twin.median / timer.median, **info}
        if mine is not None:
            ours_ovh = mine.median / base - 1
            row.update(ours_overhead=ours_ovh, fits=info["ours_peak_bytes"] <= peak,
                       ratio=ours_ovh / theirs_ovh if theirs_ovh > 0.005 else None,
                       prediction_error=(info["predicted_peak_bytes"] - info["ours_peak_bytes"]) / info["ours_peak_bytes"])
        emit(row)


def section_offload(sizes: dict, dry: bool, emit, log) -> None:
    """Our best recompute-only plan against ours with offload (bandwidth measured; simulated in the dry
    run), and transformers' offload where it has one, at the budgets where the choice matters: per-layer
    checkpointing's measured peak, the lowest budget recompute alone fits, and halfway from there down to the
    lowest one offload fits. Each point's row is written as soon as it is planned, so a section cut short
    still says what it planned and how long that took."""
    import torch
    from ckpt_planner.api import Planner
    from ckpt_planner.profile.copy_bandwidth import copy_bandwidth
    from ckpt_planner.solvers import InfeasibleBudgetError

    device = _device(dry)
    s = sizes["offload"]
    model, inputs = llama(s, device, torch.float32 if dry else torch.bfloat16)
    eager = Timer("eager", model, model, device)
    eager_peak, eager_grads = peak_of(model, model, inputs, device)
    per_layer = hf_every(model, 1)
    layer_peak = peak_of(per_layer, per_layer, inputs, device)[0] if per_layer is not None else None
    bw = copy_bandwidth(device, simulated=DRY_BANDWIDTH if dry else None)
    emit({"kind": "setup", "shape": {k: v for k, v in s.items() if k != "rounds"}, "eager_peak_bytes": eager_peak,
          "per_layer_peak_bytes": layer_peak, "d2h_bytes_per_s": bw.d2h_bytes_per_s,
          "h2d_bytes_per_s": bw.h2d_bytes_per_s, "bandwidth_source": bw.source})
    if layer_peak is None:
        emit({"kind": "point", "missing": "no per-layer checkpointing in this transformers: no reference peak"})
        return
    log(f"offload: per-layer peak {layer_peak / 1e6:.0f} MB, bandwidth {bw.d2h_bytes_per_s / 1e9:.1f}/"
        f"{bw.h2d_bytes_per_s / 1e9:.1f} GB/s ({bw.source})")
    timers: list[Timer] = [eager]
    hf = hf_every(model, 1, offload=True) if device.type == "cuda" else None  # transformers' offload pins host memory
    hf_peak = None
    if hf is None:
        emit({"kind": "contender", "name": "hf offload", "missing": "no checkpointed layers to offload in this "
              "transformers" if device.type == "cuda" else "needs a CUDA device (it pins host memory)"})
    else:
        hf_peak, hf_grads = peak_of(hf, hf, inputs, device)
        timers.append(Timer("hf offload (every layer)", hf, hf, device))
        emit({"kind": "contender", "name": "hf offload", "peak_bytes": hf_peak,
              "grads_bitwise": same_grads(eager_grads, hf_grads)[0]})
    # one profile planned twice: copies priced at the device's bandwidth and at 0 bytes/s (never offloads),
    # so that both solve on the same timings (profiled apart, the device's noise alone moves their plans)
    offloading = Planner(model, inputs, offload_bandwidth=(bw.d2h_bytes_per_s, bw.h2d_bytes_per_s))
    planners = {"recompute": _without_offload(offloading), "offload": offloading}
    floors = {}
    for label, planner in planners.items():  # a budget no plan meets: refused from the bytes, with the floor
        try:
            planner.plan(budget_bytes=1, autotune=False)
        except InfeasibleBudgetError as e:
            floors[label] = e.smallest_bytes
    emit({"kind": "floors", **{f"{k}_floor_bytes": v for k, v in floors.items()}})
    points: list[tuple[str, int]] = [("per-layer peak", layer_peak)]
    if hf_peak is not None:  # ours against transformers' offload at its own measured peak
        points.append(("hf offload peak", hf_peak))
    if "recompute" in floors:
        points.append(("recompute floor", floors["recompute"]))
        if floors.get("offload", floors["recompute"]) < floors["recompute"]:
            points.append(("offload reach", (floors["recompute"] + floors["offload"]) // 2))
    rows: list[tuple[Timer | None, dict]] = []
    for name, budget in points:
        for label, planner in planners.items():
            if label == "recompute" and budget < floors.get("recompute", 0):
                continue  # below recompute's floor: only offload reaches it
            row = {"kind": "point", "point": name, "fraction": round(budget / layer_peak, 4), "budget_bytes": budget,
                   "plan": label}
            if time_left() < 0.3 * float(os.environ.get("GPU_SECTION_LIMIT", "inf")):  # keep time for the race
                rows.append((None, {**row, "infeasible": "not planned: the section's time went to the points before"}))
                emit({**row, "kind": "planned", "infeasible": rows[-1][1]["infeasible"]})
                continue
            log(f"offload: planning {label} at {name} ({budget / 1e6:.0f} MB)")
            t1 = time.perf_counter()
            try:
                plan = planner.plan(budget_bytes=budget, autotune=not dry)  # the dry run checks the path, not the clock
            except Exception as e:  # infeasible, or a planning failure at one point: a finding; the race goes on
                why = (str(e).splitlines()[0] if isinstance(e, InfeasibleBudgetError)
                       else f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                rows.append((None, {**row, "infeasible": why, "plan_s": time.perf_counter() - t1}))
                emit({**rows[-1][1], "kind": "planned"})
                continue
            peak, grads = peak_of(plan.module, model, inputs, device)
            bitwise, diff = same_grads(eager_grads, grads)
            info = plan.stats.get("offload") or {}
            row.update(plan_s=time.perf_counter() - t1, solver=plan.solver, regions=len(plan.regions),
                       offloaded=len(plan.offloaded), offloaded_bytes=plan.offloaded_bytes,
                       exposed_copy_s=info.get("exposed_copy_s", 0.0), predicted_peak_bytes=plan.predicted_peak_bytes,
                       peak_bytes=peak, fits=peak <= budget, grads_bitwise=bitwise, max_abs_grad_diff=diff,
                       predicted_step_s=plan.predicted_step_s)
            emit({**row, "kind": "planned"})
            rows.append((Timer(f"{label} @ {name}", plan.module, model, device), row))
            log(f"offload: {label} @ {name}: {peak / 1e6:.0f} MB measured, {plan.predicted_peak_bytes / 1e6:.0f} "
                f"predicted, {len(plan.offloaded)} offloaded, planned in {row['plan_s']:.0f} s")
    timers += [t for t, _ in rows if t is not None]
    race(timers, inputs, s["rounds"], device)
    emit({"kind": "race", "rounds": s["rounds"], "eager_ms": eager.median, "medians_ms": {t.name: t.median for t in timers}})
    for timer, row in rows:
        if timer is not None:
            row.update(step_ms=timer.median, overhead=timer.median / eager.median - 1,
                       predicted_step_ms=row["predicted_step_s"] * 1e3)
        emit(row)


def _without_offload(planner):
    """`planner`'s capture and profile, planned as if the device could not copy to the host: its problem
    rebuilt with copies priced at 0 bytes/s (the solvers then never offload)."""
    import copy
    import dataclasses

    from ckpt_planner.choose.profiled import profiled

    other = copy.copy(planner)
    offload = dataclasses.replace(planner.setup.offload, bandwidth=(0.0, 0.0))
    other.setup = dataclasses.replace(planner.setup, offload=offload)
    p = planner.profiled
    other.profiled = profiled(planner.model, p.capture, p.cost, other.setup, chunks=p.chunks,
                              capture_notes=p.capture_notes)
    other.profiled.values = p.values
    return other


def section_autocast(sizes: dict, dry: bool, emit, log) -> None:
    """Zoo models planned at 50 % under bf16 autocast, their peak measured three ways (see the module doc)."""
    import dataclasses

    import torch
    from ckpt_planner.profile.loss import default_loss
    from ckpt_planner.profile.memory import measure_step_peaks
    from ckpt_planner.solvers import simulate
    from torch.utils.checkpoint import set_checkpoint_early_stop

    from tests.models.zoo import build, planned_at_half

    device = _device(dry)
    for name in sizes["autocast"]:
        model, inputs = build(name)
        model, inputs = model.to(device), _to(inputs, device)
        params = list(model.parameters())
        with torch.autocast(device.type, dtype=torch.bfloat16):
            planner, plan = planned_at_half(model, inputs)
            cap = planner.profiled.capture
            problem = planner.profiled.problem
            held = dataclasses.replace(problem, casts_cleared=False)  # as on the caller's thread
            row = {"model": name, "regions": len(plan.regions), "budget_bytes": plan.budget_bytes,
                   "predicted_bytes": plan.predicted_peak_bytes, "casts_cleared": problem.casts_cleared,
                   "predicted_held_bytes": simulate(held, plan.spans(), saved=plan.saved_indices()).peak_bytes,
                   "cast_bytes": planner.profiled.cost.param_bytes - sum(p.numel() * p.element_size() for p in params)}
            # made at each use: set_multithreading_enabled switches the mode when it is made, not entered
            ways = (("default", contextlib.nullcontext),
                    ("caller_thread", lambda: torch.autograd.set_multithreading_enabled(False)),
                    ("early_stop_off", lambda: set_checkpoint_early_stop(False)))
            for label, way in ways:
                with way():
                    peaks, out = measure_step_peaks(plan.module, cap.args, cap.kwargs, params,
                                                    params + list(model.buffers()), default_loss, device)
                del out
                for p in params:
                    p.grad = None
                row[f"{label}_bytes"] = int(peaks.allocator)
        emit(row)
        log(f"autocast: {name}: predicted {row['predicted_bytes']}, measured {row['default_bytes']}")
        del model, inputs, planner, plan
        _free()


def _where(limit: int) -> list[str]:
    """The last lines of the traceback being handled, with file paths cut to the package's own."""
    lines = traceback.format_exc().splitlines()[-limit:]
    return [re.sub(r'"[^"]*(site-packages|dist-packages)/', '"', line).replace(str(ROOT) + "/", "") for line in lines]


def _to(x, device):
    import torch
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, x)


def section_zoo(sizes: dict, dry: bool, emit, log) -> None:
    """Every zoo model at 50 % (or those GPU_ZOO_MODELS names), in deterministic fp32 and in bf16 autocast."""
    import torch
    from ckpt_planner.api import Planner
    from ckpt_planner.choose.partial import PartialPlanner
    from ckpt_planner.errors import CaptureError

    from tests.models.zoo import ZOO, build, run_case

    device = _device(dry)
    chosen = [m for m in os.environ.get("GPU_ZOO_MODELS", "").split(",") if m]
    names = chosen or sizes["zoo"] or tuple(ZOO)
    for name, precision in [(n, p) for n in names for p in ("fp32", "bf16")]:  # a cut-short run has both
        torch.use_deterministic_algorithms(precision == "fp32", warn_only=False)
        t0 = time.perf_counter()
        if time_left() < 5:
            emit({"model": name, "precision": precision, "skipped": "out of the section's time"})
            continue
        model = inputs = None
        try:
            model, inputs = build(name)
            model, inputs = model.to(device), _to(inputs, device)
            ctx = torch.autocast(device.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
            with ctx:
                try:
                    planner = Planner(model, inputs)
                    planner.autotune = False  # the figures checked here are bytes and gradients, not speed
                    partial = False
                except CaptureError as e:  # planned in parts, as optimize() does: its prediction is an upper bound
                    planner, partial = PartialPlanner(model, inputs, reason=str(e).splitlines()[0]), True
                plans: list = []
                row = {**run_case(planner, model, inputs, "auto", 0.5, plans=plans), "partial": partial}
                # a peak under its prediction, or well over: which phase, the same plan measured again
                error = row.get("prediction_error")
                if error is not None and (dry or not -0.002 <= error <= 0.01):
                    row["phases"] = phase_peaks(plans[0], model, inputs, device)
        except Exception as e:
            row = {"failed": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
                   "where": _where(3)}
        keep = ("feasible", "budget_bytes", "predicted_bytes", "measured_bytes", "baseline_measured_bytes",
                "prediction_error", "within_budget", "exact", "max_abs_grad_diff", "same_as_captured_graph",
                "regions", "partial", "phases", "failed", "skipped", "where")
        emit({"model": name, "precision": precision, "seconds": time.perf_counter() - t0,
              **{k: row[k] for k in keep if k in row}})
        log(f"zoo: {name} {precision}: {row.get('prediction_error', row.get('failed'))}")
        del model, inputs
        _free()
    torch.use_deterministic_algorithms(False)


def section_tests(sizes: dict, dry: bool, emit, log) -> None:
    """The tests marked `cuda`, in a pytest of their own."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if "pytest.mark.cuda" in p.read_text())
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "-rs", *files]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    lines = (done.stdout + done.stderr).strip().splitlines()
    emit({"files": files, "returncode": done.returncode, "summary": lines[-1] if lines else "", "tail": lines[-15:]})


def section_compile(sizes: dict, dry: bool, emit, log) -> None:
    """compile=True at compile@0.5's measured peak, raced against compile@0.5."""
    import torch
    from ckpt_planner.api import optimize
    from ckpt_planner.compile.compiled import measure_compiled_step

    from benchmarks.compile import compile_at

    device = _device(dry)
    s = sizes["compile"]
    model, inputs = llama(s, device, torch.float32 if dry else torch.bfloat16)
    t0 = time.perf_counter()
    theirs = compile_at(model, 0.5)
    peak = measure_compiled_step(theirs, theirs._orig_mod, (), inputs, device=device)
    row: dict[str, Any] = {"shape": s, "compile_at_0.5_peak_bytes": peak, "their_compile_s": time.perf_counter() - t0}
    log(f"compile: compile@0.5 peaks at {peak / 1e6:.0f} MB ({time.perf_counter() - t0:.0f} s)")
    # One lowering at a time ("best" compiles both at once, and each compile of this model takes a good
    # part of the section): whole regions first, then the knapsack (compile's own partitioner, our byte
    # target) where the regions' plans do not fit and time is left.
    first = time_left()
    for lowering in ("regions", "knapsack"):
        if lowering != "regions" and time_left() < 0.6 * first:
            emit({**row, "lowering_asked": lowering, "planned": False, "error": "not tried: out of the section's time"})
            return
        t0 = time.perf_counter()
        try:
            plan = optimize(model, inputs, budget_bytes=peak, compile=True, lowering=lowering)
        except Exception as e:
            emit({**row, "lowering_asked": lowering, "planned": False, "plan_s": time.perf_counter() - t0,
                  "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"})
            continue
        c = plan.stats.get("compiled", {})
        done = {**row, "lowering_asked": lowering, "planned": True, "plan_s": time.perf_counter() - t0,
                "ours_peak_bytes": plan.measured_peak_bytes, "lowering": c.get("lowering"),
                "fits": plan.measured_peak_bytes <= peak}
        timers = [Timer("compile@0.5", theirs, theirs._orig_mod, device), Timer("ours compile=True", plan.module, model, device)]
        race(timers, inputs, s["rounds"], device)
        emit({**done, "medians_ms": {t.name: t.median for t in timers}, "ratio": timers[1].median / timers[0].median})
        return


# -- orchestration -------------------------------------------------------------------------------


def child(section: str, rows_path: Path, dry: bool) -> int:
    """Run one section in this interpreter, one JSON line per row as it is made."""
    sizes = SIZES["dry" if dry else "full"]

    def emit(row: dict) -> None:
        with rows_path.open("a") as f:
            f.write(json.dumps(row, default=str) + "\n")

    def log(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    import logging
    import warnings

    warnings.filterwarnings("ignore")
    # the planner's stage lines (capture, profile, solve, check, autotune) with their times, so the log tail
    # of a section cut short says where its time went
    stages = logging.StreamHandler(sys.stderr)
    stages.addFilter(lambda record: record.name == "ckpt_planner")
    stages.setFormatter(logging.Formatter("%(relativeCreated)8.0f ms  %(message)s"))
    logging.getLogger("ckpt_planner").addHandler(stages)
    logging.getLogger("ckpt_planner").setLevel(logging.INFO)
    try:
        globals()[f"section_{section.removesuffix('_segments')}"](sizes, dry, emit, log)
    except Exception as e:
        emit({"section_error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
              "traceback": _where(8)})
        return 1
    return 0


def run_section(section: str, dry: bool, limit: float, work: Path, zoo_models: str = "") -> dict:
    rows_path = work / f"{section}.jsonl"
    rows_path.unlink(missing_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", KINETO_LOG_LEVEL="6")
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, read when CUDA starts
    env.update(GPU_SECTION_LIMIT=str(limit), GPU_SECTION_DEADLINE=str(time.time() + limit), **SECTION_ENV.get(section, {}))
    if zoo_models:
        env["GPU_ZOO_MODELS"] = zoo_models
    cmd = [sys.executable, "-m", "benchmarks.gpu", "--child", section, "--rows", str(rows_path)] + (["--dry"] if dry else [])
    t0 = time.perf_counter()
    status = "ok"
    try:
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
        tail = (done.stderr or "").strip().splitlines()[-30:]
        if done.returncode != 0:
            status = f"failed (exit {done.returncode})"
    except subprocess.TimeoutExpired as e:
        status = f"out of time after {limit:.0f} s"
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        tail = err.strip().splitlines()[-30:]
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()] if rows_path.exists() else []
    if any("section_error" in r for r in rows):
        status = "failed"
    return {"status": status, "seconds": time.perf_counter() - t0, "rows": rows, "log_tail": tail,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def kind_of(env_rows: list[dict], dry: bool) -> str:
    if dry:
        return "dry"
    name = (env_rows[0].get("device") if env_rows else "") or ""
    for k in ("H200", "H100", "A100", "L40S", "L4", "B200"):
        if k in name:
            return k.lower()
    return "cuda"


def _mb(n) -> str:
    return "-" if n is None else f"{n / 1e6:,.1f}"


def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:+.1f} %"


def markdown(results: dict) -> str:
    env = (results["sections"].get("env", {}).get("rows") or [{}])[0]
    out = [f"# On the GPU: {env.get('device', '?')}", "",
           f"torch {env.get('torch')}, CUDA {env.get('cuda')}, transformers {env.get('transformers')}, "
           f"python {env.get('python')}. `{results['command']}`, {results['date']}, {results['seconds']:.0f} s.", "",
           "| section | status | seconds | run |", "|---|---|---|---|"]
    if results.get("notes"):  # what a merge of several device runs says of them (merge_runs)
        out[4:4] = [f"- {n}" for n in results["notes"]] + [""]
    for name in [n for n in SECTIONS if n in results["sections"]]:
        sec = results["sections"][name]
        out.append(f"| {name} | {sec['status']} | {sec['seconds']:.0f} | {sec.get('date', results['date'])} |")
    secs = results["sections"]
    for name, how in (("cap", "the default allocator"), ("cap_segments", "expandable_segments:True")):
        cap = [r for r in secs.get(name, {}).get("rows", []) if "cap_bytes" in r]
        if not cap:
            continue
        r = cap[0]
        out += ["", f"## Planning under a cap ({how})", "",
                f"Plain step {_mb(r['plain_bytes'])} MB, transformers per-layer {_mb(r['per_layer_bytes'])} MB; "
                f"cap {_mb(r['cap_bytes'])} MB ({'set_per_process_memory_fraction' if r['enforced'] else 'not enforced: no CUDA'}).", ""]
        if r.get("planned"):
            out.append(f"Planned in {r['plan_s']:.1f} s ({r['solver']}, {r['regions']} regions), planning peak "
                       f"{_mb(r.get('planning_peak_bytes'))} MB allocated, {_mb(r.get('planning_reserved_bytes'))} MB "
                       f"reserved; predicted {_mb(r['predicted_peak_bytes'])} MB; trained {r['trained_steps']} steps at "
                       f"{_mb(r['train_peak_bytes'])} MB: within the cap: {'yes' if r['within_cap'] else 'NO'}.")
        else:
            out.append(f"Not planned: {r.get('error')} (planning peak {_mb(r.get('planning_peak_bytes'))} MB allocated, "
                       f"{_mb(r.get('planning_reserved_bytes'))} MB reserved).")
        oom = r.get("first_out_of_memory")
        if oom:
            out.append(f"First refused request: {_mb(oom['request_bytes'])} MB, with {_mb(oom['allocated_bytes'])} MB "
                       f"allocated, {_mb(oom['reserved_bytes'])} MB reserved, {_mb(oom['split_free_bytes'])} MB of it "
                       "free in split blocks.")
    fr = secs.get("frontier", {}).get("rows", [])
    points = [r for r in fr if r.get("kind") == "point"]
    race_row = next((r for r in fr if r.get("kind") == "race"), None)
    if points:
        eager = next((r for r in fr if r.get("kind") == "eager"), {})
        out += ["", "## Frontier: ours at each of transformers' points", "",
                f"Llama {eager.get('shape')}, {eager.get('parameters', 0) / 1e9:.2f} B parameters; eager step "
                f"{race_row['eager_ms']:.1f} ms (median of {race_row['rounds']}), peak {_mb(eager.get('peak_bytes'))} MB. "
                "Overhead: median step over the eager model's median, minus one; CUDA events, interleaved.", "",
                "| their point | their peak MB | their overhead | twin | ours peak MB | predicted MB | ours overhead "
                "| ratio | fits | grads bitwise | plan s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for p in points:
            if "infeasible" in p:
                out.append(f"| {p['contender']} | {_mb(p['contender_peak_bytes'])} | {_pct(p['contender_overhead'])} "
                           f"| {_pct(p['twin_overhead'])} | infeasible: {p['infeasible']} | | | | | | |")
                continue
            ratio = "-" if p.get("ratio") is None else f"{p['ratio']:.2f}x"
            out.append(f"| {p['contender']} | {_mb(p['contender_peak_bytes'])} | {_pct(p['contender_overhead'])} "
                       f"| {_pct(p['twin_overhead'])} | {_mb(p['ours_peak_bytes'])} | {_mb(p['predicted_peak_bytes'])} "
                       f"| {_pct(p.get('ours_overhead'))} | {ratio} | {'yes' if p.get('fits') else 'NO'} "
                       f"| {'yes' if p['grads_bitwise'] else 'no (' + format(p['max_abs_grad_diff'], '.1e') + ')'} "
                       f"| {p['plan_s']:.0f} |")
    zoo = [r for r in secs.get("zoo", {}).get("rows", []) if "model" in r]
    if zoo:
        out += ["", "## Zoo on CUDA at 50 % of activation memory (solver auto)", "",
                "fp32 under `torch.use_deterministic_algorithms(True)`; bf16 under `torch.autocast`. Error: (predicted - "
                "`max_memory_allocated` peak) / measured. A model marked (in parts) does not capture whole and is "
                "planned as `optimize()` plans it then, in captured pieces around eager code: an upper bound.", "",
                "| model | precision | budget KB | predicted KB | measured KB | error | within | exact | run |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in zoo:
            run = r.get("date", "")
            if r.get("failed") or r.get("skipped"):
                out.append(f"| {r['model']} | {r['precision']} | {r.get('failed') or r.get('skipped')} | | | | | | {run} |")
                continue
            exact = "yes" if r["exact"] else f"no ({r['max_abs_grad_diff']:.1e})"
            name = r["model"] + (" (in parts)" if r.get("partial") else "")
            out.append(f"| {name} | {r['precision']} | {r['budget_bytes'] / 1e3:,.1f} | {r['predicted_bytes'] / 1e3:,.1f} "
                       f"| {r['measured_bytes'] / 1e3:,.1f} | {_pct(r['prediction_error'])} "
                       f"| {'yes' if r['within_budget'] else 'NO'} | {exact} | {run} |")
        split = [r for r in zoo if r.get("phases")]
        if split:
            out += ["", "Where a peak parts from its prediction (under it, or over by more than 1 %), the same plan "
                    "measured again phase by phase: the allocator's peak in the forward (the loss included) and in "
                    "the backward, against the simulator's for that phase, KB.", "",
                    "| model | precision | forward measured | forward predicted | backward measured | backward predicted |",
                    "|---|---|---|---|---|---|"]
            for r in split:
                ph = r["phases"]
                out.append(f"| {r['model']} | {r['precision']} | {ph['forward_measured_bytes'] / 1e3:,.1f} "
                           f"| {ph['forward_predicted_bytes'] / 1e3:,.1f} | {ph['backward_measured_bytes'] / 1e3:,.1f} "
                           f"| {ph['backward_predicted_bytes'] / 1e3:,.1f} |")
    tests = secs.get("tests", {}).get("rows", [])
    if tests:
        out += ["", "## CUDA tests", "", f"`pytest -m cuda` over {', '.join(tests[0]['files'])}: {tests[0]['summary']}"]
    comp = [r for r in secs.get("compile", {}).get("rows", []) if "shape" in r]
    if comp:
        out += ["", "## compile=True against compile@0.5", ""]
        for r in comp:
            asked = f" (lowering {r['lowering_asked']})" if r.get("lowering_asked") else ""
            out.append(f"- compile@0.5 peak {_mb(r['compile_at_0.5_peak_bytes'])} MB; ours{asked}: "
                       + (f"{_mb(r['ours_peak_bytes'])} MB ({r['lowering']} lowering, planned in {r['plan_s']:.0f} s), "
                          f"step {r['ratio']:.3f}x compile@0.5's (medians {r['medians_ms']})."
                          if r.get("planned") and "ratio" in r else f"{r.get('error', 'not raced')}."))
    off = secs.get("offload", {}).get("rows", [])
    setup = next((r for r in off if r.get("kind") == "setup"), None)
    if setup:
        out += ["", "## Offload against recompute-only", "",
                f"Llama {setup['shape']}; per-layer checkpointing's peak {_mb(setup['per_layer_peak_bytes'])} MB; host "
                f"copies {setup['d2h_bytes_per_s'] / 1e9:.1f} GB/s down, {setup['h2d_bytes_per_s'] / 1e9:.1f} GB/s up "
                f"({setup['bandwidth_source']}). Step: median, CUDA events, interleaved.", ""]
        floors = next((r for r in off if r.get("kind") == "floors"), None)
        if floors:
            out += [f"Lowest budget each fits: recompute only {_mb(floors.get('recompute_floor_bytes'))} MB, with "
                    f"offload {_mb(floors.get('offload_floor_bytes'))} MB.", ""]
        raced = next((r for r in off if r.get("kind") == "race"), {})
        hf_ms = raced.get("medians_ms", {}).get("hf offload (every layer)")
        step = (f", step {hf_ms:.1f} ms ({hf_ms / raced['eager_ms'] - 1:+.1%} over eager)"
                if hf_ms and raced.get("eager_ms") else "")
        out += [f"transformers offload (every layer, `save_on_cpu`): {r.get('missing') or _mb(r.get('peak_bytes')) + ' MB' + step}"
                for r in off if r.get("kind") == "contender"] + [""]
        out += ["| budget | x per-layer | plan | peak MB | predicted MB | fits | offloaded | step ms | predicted ms "
                "| grads bitwise | plan s |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        timed = {(r.get("point", r.get("fraction")), r["plan"]) for r in off if r.get("kind") == "point" and "plan" in r}
        # a point planned but never raced (the section ran out of time) still shows what it planned
        shown = [r for r in off if "plan" in r and (r.get("kind") == "point" or (
            r.get("kind") == "planned" and (r.get("point", r.get("fraction")), r["plan"]) not in timed))]
        for r in shown:
            where = f"| {r.get('point', '-')} | {r['fraction']}x | {r['plan']} "
            if "infeasible" in r:
                out.append(where + f"| {r['infeasible']} | | | | | | | |")
                continue
            step = f"{r['step_ms']:.1f}" if "step_ms" in r else "not raced"
            out.append(where + f"| {_mb(r['peak_bytes'])} | {_mb(r['predicted_peak_bytes'])} "
                       f"| {'yes' if r['fits'] else 'NO'} | {r['offloaded']} ({_mb(r['offloaded_bytes'])} MB) "
                       f"| {step} | {r['predicted_step_s'] * 1e3:.1f} | {'yes' if r['grads_bitwise'] else 'no'} "
                       f"| {r.get('plan_s', 0):.0f} |")
    auto = [r for r in secs.get("autocast", {}).get("rows", []) if "model" in r]
    if auto:
        out += ["", "## bf16 autocast: the peak measured three ways", "",
                "Error: (predicted - measured) / measured. Caller thread: `torch.autograd.set_multithreading_enabled(False)`, "
                "against the prediction with the casts held through the step (cache held); "
                "early stop off: `torch.utils.checkpoint.set_checkpoint_early_stop(False)`.", "",
                "| model | regions | predicted KB | cache held KB | weight casts KB | measured KB | caller thread KB | early stop off KB |",
                "|---|---|---|---|---|---|---|---|"]
        for r in auto:
            held = r.get("predicted_held_bytes", r["predicted_bytes"])  # rows from before the casts were placed
            cells = [f"{r[k] / 1e3:,.1f} ({(want - r[k]) / r[k] * 100:+.1f} %)"
                     for k, want in (("default_bytes", r["predicted_bytes"]), ("caller_thread_bytes", held),
                                     ("early_stop_off_bytes", r["predicted_bytes"]))]
            out.append(f"| {r['model']} | {r['regions']} | {r['predicted_bytes'] / 1e3:,.1f} | {held / 1e3:,.1f} "
                       f"| {r['cast_bytes'] / 1e3:,.1f} | " + " | ".join(cells) + " |")
    out += gpu_conformance.markdown(secs.get("conformance", {}).get("rows", []))
    errors = [(n, r) for n, sec in secs.items() for r in sec.get("rows", []) if "section_error" in r]
    if errors:
        out += ["", "## Errors", ""] + [f"- {n}: {r['section_error']}" for n, r in errors]
    return "\n".join(out) + "\n"


ROW_KEYS = {"zoo": ("model", "precision"), "autocast": ("model",), "conformance": ("model", "path")}
"""Sections whose rows each stand alone (one model each): merged row by row, so that a run that reached a few
models keeps the earlier runs' figures for the others."""


def _merged_rows(earlier: list[dict], later: list[dict], key: tuple[str, ...], date: str) -> list[dict]:
    """`earlier`'s rows with `later`'s in their place (each dated): a model a later run did not reach keeps
    its earlier figures; one it reached takes the later figures, whatever they are."""
    rows = {tuple(r.get(k) for k in key): r for r in earlier}
    for r in later:
        k = tuple(r.get(k) for k in key)
        if r.get("skipped") and k in rows:
            continue
        rows[k] = {"date": date, **r}
    return list(rows.values())


def merge_runs(runs: list[Path], out: Path, notes: list[str]) -> Path:
    """Several device runs' results as one: each section from the last run that has it (the zoo's and autocast's
    rows model by model), each keeping its date.

    A device lends a few minutes per command, so the sections of one set of figures often come from several
    commands, each writing its own gpu-<kind>.json."""
    loaded = [json.loads(p.read_text()) for p in runs]
    merged: dict[str, Any] = {"command": "; ".join(r["command"] for r in loaded), "date": loaded[-1]["date"],
                              "dry": any(r.get("dry") for r in loaded), "seconds": sum(r.get("seconds", 0) for r in loaded),
                              "limits_s": loaded[-1].get("limits_s", {}), "sections": {}, "notes": notes}
    for r in loaded:
        for name, sec in r["sections"].items():
            if name == "env" and "env" in merged["sections"] and not sec.get("rows"):
                continue
            date = sec.get("date", r["date"])
            earlier = merged["sections"].get(name)
            if name in ROW_KEYS and earlier is not None:
                sec = {**sec, "rows": _merged_rows(earlier["rows"], sec["rows"], ROW_KEYS[name], date)}
            else:
                sec = {**sec, "rows": [{"date": date, **row} for row in sec.get("rows", [])]}
            merged["sections"][name] = {**sec, "date": date}
    kind = kind_of(merged["sections"].get("env", {}).get("rows", []), merged["dry"])
    write_files(out, {f"gpu-{kind}.json": json.dumps(merged, indent=1, default=str), f"gpu-{kind}.md": markdown(merged)})
    return out / f"gpu-{kind}.md"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.splitlines()[0])
    ap.add_argument("--dry", action="store_true", help="tiny shapes on the CPU: every code path, no figures")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated, of {', '.join(SECTIONS)}")
    ap.add_argument("--out", default=None, help="folder for gpu-<kind>.{json,md} (default benchmarks/results)")
    ap.add_argument("--limits", default="", help="seconds per section, e.g. frontier=200,compile=120")
    ap.add_argument("--zoo-models", default="", help="comma-separated zoo models (default: every one)")
    ap.add_argument("--merge", nargs="+", type=Path, metavar="JSON",
                    help="no run: merge earlier runs' gpu-<kind>.json into --out, later runs' sections winning")
    ap.add_argument("--note", action="append", default=[], help="with --merge: a line said of the merged runs")
    ap.add_argument("--child", choices=SECTIONS, help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        return child(a.child, Path(a.rows), a.dry)
    if a.merge:
        print(merge_runs(a.merge, Path(a.out) if a.out else RESULTS, a.note).read_text())
        return 0
    sections = [s for s in a.sections.split(",") if s]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        ap.error(f"unknown section {bad}; choose from {', '.join(SECTIONS)}")
    if not a.dry:
        import torch

        if not torch.cuda.is_available():
            print("benchmarks.gpu: no CUDA device here; run with --dry for the CPU rehearsal", file=sys.stderr)
            return 2
    out = Path(a.out) if a.out else (Path(tempfile.mkdtemp(prefix="gpu-dry-")) if a.dry else RESULTS)
    out_dir(out)
    limits = dict(DRY_LIMITS if a.dry else LIMITS)
    try:
        limits.update({k: float(v) for k, v in (x.split("=") for x in a.limits.split(",") if x)})
    except ValueError:
        ap.error("--limits: give section=seconds pairs, e.g. frontier=200,compile=120")
    command = "python -m benchmarks.gpu " + " ".join(argv if argv is not None else sys.argv[1:])
    results: dict[str, Any] = {"command": command.strip(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "dry": a.dry, "limits_s": limits, "sections": {}}
    t0 = time.perf_counter()
    if "env" not in sections:
        sections.insert(0, "env")
    with tempfile.TemporaryDirectory() as work:
        for section in sections:
            results["sections"][section] = sec = run_section(section, a.dry, limits[section], Path(work), a.zoo_models)
            results["seconds"] = time.perf_counter() - t0
            kind = kind_of(results["sections"]["env"]["rows"], a.dry)
            earlier = out / f"gpu-{kind}.json"
            if section == "env" and earlier.exists() and set(sections) != set(SECTIONS):
                # a run of some sections keeps the others' figures from the last run on this kind (each dated)
                kept = json.loads(earlier.read_text()).get("sections", {})
                results["sections"] = {**{k: v for k, v in kept.items() if k not in sections}, "env": sec}
            print(f"[{results['seconds']:5.0f} s] {section}: {sec['status']} ({sec['seconds']:.0f} s)", flush=True)
            if sec["status"] != "ok":
                print("  " + "\n  ".join(sec["log_tail"]), flush=True)
            write_files(out, {f"gpu-{kind}.json": json.dumps(results, indent=1, default=str),
                              f"gpu-{kind}.md": markdown(results)})
    print((out / f"gpu-{kind}.md").read_text())
    return 0 if all(s["status"] == "ok" for s in results["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Measuring the race on the device: each candidate's peak on the allocator meter and its steps, timed in
interleaved rounds beside the plain graph's step (the order rotating per round)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ...profile.loss import default_loss
from ...profile.memory import measure_step_peaks
from .rules import LEAVE_AFTER, Candidate, Measure, Measured, Racing

__all__ = ["device_measure"]


def device_measure(
    model: torch.nn.Module, graph: torch.fx.GraphModule, args: tuple, kwargs: dict, device: torch.device,
    build: Callable[[tuple, tuple, tuple], torch.nn.Module], baseline: tuple | None = ((), (), ()),
) -> Measure:
    """The measurement on the device: `build(regions, saved, modules)` gives a candidate's module (the
    rewriter, or the model with whole `modules` checkpointed); each round also times the `baseline`
    plan's step, `build(*baseline)` (the plain graph; or where the plain step was never run, the model's
    own code checkpointed per block; None: no baseline, where that step would not fit the budget either);
    its peak is one step on the allocator meter, its times those of interleaved timed steps. The
    caller restores the model's state (gradients, buffers, RNG)."""
    params = list(model.parameters())
    state = params + list(model.buffers())
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def step(module: torch.nn.Module) -> None:
        for p in params:
            p.grad = None
        default_loss(module(*args, **kwargs)).backward()

    def peak(module: torch.nn.Module) -> int:
        return measure_step_peaks(module, args, kwargs, params, state, default_loss, device)[0].allocator

    def timed(module: torch.nn.Module) -> float:
        sync()
        t0 = time.perf_counter()
        step(module)
        sync()
        return time.perf_counter() - t0

    def measure(cands: Sequence[Candidate], rounds: int, racing: Racing | None = None) -> tuple[list[Measured], list[float]]:
        built = [build(c.regions, c.saved, c.modules, *((c.offloaded,) if c.offloaded else ())) for c in cands]
        peaks: list[int] = []
        failed: dict[int, str] = {}
        for k, m in enumerate(built):
            # A candidate whose step raises (a whole module checkpointed by torch whose input a later op
            # writes in place) is dropped here: autotune only ever chooses among steps that run.
            try:
                peaks.append(peak(m))
            except Exception as e:  # noqa: BLE001
                peaks.append(0)
                failed[k] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        live = [k for k in range(len(built)) if k not in failed]
        modules = [built[k] for k in live]
        everyone = [*modules]
        if baseline is not None:
            everyone.insert(0, build(*baseline))
            step(everyone[0])  # warm-up
        first = 0 if baseline is None else 1  # index of the first candidate in `everyone`
        times: list[list[float]] = [[] for _ in modules]
        base: list[float] = []
        racing_now = set(range(first, len(everyone)))  # positions in `everyone` of the candidates still timed

        def so_far() -> list[Measured]:
            timed_of = dict(zip(live, times))
            return [Measured(peaks[k], tuple(timed_of.get(k, ())), failed.get(k)) for k in range(len(built))]

        for r in range(rounds):
            order = [(r + j) % len(everyone) for j in range(len(everyone))]  # the order rotates per round
            for k in order:
                if k < first or k in racing_now:
                    t = timed(everyone[k])
                    (base if k < first else times[k - first]).append(t)
            if racing is not None and r + 1 >= LEAVE_AFTER:
                staying = racing(so_far(), base)
                racing_now = {first + live.index(k) for k in staying if k in live}
                if len(racing_now) <= 1:
                    break  # the race is decided: one plan left, or none that fits
        for p in params:
            p.grad = None
        return so_far(), base

    return measure

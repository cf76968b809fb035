"""Measuring a compiled training step: its peak (resident state + the allocator's peak), for
choosing between compiled modules interleaved step times, and the summary rows of a compiled plan."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..errors import InputError
from ..model_state import ModelState
from ..profile.memory import AllocatorMeter

__all__ = ["interleaved_step_times", "measure_compiled_step"]


def _loss(output: Any) -> torch.Tensor:
    from ..profile.loss import default_loss

    return default_loss(output)


def _resident_bytes(model: torch.nn.Module, args: tuple, kwargs: dict) -> int:
    """Bytes of the unique storages of parameters, buffers and input tensors."""
    seen: dict[int, int] = {}
    tensors = [*model.parameters(), *model.buffers(), *pytree.tree_leaves((args, kwargs))]
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and not t.is_meta:
            st = t.untyped_storage()
            seen[st._cdata] = st.nbytes()
    return sum(seen.values())


def measure_compiled_step(
    module: torch.nn.Module,
    model: torch.nn.Module,
    args: tuple,
    kwargs: dict,
    *,
    device: torch.device | str = "cpu",
    extra_bytes: int = 0,
    loss_fn: Callable[[Any], torch.Tensor] = _loss,
    warmup: int = 1,
) -> int:
    """Peak bytes of one training step of a compiled module: resident state + the allocator's peak.

    Runs `warmup` steps first (the compile happens there, outside the meter); `model` keeps its
    buffers, grads, modes and RNG (ModelState). `extra_bytes`: resident state the step does not
    allocate (optimizer state). A meter that cannot read the allocator raises InputError.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    with ModelState(model).preserved():
        for _ in range(warmup):
            loss_fn(module(*args, **kwargs)).backward()
        for p in params:
            p.grad = None
        resident = _resident_bytes(model, args, kwargs)
        meter = AllocatorMeter(device)
        if not meter.available:
            raise InputError(f"compile: the allocator of device {device} cannot be read here (a profiler running?)")
        with meter:
            out = module(*args, **kwargs)
            loss_fn(out).backward()
            del out
        for p in params:
            p.grad = None
    return int(resident + meter.peak + extra_bytes)


def interleaved_step_times(modules: dict[str, torch.nn.Module], model: torch.nn.Module, args: tuple, kwargs: dict, *,
                           loss_fn: Callable[[Any], torch.Tensor] = _loss, repeats: int = 7) -> dict[str, list[float]]:
    """Seconds of `repeats` training steps of each module, taken in turn (order reversed every round), after one
    warm-up step each: load on the machine hits them alike. `model` keeps its state (ModelState)."""
    params = [p for p in model.parameters() if p.requires_grad]
    names = list(modules)
    times: dict[str, list[float]] = {n: [] for n in names}
    sync = torch.cuda.synchronize if _device_of(model).type == "cuda" else (lambda: None)
    with ModelState(model).preserved():
        for r in range(-1, repeats):
            for n in (names if r % 2 == 0 else names[::-1]):
                for p in params:
                    p.grad = None
                sync()
                t0 = time.perf_counter()
                loss_fn(modules[n](*args, **kwargs)).backward()
                sync()
                if r >= 0:
                    times[n].append(time.perf_counter() - t0)
        for p in params:
            p.grad = None
    return times


def _device_of(model: torch.nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def _quartiles(xs: list[float]) -> tuple[float, float, float]:
    """First quartile, median, third quartile."""
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]

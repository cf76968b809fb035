"""Bytes before seconds: the byte side of a profile, and measured profiles reused within a process.

Timing a model is most of what planning costs (each node run several times, the step calibrated),
and none of it decides whether a budget can be met: feasibility is decided from bytes alone
(planner/choose/budget.py). So when a budget is given, `Planner` first profiles one recorded step with
FLOP times (`bytes_config`: the same recorded run, allocator readings included, that the timed
profile records, without its timed runs), refuses an infeasible budget from it, and times the model
only for a budget that can be met.

Measured times follow the machine's load, and the timing store heals a time measured clearly lower
later (planner/profile/timing_store.py). Two plans of one model in one process must not be priced on
two different profiles (a tighter budget would look cheaper because the second call timed a quieter
machine), so a measured profile is kept for the process (`ProfileMemo`), keyed by the captured graph,
the values of every parameter, buffer and input tensor, and the profile settings, and
the next `Planner` of the same model and inputs reads it instead of timing again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ..capture.trace import Capture
from ..progress import logger, stage
from .graph import CostGraph
from .memory import collections_of_new_objects
from .profiler import ProfileConfig, fake_profile, profile
from .timing_store import store_dir

__all__ = ["bytes_config", "needs_bytes_pass", "ProfileMemo", "PROFILES", "profile_for_planning", "StepTimes"]

StepTimes = Callable[..., CostGraph]
"""The step timings and calibration `profile_for_planning` is handed: (cost, model, graph, args, kwargs, *,
timing_store) -> the profile with its step figures."""


def bytes_config(config: ProfileConfig) -> ProfileConfig:
    """The profile settings of the byte pass: one recorded step, FLOP times, no timing and no call costs."""
    return dataclasses.replace(config, flop_times=True, count_flops=True, overheads=False, anchor=False, timing_store=False)


def needs_bytes_pass(config: ProfileConfig) -> bool:
    """A byte pass first only where the profile times the model (FLOP-timed and fake profiles are that pass)."""
    return not (config.meta or config.flop_times)


def _tensor_key(t: torch.Tensor) -> tuple:
    # identity and in-place version: an optimizer step or a load_state_dict bumps the version
    return (id(t), t._version, tuple(t.shape), str(t.dtype), str(t.device))


def _values_key(tree: Any) -> str:
    """Tensors by value (token ids and masks decide which path attention takes; weights, an MoE's routing)."""
    from torch.utils import _pytree as pytree

    h = hashlib.sha256()
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach()
            h.update(f"{tuple(t.shape)}{t.dtype}{t.device}".encode())
            try:
                h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
            except (RuntimeError, TypeError):  # not on the CPU, or not strided: identity and version
                h.update(repr(_tensor_key(t)).encode())
        else:
            h.update(repr(leaf).encode())
    return h.hexdigest()


def ambient_key() -> tuple:
    """The process state that changes what a step saves without changing its graph: autocast (on and its
    dtype, per device type), grad mode, the default dtype and deterministic algorithms. A symbolic_trace
    graph runs under whatever autocast its caller set, so a bf16 profile must never serve an fp32 call."""
    casts = []
    for device_type in ("cpu", "cuda"):
        try:
            casts.append((device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)))
        except (RuntimeError, TypeError, AttributeError):  # a torch without the per-device query
            casts.append((device_type, None, None))
    return (tuple(casts), torch.is_grad_enabled(), torch.get_default_dtype(),
            torch.are_deterministic_algorithms_enabled())


class ProfileMemo:
    """Measured profiles of this process, newest last (at most `size`)."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._items: OrderedDict[tuple, CostGraph] = OrderedDict()

    def key(self, model: torch.nn.Module, cap: Any, config: ProfileConfig, extra: tuple = ()) -> tuple | None:
        """The key of a measured profile of `cap`, or None when none is kept (FLOP times, fake tensors,
        or the timing store off: `CKPT_PLANNER_TIMINGS=off` asks for every profile measured afresh)."""
        folder = store_dir()
        if not needs_bytes_pass(config) or not config.timing_store or folder is None:
            return None
        state = _values_key(list(model.parameters()) + list(model.buffers()))
        return (cap.graph_module.code, cap.method, state, _values_key((cap.args, cap.kwargs)), ambient_key(),
                repr(config), str(folder), extra)

    def get(self, key: tuple | None) -> CostGraph | None:
        if key is None or key not in self._items:
            return None
        self._items.move_to_end(key)
        return self._items[key]

    def put(self, key: tuple | None, cost: CostGraph) -> None:
        if key is None:
            return
        self._items[key] = cost
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def clear(self) -> None:
        self._items.clear()


PROFILES = ProfileMemo()
"""The process's measured profiles (Planner reads and fills it)."""


@collections_of_new_objects()  # its allocator windows each collect garbage first
def profile_for_planning(model: torch.nn.Module, cap: Capture, config: ProfileConfig,
                         check_bytes: Callable[[CostGraph], None] | None = None,
                         plain_fits: Callable[[CostGraph], bool] | None = None,
                         step_times: StepTimes | None = None) -> CostGraph:
    """The profile a Planner plans on.

    `plain_fits(cost)`: whether the plain step fits the budget, judged on bytes. Where it does not (and
    `config.bounded` leaves the choice to the planner), the graph is profiled a stage at a time
    (profile/stagewise.py): bytes on fake tensors, each stage's own step on real ones, no plain step, so
    profiling needs one stage's step, not the step it is asked to shrink (its calibration, the step
    checkpointed per block, runs where the device has room for it).

    Either way: reused when this process measured the same graph, weights and inputs; where the profile
    times the model, the bytes pass first (`check_bytes(cost)` refuses an infeasible budget before any
    timing: one untimed step, a stage at a time where the plain step does not fit), then the timed
    profile, and the step's times: `step_times(cost, model, graph, args, kwargs, timing_store=...)`, the
    eager and graph steps (a stage-wise profile's: estimated, no plain step run) and the calibration on
    steps checkpointed per block (choose/race/calibration.py `with_step_times`, handed in by the spine: it lowers a plan, which
    the profile stage does not); None: the profile's own figures, no step timed."""
    fake = None
    timed = (step_times is not None,)  # a profile without its step figures never serves a call that times them
    with contextlib.ExitStack() as bytes_stage:
        if config.bounded is None:
            bounded = False
            if plain_fits is not None and not config.meta:
                known = next((c for c in (PROFILES.get(PROFILES.key(model, cap, dataclasses.replace(config, bounded=b), timed))
                                          for b in (False, True)) if c is not None), None)
                if known is not None:  # this process profiled it: its bytes decide
                    bounded = not plain_fits(known)
                else:
                    bytes_stage.enter_context(stage("bytes", "fake tensors first: does the plain step fit the budget?"))
                    fake = fake_profile(cap, config)
                    bounded = not plain_fits(fake[0])
            config = dataclasses.replace(config, bounded=bounded)
        memo = PROFILES.key(model, cap, config, timed)
        cost = PROFILES.get(memo)
        if cost is not None:
            bytes_stage.close()
            with stage("profile", "reused: this process measured the same graph, weights and inputs"):
                return cost
        if check_bytes is not None and needs_bytes_pass(config):
            if fake is None:
                bytes_stage.enter_context(stage("bytes", "one recorded step, no timing: can the budget be met?"))
            check_bytes(profile(cap, bytes_config(config), fake=fake))
    whole = not (config.bounded and not config.meta)
    what = "meta tensors" if config.meta else "running each node" if whole else (
        "a stage at a time: bytes on fake tensors, each stage's own step on real ones")
    with stage("profile", what):
        cost = profile(cap, config, fake=fake)
    logger.info("profile: %d nodes%s, %.1f MB saved for backward, forward %.1f ms (%s)", len(cost.nodes),
                f" in {len(cost.stages)} stages" if cost.stages else "", cost.total_saved_bytes / 1e6,
                cost.total_time * 1e3, cost.time_source)
    if step_times is not None and (whole or cost.stages) and config.overheads and cost.time_source != "flops":
        with stage("step times", "the calibration's checkpointed steps and the forward under no_grad" if cost.stages
                   else "the eager step, the captured graph and the calibration's steps"):  # FLOP times: no step
            cost = step_times(cost, model, cap.graph_module, cap.args, cap.kwargs, timing_store=config.timing_store)
    PROFILES.put(memo, cost)
    return cost

"""What a `torch.distributed.pipelining` schedule asks of each stage, read from the schedule itself.

`in_flight` counts, from the schedule's own action order (`pipeline_order`), the most microbatches
whose forward has run and whose backward has not, on one stage at once: all of them under GPipe,
`p - s` on stage `s` of `p` under 1F1B. `pipeline_step_s` replays the same orders with each stage's
forward and backward times and the dependencies between stages (a forward after the previous stage's,
a backward after the next stage's), so the step includes the schedule's bubbles.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from ..errors import InputError

__all__ = ["schedule_orders", "in_flight", "pipeline_step_s"]


def _kinds(action: Any) -> tuple[str, int, int]:
    """('F' | 'B' | '', stage index, microbatch) of one schedule action; '' for actions that hold no
    activations (gradient reduction, communication, idle steps)."""
    if action is None:
        return "", -1, -1
    kind = str(getattr(action.computation_type, "value", action.computation_type))
    if kind == "F":
        return "F", action.stage_index, action.microbatch_index
    if kind in ("B", "I"):  # full backward, or the input-gradient half that frees the saved tensors
        return "B", action.stage_index, action.microbatch_index
    return "", -1, -1


def schedule_orders(schedule: type, n_stages: int, n_microbatches: int) -> dict[int, list[tuple[str, int, int]]]:
    """Each rank's forwards and backwards, ('F' | 'B', stage, microbatch), in the order the schedule class
    builds them (one stage per rank).

    The schedule is built on a stand-in for its stage (it reads only the stage count to order its
    actions), so no process group is needed."""
    if n_stages < 1 or n_microbatches < 1:
        raise InputError(f"pipeline: {n_stages} stages and {n_microbatches} microbatches; both must be at least 1")
    stand_in = SimpleNamespace(num_stages=n_stages, stage_index=0, group_rank=0, group_size=n_stages)
    try:
        built = schedule(stand_in, n_microbatches, loss_fn=lambda out, target: out)
    except (TypeError, AttributeError) as e:
        raise InputError(f"schedule: {getattr(schedule, '__name__', schedule)} is not a one-stage-per-rank "
                         f"schedule of torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B): {e}") from None
    except ValueError as e:  # the schedule's own check, e.g. 1F1B with fewer microbatches than stages
        raise InputError(f"schedule: {e}".replace("\\\n", "").replace("  ", " ")) from None
    order = getattr(built, "pipeline_order", None)
    if not order:
        raise InputError(f"schedule: {type(built).__name__} exposes no action order (pipeline_order) to count from")
    # Each rank runs its forwards, and its backwards, in microbatch order; the i-th forward (backward) in
    # a rank's list is microbatch i. torch 2.13's 1F1B order numbers the last stage's first forward 1,
    # not 0 (its runtime runs 0 first), so the numbers are taken from the position, not the action.
    out: dict[int, list[tuple[str, int, int]]] = {}
    for rank, actions in order.items():
        seen = {"F": 0, "B": 0}
        steps = []
        for action in actions:
            kind, index, _ = _kinds(action)
            if kind:
                steps.append((kind, index, seen[kind]))
                seen[kind] += 1
        out[rank] = steps
    return out


def in_flight(schedule: type, n_stages: int, n_microbatches: int, stage: int) -> int:
    """The most microbatches stage `stage` holds forwarded and not yet backwarded, under `schedule`."""
    if not 0 <= stage < n_stages:
        raise InputError(f"stage: {stage} is not in [0, {n_stages})")
    held = most = 0
    for kind, index, _ in schedule_orders(schedule, n_stages, n_microbatches)[stage]:
        if index == stage:
            held += 1 if kind == "F" else -1
            most = max(most, held)
    return most


def pipeline_step_s(schedule: type, n_microbatches: int, forward_s: list[float], backward_s: list[float]) -> float:
    """Seconds of one pipeline step: every rank runs its actions in the schedule's order, each as soon as
    its rank is free and its input has arrived (communication time not counted). # seconds"""
    p = len(forward_s)
    orders = schedule_orders(schedule, p, n_microbatches)
    done: dict[tuple[str, int, int], float] = {}
    free = [0.0] * p
    pos = [0] * p
    while any(pos[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                kind, s, mb = orders[r][pos[r]]
                needs = [("F", s - 1, mb)] if kind == "F" and s > 0 else []
                if kind == "B":
                    needs = [("F", s, mb)] + ([("B", s + 1, mb)] if s < p - 1 else [])
                if any(n not in done for n in needs):
                    break
                start = max([free[r]] + [done[n] for n in needs])
                free[r] = done[(kind, s, mb)] = start + (forward_s[s] if kind == "F" else backward_s[s])
                pos[r] += 1
                progressed = True
        if not progressed:
            raise InputError(f"schedule: {schedule.__name__}'s action order waits on itself")
    return max(free)

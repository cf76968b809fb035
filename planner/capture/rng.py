"""Which graph nodes draw random numbers: the regions that must save the RNG state.

A checkpointed region replays its forward in backward; only a region that draws
random numbers (dropout, sampling) needs the generator's state saved at its
start so the replay draws the same. That state is memory held from the region's
forward to its backward (CPU: `torch.get_rng_state()`, 5,056 bytes), which the
profile records per node (`rng_state_bytes`) and the rewrite saves only where
needed.

What a node does decides, not what it is called: the profile's recording run
(real or fake tensors) passes every aten op through `SeededOps`, which marks
each fx node that dispatched an op tagged `torch.Tag.nondeterministic_seeded`
(dropout in every form, SDPA's own dropout, bernoulli, rand*, normal_,
multinomial, randperm, rrelu, a custom op that draws). A seeded op given
`dropout_p=0` draws nothing and does not count. On real tensors the recording
run also compares the generators' states before and after each node
(`generator_states`): a custom op or extension kernel that draws without the
tag moves them. The mark lives in the node's
meta (`RANDOM_META`), so the rewrite of that graph reads what the profile saw.
A graph no run has marked falls back on names and tags, and unknown code counts
as random: the cost of a wrong "no" is a wrong gradient.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Iterable
from typing import Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "uses_rng", "rng_state_bytes", "SeededOps", "RANDOM_META", "mark_random", "observe_random", "generator_states",
    "moved", "UNREPLAYABLE_META",
]

RANDOM_META = "ckpt_planner_random"
"""fx node meta key: True when the node dispatched a seeded op in a recorded run, False when it did not."""

UNREPLAYABLE_META = "ckpt_planner_unreplayable"
"""fx node meta key: True when the node dispatched a seeded op that writes its draw into an argument it
does not return (`rrelu_with_noise` fills `noise` and saves it): under torch.utils.checkpoint its
backward reads a buffer the recompute never filled (gradients of 1e37 seen on torch 2.13, generator
state preserved or not), so such a node is not recomputed."""

_RANDOM_NAMES = ("rand", "bernoulli", "normal", "multinomial", "poisson", "dropout", "rrelu", "gumbel", "fractional")
_RANDOM_METHODS = {"bernoulli_", "random_", "uniform_", "normal_", "exponential_", "cauchy_", "log_normal_", "geometric_"}
_RANDOM_MODULES = (
    torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout, torch.nn.RReLU,
)


def uses_rng(gm: torch.nn.Module, node: fx.Node) -> bool:
    """True when running `node` may draw from a random number generator."""
    seen = node.meta.get(RANDOM_META)
    if seen is not None:
        return bool(seen)
    return _named_random(gm, node)


def _named_random(gm: torch.nn.Module, node: fx.Node) -> bool:
    """The fallback for a graph no run has marked: by tag, module type and name; unknown code is random."""
    target = node.target
    if node.op == "call_method":
        return str(target) in _RANDOM_METHODS
    if node.op == "call_module":
        mod = gm.get_submodule(str(target))
        if isinstance(mod, _RANDOM_MODULES):
            return True
        # torch.nn's own leaf modules other than those draw nothing; unknown modules might
        return not type(mod).__module__.startswith("torch.nn.") or any(
            isinstance(m, _RANDOM_MODULES) for m in mod.modules()
        )
    if node.op != "call_function":
        return False
    if isinstance(target, torch._ops.OpOverload):
        return torch.Tag.nondeterministic_seeded in target.tags
    if isinstance(target, torch._ops.OpOverloadPacket):
        return any(torch.Tag.nondeterministic_seeded in getattr(target, o).tags for o in target.overloads())
    if isinstance(target, torch._ops.HigherOrderOperator):
        return True
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", "") or ""
    if target in vars(operator).values() or module in ("_operator", "operator", "math", "builtins"):
        return False
    if module.startswith("torch") or name in dir(torch):
        # torch's Python functions may draw inside (scaled_dot_product_attention's dropout_p):
        # only those that take no probability and are not named for randomness are taken as not.
        return any(word in name.lower() for word in _RANDOM_NAMES) or _takes_probability(target)
    return True


def _takes_probability(fn: Any) -> bool:
    import inspect

    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin: its documented signature says whether it takes one
        doc = (getattr(fn, "__doc__", None) or "").split("\n\n")[0]
        return any(word in doc for word in ("dropout", "generator"))
    return any(p in params for p in ("dropout_p", "dropout", "p", "generator"))


@functools.cache
def _dropout_index(op: Any) -> int | None:
    schema = getattr(op, "_schema", None)
    if schema is None:
        return None
    return next((i for i, a in enumerate(schema.arguments) if a.name == "dropout_p"), None)


@functools.cache
def writes_draw_aside(func: Any) -> bool:
    """A seeded op with a written argument that is not its output (see UNREPLAYABLE_META)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    returned: set[str] = set()
    for r in schema.returns:
        if r.alias_info is not None:
            returned |= set(r.alias_info.before_set)
    return any(
        a.alias_info is not None and a.alias_info.is_write and not set(a.alias_info.before_set) & returned
        for a in schema.arguments
    )


def draws(func: Any, args: tuple, kwargs: dict | None) -> bool:
    """True when the aten op `func`, called with these arguments, draws random numbers."""
    if torch.Tag.nondeterministic_seeded not in getattr(func, "tags", ()):
        return False
    i = _dropout_index(func)
    if i is None:
        return True
    p = (kwargs or {}).get("dropout_p", args[i] if i < len(args) else 0.0)
    return not (isinstance(p, (int, float)) and p == 0)


class SeededOps(TorchDispatchMode):
    """Records the fx nodes (set `node` to the running node's name) that dispatch an op that draws."""

    def __init__(self) -> None:
        super().__init__()
        self.node: str | None = None
        self.random: set[str] = set()
        self.unreplayable: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.node is not None and draws(func, args, kwargs):
            self.random.add(self.node)
            if writes_draw_aside(func):
                self.unreplayable.add(self.node)
        return func(*args, **(kwargs or {}))


def generator_states() -> list[torch.Tensor]:
    """The CPU generator's state, and each initialized CUDA device's: any draw changes one of them."""
    states = [torch.get_rng_state()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states += [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return states


def moved(before: list[torch.Tensor]) -> bool:
    """True when a generator state differs from `before` (from `generator_states()`)."""
    return any(not torch.equal(a, b) for a, b in zip(before, generator_states()))


def mark_random(gm: fx.GraphModule, random: Iterable[str], unreplayable: Iterable[str] = ()) -> None:
    """Record on every compute node of `gm` whether it drew random numbers in a run, and whether its
    draw cannot be replayed by a recompute (see `SeededOps`)."""
    names, aside = set(random), set(unreplayable)
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method", "call_module"):
            n.meta[RANDOM_META] = n.name in names
            n.meta[UNREPLAYABLE_META] = n.name in aside


def observe_random(gm: fx.GraphModule, flat: list[Any]) -> None:
    """One forward of `gm` on `flat` (no gradients, generator state restored) that marks its random
    nodes, for a graph the profile has not run (a plan rebuilt on a fresh model in the same process).
    A graph that cannot be run this way keeps the fallback on names."""
    if all(RANDOM_META in n.meta for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")):
        return
    mode = SeededOps()

    class _Run(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            mode.node = n.name
            before = generator_states()
            try:
                return super().run_node(n)
            finally:
                mode.node = None
                if moved(before):
                    mode.random.add(n.name)

    from ..model_state import ModelState

    try:
        with ModelState(gm).preserved(), torch.no_grad(), mode:
            _Run(gm).run(*flat, enable_io_processing=False)
    except Exception:  # noqa: BLE001 - the names fallback stays; this run only refines it
        return
    mark_random(gm, mode.random, mode.unreplayable)


def rng_state_bytes(device: torch.device) -> int:
    """Bytes of generator state a random region saves in the memory of `device` (the budget's)."""
    if device.type == "cpu":
        return torch.get_rng_state().nbytes  # bytes; 5,056 for the Mersenne twister
    return 0  # CUDA and other devices: the saved states are CPU tensors, not device memory

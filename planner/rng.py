"""Which graph nodes draw random numbers: the regions that must save the RNG state.

A checkpointed region replays its forward in backward; only a region that draws
random numbers (dropout, sampling) needs the generator's state saved at its
start so the replay draws the same. That state is memory held from the region's
forward to its backward (CPU: `torch.get_rng_state()`, 5,056 bytes), which the
profile records per node (`rng_state_bytes`) and the rewrite saves only where
needed. Unknown code counts as random: the cost of a wrong "no" is a wrong gradient.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

__all__ = ["uses_rng", "rng_state_bytes"]

_RANDOM_NAMES = ("rand", "bernoulli", "normal", "multinomial", "poisson", "dropout", "rrelu", "gumbel", "fractional")
_RANDOM_METHODS = {"bernoulli_", "random_", "uniform_", "normal_", "exponential_", "cauchy_", "log_normal_", "geometric_"}
_RANDOM_MODULES = (
    torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
    torch.nn.FeatureAlphaDropout, torch.nn.RReLU,
)


def uses_rng(gm: torch.nn.Module, node: fx.Node) -> bool:
    """True when running `node` may draw from a random number generator."""
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
        return any(word in name.lower() for word in _RANDOM_NAMES)
    return True


def rng_state_bytes(device: torch.device) -> int:
    """Bytes of generator state a random region saves in the memory of `device` (the budget's)."""
    if device.type == "cpu":
        return torch.get_rng_state().nbytes  # bytes; 5,056 for the Mersenne twister
    return 0  # CUDA and other devices: the saved states are CPU tensors, not device memory

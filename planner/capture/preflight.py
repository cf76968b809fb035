"""Checks that name a bad example input or a model with nothing to plan, instead of a capture error.

* `check_exported_inputs`: a `.pt2` model knows the shapes and dtypes it was
  exported for (its placeholders' fake values); inputs that differ are refused
  before capture, naming the input and the expected shape.
* `explain_failure`: when capture or profiling fails, one forward on fake
  tensors (nothing is computed) tells whether the inputs are at fault; if so the
  error names each input's shape next to the model's own example, if it has one.
* `nothing_to_plan`: a step that saves no activations (a frozen model, a
  forward returning None) has nothing to checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.utils import _pytree as pytree

from ..errors import InputError, NothingToPlanError, UnplannableError

__all__ = ["describe", "check_exported_inputs", "explain_failure", "nothing_to_plan", "refuse_grad_mode"]


def describe(value: Any) -> str:
    """'(64, 32) float32' for a tensor (or fake value); repr-like text for anything else."""
    if isinstance(value, torch.Tensor):
        dims = ", ".join(str(int(d)) if isinstance(d, int) else "*" for d in value.shape)
        return f"({dims}{',' if value.dim() == 1 else ''}) {str(value.dtype).removeprefix('torch.')}"
    return type(value).__name__


def _leaves(inputs: Any) -> list[Any]:
    if isinstance(inputs, dict):
        return pytree.tree_leaves(((), inputs))
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    return pytree.tree_leaves((tuple(inputs), {}))


def _label(i: int, texts: Sequence[str] | None, name: str | None) -> str:
    where = f"--input {texts[i]!r}" if texts and i < len(texts) else f"input {i + 1}"
    return f"{where} ({name})" if name else where


def check_exported_inputs(model: torch.nn.Module, inputs: Any, texts: Sequence[str] | None = None) -> None:
    """For a `.pt2` model (`ep.module()`): the inputs must match the exported shapes (symbolic dims free) and dtypes."""
    graph = getattr(model, "graph", None)
    if graph is None:
        return
    holders = [n for n in graph.nodes if n.op == "placeholder"]
    wants = [n.meta.get("val") for n in holders]
    if not all(isinstance(w, torch.Tensor) for w in wants):
        return
    got = _leaves(inputs)
    if len(got) != len(wants):
        expected = ", ".join(describe(w) for w in wants)
        raise InputError(f"inputs: the .pt2 model takes {len(wants)} tensor input(s), {expected}; got {len(got)}")
    for i, (node, want, have) in enumerate(zip(holders, wants, got)):
        if not isinstance(have, torch.Tensor):
            raise InputError(f"{_label(i, texts, node.name)}: expected a tensor of shape {describe(want)}, got {describe(have)}")
        static_ok = len(want.shape) == have.dim() and all(
            not isinstance(w, int) or w == h for w, h in zip(want.shape, have.shape)
        )
        if not static_ok or want.dtype != have.dtype:
            raise InputError(
                f"{_label(i, texts, node.name)}: expected shape {describe(want)} (as the .pt2 was exported), "
                f"got {describe(have)}"
            )


def _fake_forward(model: torch.nn.Module, inputs: Any) -> BaseException | None:
    """The error a forward on fake copies of the inputs raises, or None (nothing is computed)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

    from ..model_state import ModelState
    from .pt2.load_errors import quiet_torch_export
    from .trace import normalize_inputs

    args, kwargs = normalize_inputs(inputs)
    try:
        with (
            quiet_torch_export(),
            ModelState(model).preserved(),
            FakeTensorMode(allow_non_fake_inputs=True) as mode,
            torch.no_grad(),
        ):
            fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
            model(*fake_args, **fake_kwargs)
    except DataDependentOutputException:
        return None  # fake tensors cannot say; not evidence against the inputs
    except (RuntimeError, ValueError, IndexError, TypeError, AssertionError) as e:
        return e
    except Exception:  # noqa: BLE001 - anything else: leave the original error alone
        return None
    return None


def _real_forward(model: torch.nn.Module, inputs: Any) -> BaseException | None:
    from ..model_state import ModelState
    from .trace import normalize_inputs

    args, kwargs = normalize_inputs(inputs)
    try:
        with ModelState(model).preserved(), torch.no_grad():  # buffers, modes and RNG as they were
            model(*args, **kwargs)
    except (RuntimeError, ValueError, IndexError, TypeError, AssertionError) as e:
        return e
    except Exception:  # noqa: BLE001 - anything else: leave the original error alone
        return None
    return None


def _mismatch(inputs: Any, reference: Any) -> str | None:
    """How the inputs differ from the model's own example in count, rank or dtype (sizes may differ)."""
    got, want = _leaves(inputs), _leaves(reference)
    if len(got) != len(want):
        return f"{len(got)} input(s) given, the model's example has {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        if isinstance(g, torch.Tensor) and isinstance(w, torch.Tensor) and (g.dim() != w.dim() or g.dtype != w.dtype):
            return f"input {i + 1} has rank/dtype unlike the model's example"
    return None


def explain_failure(
    model: torch.nn.Module, inputs: Any, reference: Any, error: BaseException, texts: Sequence[str] | None = None
) -> InputError | None:
    """An InputError naming the inputs when they (not the model) made capture or profiling fail, else None.

    The inputs are blamed when they differ in count, rank or dtype from the
    model's own example (`reference`), or when a forward on fake tensors fails;
    after a profiling failure (the graph already ran on these inputs), when a
    plain forward under no_grad fails too.
    """
    if error.__class__.__name__ not in ("CaptureError", "ProfileError"):
        return None
    mismatch = _mismatch(inputs, reference) if reference is not None else None
    failure = _fake_forward(model, inputs)
    if failure is None and error.__class__.__name__ == "ProfileError":
        failure = _real_forward(model, inputs)
    if failure is None and mismatch is None:
        return None
    cause = failure if failure is not None else error
    first = next((ln.strip() for ln in str(cause).splitlines() if ln.strip()), type(cause).__name__)[:200].rstrip(".")
    got = ", ".join(f"{_label(i, texts, None)} = {describe(t)}" for i, t in enumerate(_leaves(inputs)))
    hint = ""
    if reference is not None:
        hint = "; the model's own example input(s): " + ", ".join(describe(t) for t in _leaves(reference))
    return InputError(f"inputs: the model's forward rejects {got}: {first}{hint}")


def nothing_to_plan(model: torch.nn.Module, graph_module: Any, saved_bytes: int) -> NothingToPlanError | None:
    """A NothingToPlanError when one training step saves no activations for backward, else None."""
    output = next((n for n in graph_module.graph.nodes if n.op == "output"), None)
    has_tensor = output is not None and any(isinstance(a, torch.fx.Node) for a in pytree.tree_leaves(output.args))
    if has_tensor and saved_bytes > 0:
        return None
    if not has_tensor:
        why = "its forward returns no tensor (None or constants), so there is no loss to differentiate"
    elif not any(p.requires_grad for p in model.parameters()):
        why = "no parameter requires grad (the model is frozen), so backward needs no activations"
    else:
        why = "autograd saves no activations for backward in one training step"
    return NothingToPlanError(f"model: nothing to plan: {why}; checkpointing frees saved activations only")


def refuse_grad_mode() -> None:
    """Planning profiles one training step: under no_grad/inference_mode nothing is saved for backward."""
    if torch.is_inference_mode_enabled():
        raise UnplannableError(
            "optimize: called inside torch.inference_mode(), where nothing is saved for backward, so there is "
            "no training step to plan; call it outside that context"
        )
    if not torch.is_grad_enabled():
        raise UnplannableError(
            "optimize: called under torch.no_grad(), where nothing is saved for backward, so there is no "
            "training step to plan; call it outside that context (or inside torch.enable_grad())"
        )

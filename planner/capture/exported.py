"""Models given as a `torch.export` ExportedProgram, or as the module `ExportedProgram.module()` returns.

`ep.module()` refuses `train()` and `eval()` ("Calling train() is not supported yet"): its graph
keeps the mode it was exported in. Capture, verify and the checkpointed module only need the
training flag set, which is what `nn.Module`'s own methods do, so those overrides are removed
from the module (its computation is unchanged).

Such a module is captured again with torch.export: symbolic_trace would run its in-place buffer
updates (`num_batches_tracked.add_(1)`, whose arguments hold no traced value) once at trace time
and leave them out of the graph.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["accept_exported"]


def accept_exported(model: Any, example_inputs: Any = None) -> tuple[torch.nn.Module, Any, bool]:
    """(module, example_inputs, exported) for an nn.Module, an ExportedProgram or an `ep.module()`.

    An ExportedProgram gives its `.module()`; with no example inputs, the program's own
    (`ep.example_inputs`) are used when it kept them. `exported` is True for both: capture
    them with torch.export.
    """
    if isinstance(model, torch.export.ExportedProgram):
        if example_inputs is None and getattr(model, "example_inputs", None) is not None:
            args, kwargs = model.example_inputs
            if args and kwargs:
                example_inputs = None  # both kinds: the caller must say which (normalize_inputs reports it)
            else:
                example_inputs = dict(kwargs) if kwargs else tuple(args)
        model = model.module()
    exported = False
    if isinstance(model, torch.nn.Module):
        for attr in ("train", "eval"):
            if attr in model.__dict__:  # ep.module()'s refusing overrides; nn.Module's methods set the flag
                delattr(model, attr)
                exported = True
        exported = exported or isinstance(model, _StatefulGraphModule)
    return model, example_inputs, exported


try:
    from torch.export._unlift import _StatefulGraphModule
except ImportError:  # another torch layout: the train/eval overrides still identify the module
    _StatefulGraphModule = ()

"""The longest batch a loader will produce, and the first batch grown to it for planning.

A plan that fits the longest batch fits the shorter ones (activations grow with the sequence
length), and a captured graph with dynamic sizes runs them with the same regions. So the callbacks
plan at the longest length the data can have: `max_length=` when given, else the collator's
`max_length`, else the tokenizer's `model_max_length` where it is set (tokenizers without one
report 1e30), each capped at the model's `max_position_embeddings`.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import InputError

__all__ = ["find_max_length", "grown_to", "sequence_length", "collators_of"]

_UNSET = 1_000_000  # a tokenizer's model_max_length at or above this means "no limit set"


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < _UNSET else None


def _positions(model: torch.nn.Module | None) -> int | None:
    config = getattr(model, "config", None)
    return _int(getattr(config, "max_position_embeddings", None))


def find_max_length(model: torch.nn.Module | None, *, collators: tuple = (), tokenizers: tuple = ()
                    ) -> tuple[int | None, str]:
    """(length, where it came from): a collator's `max_length`, else a tokenizer's `model_max_length`
    (a collator's own `tokenizer` included), capped at the model's positions; (None, why not) else."""
    positions = _positions(model)
    found: tuple[int, str] | None = None
    for c in collators:
        length = _int(getattr(c, "max_length", None))
        if length is not None:
            found = (length, f"the collator's max_length ({type(c).__name__})")
            break
    if found is None:
        toks = [*tokenizers, *(getattr(c, "tokenizer", None) for c in collators)]
        for t in toks:
            length = _int(getattr(t, "model_max_length", None))
            if length is not None:
                found = (length, f"the tokenizer's model_max_length ({type(t).__name__})")
                break
    if found is None:
        return None, "no max_length given and none set on the collator or tokenizer"
    length, source = found
    if positions is not None and length > positions:
        return positions, f"{source} {length}, capped at the model's max_position_embeddings"
    return length, source


def collators_of(*loaders: Any) -> tuple:
    """The collate functions of data loaders (Lightning's CombinedLoader, accelerate's wrappers and the
    Trainer's column-removing collator looked through)."""
    out: list[Any] = []
    seen: set[int] = set()

    def visit(obj: Any, depth: int = 0) -> None:
        if obj is None or id(obj) in seen or depth > 4:
            return
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item, depth + 1)
            return
        if isinstance(obj, dict):
            for item in obj.values():
                visit(item, depth + 1)
            return
        collate = getattr(obj, "collate_fn", None)
        if collate is not None:
            out.append(collate)
            visit(getattr(collate, "data_collator", None), depth + 1)
        if getattr(obj, "max_length", None) is not None or getattr(obj, "tokenizer", None) is not None:
            out.append(obj)
        for attr in ("data_collator", "base_dataloader", "iterables", "flattened"):
            inner = getattr(obj, attr, None)
            if inner is not None and inner is not obj:
                visit(inner, depth + 1)

    for loader in loaders:
        visit(loader)
    return tuple(out)


def sequence_length(inputs: dict[str, Any]) -> int | None:
    """The sequence length of a call: dimension 1 of its first tensor input of rank 2 or more."""
    for value in inputs.values():
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[1])
    return None


def grown_to(inputs: dict[str, Any], length: int) -> dict[str, Any]:
    """The call's inputs with every tensor whose dimension 1 is the sequence length grown to `length`
    by repeating its last position (token ids, mask and label values stay ones the model takes).

    Planning only: bytes and times depend on the sizes, and the batch itself runs unchanged.
    """
    if length < 1:
        raise InputError(f"max_length: {length} must be >= 1")
    seq = sequence_length(inputs)
    if seq is None or seq >= length:
        return dict(inputs)
    out: dict[str, Any] = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == seq:
            tail = value.narrow(1, seq - 1, 1).expand(*value.shape[:1], length - seq, *value.shape[2:])
            value = torch.cat([value, tail], dim=1)
        out[name] = value
    return out

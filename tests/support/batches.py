"""Batches of variable-length token ids as a fine-tune's loader makes them."""

from __future__ import annotations

from typing import Any

import torch


class PadPerBatch:
    """Pads each batch to its own longest row (pad id 0, attention mask 0, label -100). `max_length` is what
    the training callbacks read as the longest length the loader will produce (planned for up front)."""

    def __init__(self, max_length: int | None = None) -> None:
        self.max_length = max_length

    def __call__(self, rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        top = max(len(r["input_ids"]) for r in rows)
        ids = torch.zeros(len(rows), top, dtype=torch.long)
        mask = torch.zeros(len(rows), top, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r["input_ids"])] = r["input_ids"]
            mask[i, : len(r["input_ids"])] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

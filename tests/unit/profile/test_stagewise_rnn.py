"""An LSTM with `batch_first=True`, profiled a stage at a time: its output is a transposed view of the
[T, B, H] result, and the gradient the next stage's linear hands back is contiguous in [B, T, H], so the
LSTM's backward copies it to read it (one [B, T, H] tensor). The stage's gradient seeds are laid out as
that gradient is, and the stage figures are the whole step's."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F
from ckpt_planner.capture.trace import capture
from ckpt_planner.profile.profiler import ProfileConfig, profile
from ckpt_planner.profile.stagewise import _seed

FLOPS = ProfileConfig(flop_times=True)
B, T, D, V = 8, 32, 32, 64  # batch, steps, width, vocabulary


class LSTMLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lstm = nn.Embedding(V, D), nn.LSTM(D, D, batch_first=True)
        self.head = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, V))

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h, _ = self.lstm(self.emb(ids))  # [B, T, D], a transposed view on CPU's fused kernel
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def test_the_lstm_backward_counts_the_same_a_stage_at_a_time():
    torch.manual_seed(0)
    ids = torch.randint(0, V, (B, T))
    cap = capture(LSTMLM(), {"ids": ids, "labels": ids})
    whole = profile(cap, dataclasses.replace(FLOPS, bounded=False))
    staged = profile(cap, dataclasses.replace(FLOPS, bounded=True))
    assert len(staged.stages) > 1
    w, s = (next(n for n in c.nodes if n.name == "lstm") for c in (whole, staged))
    # the copy of the incoming gradient is B * T * D * 4 bytes; the stages used to miss it
    assert abs(w.backward_temp_bytes - s.backward_temp_bytes) < B * T * D * 4 // 4, (w.backward_temp_bytes,
                                                                                       s.backward_temp_bytes)


def test_seeds_are_laid_out_as_input_gradients_are():
    out = torch.zeros(T, B, D).transpose(0, 1)  # batch-first view of a [T, B, D] result
    assert _seed(out).is_contiguous()
    conv = torch.zeros(2, 3, 4, 4).to(memory_format=torch.channels_last)
    assert _seed(conv).is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(_seed(out), torch.ones(B, T, D))

"""Small models that each meet one checkpointing hazard (BatchNorm statistics, random ops)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = F.relu(self.b1(self.c1(x)))
        x = F.relu(self.b2(self.c2(x)))
        return self.head(x.mean((2, 3)))


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 16)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        h = self.drop(torch.relu(self.a(x)))
        h = h * torch.bernoulli(torch.full_like(h, 0.7)) + 0.01 * torch.randn_like(h) + 0.01 * torch.rand_like(h)
        return self.b(F.dropout(h, 0.2, training=self.training))

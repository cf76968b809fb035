"""Built-in example models: the demo's GPT-style transformer and small test models."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["TinyGPT", "MLPChain", "ResidualCNN", "gpt_example", "EXAMPLES"]


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float, seq: int) -> None:
        super().__init__()
        self.heads = heads
        # True above the diagonal: the future positions a token must not attend to
        self.register_buffer("mask", ~torch.ones(seq, seq, dtype=torch.bool).tril(), persistent=False)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape  # [B, T, C]
        q, k, v = self.qkv(x).split(c, dim=2)
        h = self.heads
        q = q.view(b, t, h, c // h).transpose(1, 2)  # [B, H, T, C/H]
        k = k.view(b, t, h, c // h).transpose(1, 2)
        v = v.view(b, t, h, c // h).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(c // h))  # [B, H, T, T]
        att = att.masked_fill(self.mask, float("-inf"))  # T must equal seq
        att = self.drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float, seq: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, dropout, seq)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    """A GPT-2-style decoder (nanoGPT layout) that returns the language-model loss."""

    def __init__(self, vocab: int = 512, d: int = 128, layers: int = 4, heads: int = 4, seq: int = 128, dropout: float = 0.1) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(d, heads, dropout, seq) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight  # tied embedding and output layer

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx) + self.wpe.weight)  # [B, T, C]; T must equal seq
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # [B, T, V]
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


class MLPChain(nn.Module):
    """A chain of MLP blocks: the simplest checkpointing workload."""

    def __init__(self, d: int = 256, blocks: int = 8) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class ResBlock(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class ResidualCNN(nn.Module):
    """A small ResNet-style CNN with BatchNorm."""

    def __init__(self, c: int = 16, blocks: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.blocks = nn.Sequential(*[ResBlock(c) for _ in range(blocks)])
        self.head = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.stem(x))
        return self.head(x.mean(dim=(2, 3)))


def gpt_example(batch: int = 8, seq: int = 128, layers: int = 4, d: int = 128, seed: int = 0):
    """The demo model and its inputs (token ids and targets)."""
    torch.manual_seed(seed)
    model = TinyGPT(vocab=512, d=d, layers=layers, heads=4, seq=seq)
    idx = torch.randint(0, 512, (batch, seq))
    targets = torch.randint(0, 512, (batch, seq))
    return model, (idx, targets)


def mlp_example(seed: int = 0):
    torch.manual_seed(seed)
    return MLPChain(), (torch.randn(16 * 64, 256),)


def cnn_example(seed: int = 0):
    torch.manual_seed(seed)
    return ResidualCNN(), (torch.randn(8, 3, 32, 32),)


EXAMPLES = {"gpt": gpt_example, "mlp": mlp_example, "cnn": cnn_example}

"""Recomputed regions under CPU bf16 autocast train bitwise like the model.

A region's recompute runs in the backward, which a training loop usually calls after the `with
torch.autocast(...)` block has exited: the recompute must re-enter the forward's autocast state (non-reentrant
checkpoint records it and restores it), else it recomputes in float32 and its saved tensors differ. Autocast's
cache of parameter casts is emptied at that exit, so the recompute casts the weights afresh; inside the block it
finds them cached. Both must give the forward's values. The regions here hold an embedding and dropout (RNG
replayed), matmuls autocast runs in bf16 and a float32 residual.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from ckpt_planner.capture.mutation import compute_nodes
from ckpt_planner.capture.trace import capture
from ckpt_planner.lower.rewrite import CheckpointRegion, rewrite
from ckpt_planner.profile.loss import default_loss

from tests.support.steps import METHODS, same

VOCAB, D, B, T = 64, 32, 2, 16


class TokenMLP(nn.Module):
    """Embedding -> dropout -> residual MLP block (dropout inside) -> LM head -> cross entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = F.dropout(self.embed(ids), 0.1, training=self.training)  # [B, T, D] float32
        h = h + F.dropout(self.down(F.gelu(self.up(h))), 0.1, training=self.training)  # bf16 block, float32 sum
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def bf16() -> torch.autocast:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def run(module: nn.Module, model: nn.Module, inputs: tuple, backward_inside: bool) -> tuple:
    """One step from a fixed seed under bf16 autocast; (loss, grads). The backward runs inside the autocast
    block or after it."""
    for p in model.parameters():
        p.grad = None
    torch.manual_seed(0)
    with bf16():
        loss = default_loss(module(*inputs))
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = None
    return loss.detach().clone(), grads


def regions_of(gm: torch.fx.GraphModule, first: str, last: str) -> tuple[int, int]:
    """(start, end) compute-node positions of the first node whose name starts with `first` and the first one
    after it whose name starts with `last`."""
    names = [n.name for n in compute_nodes(gm.graph)]
    s = next(i for i, n in enumerate(names) if n.startswith(first))
    e = next(i for i in range(s, len(names)) if names[i].startswith(last))
    return s, e


@pytest.mark.parametrize("backward_inside", [False, True], ids=["backward_after_block", "backward_inside_block"])
@pytest.mark.parametrize("method", METHODS)
def test_recomputed_embedding_and_dropout_regions_bitwise_under_bf16(method: str, backward_inside: bool) -> None:
    torch.manual_seed(0)
    model = TokenMLP().train()
    inputs = (torch.randint(0, VOCAB, (B, T)), torch.randint(0, VOCAB, (B, T)))
    with bf16():
        gm = capture(model, inputs, method=method).graph_module
    embed = regions_of(gm, "embed", "dropout")  # the embedding and its dropout
    block = (embed[1] + 1, regions_of(gm, "add", "add")[1])  # the MLP block to its residual add
    module = rewrite(gm, [embed, block], model=model)
    assert sum(isinstance(m, CheckpointRegion) for m in module.modules()) == 2
    assert any(m.random for m in module.modules() if isinstance(m, CheckpointRegion))

    ref_loss, ref_grads = run(model, model, inputs, backward_inside)
    loss, grads = run(module, model, inputs, backward_inside)
    assert loss.dtype == torch.float32 and torch.equal(loss, ref_loss)
    assert same(ref_grads, grads), [n for n in grads if not torch.equal(grads[n], ref_grads[n])]


def test_recompute_without_the_forwards_autocast_state_differs(monkeypatch) -> None:
    """The guard has teeth: a recompute in float32 (autocast state not restored) is refused by checkpoint."""
    import torch.utils.checkpoint as tcp

    torch.manual_seed(0)
    model = TokenMLP().train()
    inputs = (torch.randint(0, VOCAB, (B, T)), torch.randint(0, VOCAB, (B, T)))
    with bf16():
        gm = capture(model, inputs, method="export").graph_module
    embed = regions_of(gm, "embed", "dropout")
    module = rewrite(gm, [(embed[1] + 1, regions_of(gm, "add", "add")[1])], model=model)
    real = tcp._get_autocast_kwargs

    def lost(device_type: str = "cuda"):
        dev, cpu = real(device_type)
        return dev, {**cpu, "enabled": False}

    monkeypatch.setattr(tcp, "_get_autocast_kwargs", lost)
    with pytest.raises(Exception, match="metadata|dtype"):
        run(module, model, inputs, backward_inside=False)

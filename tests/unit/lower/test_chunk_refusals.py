"""Token-wise work that chunking must not take as it is: a reshape with a symbolic size given as -1 besides
the axis (GPT-2's `view(-1, seq, width)` before its head), and a group whose outputs view its own copy."""

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F
from ckpt_planner.capture.tokenwise import axis_lengths, find_tokenwise, hint
from ckpt_planner.capture.trace import capture
from ckpt_planner.lower.chunk import ChunkedCall, ChunkSpec, choose_chunks, chunk_graph

VOCAB, WIDTH, SEQ, BATCH = 256, 16, 64, 2


class ViewedHead(nn.Module):
    """A norm, then `view(-1, seq, width)` (the batch symbolic under export, given as -1), an MLP and a
    head with its loss: the reshape must be chunked with the batch read off each chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.up = nn.Linear(WIDTH, 8 * WIDTH)
        self.down = nn.Linear(8 * WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = torch.cumsum(self.emb(ids), dim=1) / 8  # mixes tokens: the groups start after it
        h = self.norm(h).view(-1, ids.shape[1], WIDTH)
        h = h + self.down(F.gelu(self.up(h)))
        logits = self.head(h).float()
        return F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    return {"ids": ids, "labels": ids.clone()}


def _step(module, model, inputs):
    for p in model.parameters():
        p.grad = None
    loss = module(**inputs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_a_reshape_with_a_symbolic_size_given_as_minus_one_is_chunked_and_allclose():
    torch.manual_seed(0)
    model = ViewedHead().train()
    inputs = _inputs()
    cap = capture(model, inputs, method="export")
    views = [n for n in cap.graph_module.graph.nodes if n.target is torch.ops.aten.view.default
             and -1 in n.args[1] and not isinstance(n.meta["val"].shape[0], int)]
    assert views  # the case: a symbolic batch given as -1 besides the sequence axis
    # chunked along the sequence (the batch, given as -1, is then a size besides the axis)
    seq = [n for n in axis_lengths(cap.graph_module) if hint(n) == SEQ]
    groups = [g for n in seq for g in find_tokenwise(cap.graph_module, n) if views[0].name in g.nodes]
    assert groups  # taken into the chunks, not left whole
    gm = chunk_graph(cap.graph_module, [ChunkSpec(groups[0].nodes, 4)])  # raised a raw ValueError before
    cap = dataclasses.replace(cap, graph_module=gm)
    assert any(isinstance(m, ChunkedCall) and m.chunks == 4 for m in gm.modules())
    ref_loss, ref_grads = _step(model, model, inputs)
    loss, grads = _step(cap.graph_module, model, inputs)
    torch.testing.assert_close(loss, ref_loss)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


class SplitQKV(nn.Module):
    """An attention's q, k, v split: transpose, contiguous (a copy) and three selects that view it. The
    selects' pieces hold the whole copy until they are concatenated, so chunking saves nothing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = x.unflatten(-1, (3, 32)).permute(2, 1, 0, 3).contiguous()  # (3, tokens, batch, 32)
        q, k, v = qkv[0], qkv[1], qkv[2]
        return torch.cumsum(q, 0) * torch.cumsum(k, 0) * torch.cumsum(v, 0)  # mixes tokens: outside


def test_a_group_whose_outputs_view_its_copy_is_not_worth_chunking():
    x = torch.randn(4, 64, 96, requires_grad=True)
    cap = capture(SplitQKV(), (x,), method="export")
    gm = cap.graph_module
    groups = [g for n in axis_lengths(gm) for g in find_tokenwise(gm, n)
              if any(gm.graph.find_nodes(op="call_function", target=torch.ops.aten.contiguous.default))
              and any(m.startswith("contiguous") for m in g.nodes)]
    assert groups
    for g in groups:
        # the views own no bytes and the copy stays whole: nothing inside, no chunks
        assert g.interior_bytes == 0
        assert choose_chunks(g) == 1


class CastOut(nn.Module):
    """An MLP whose output is cast to float64: the cast copies, so the float32 work before it stays inside."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(F.gelu(self.up(x)).to(torch.float64), 1)  # the cumsum mixes tokens: outside


def test_a_cast_output_copies_so_the_work_before_it_counts_inside():
    x = torch.randn(BATCH, SEQ, WIDTH)
    cap = capture(CastOut(), (x,), method="export")
    gm = cap.graph_module
    groups = [g for n in axis_lengths(gm) if hint(n) == SEQ for g in find_tokenwise(gm, n)]
    assert len(groups) == 1
    # the linear's and the gelu's float32 outputs, (batch, seq, 4 * width) each
    assert groups[0].interior_bytes == 2 * BATCH * SEQ * 4 * WIDTH * 4

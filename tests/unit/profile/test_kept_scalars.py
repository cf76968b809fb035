"""A Python number an op takes as a tensor (`x * 0.5` is aten.mul.Tensor(x, 0.5)) becomes a 0-dim tensor of
its own (8 bytes) that autograd keeps for the backward where the op's gradient needs it, out of sight of every
tensor counter and of every saved-tensor hook, so no checkpoint frees it. A GPT-J's tanh GELU keeps three per
MLP; chunked (exact=False), three per chunk: its plan at the floor a refusal named measured 144 B over it."""

import torch
import torch.nn as nn
import torch.nn.functional as F
from ckpt_planner.api import Planner
from ckpt_planner.profile.backward import KeptScalars
from ckpt_planner.profile.loss import default_loss
from ckpt_planner.profile.memory import measure_step_peaks

from tests.support.profiles import FLOP_TIMES

VOCAB, WIDTH, SEQ, LAYERS = 64, 16, 64, 2


def tanh_gelu(x: torch.Tensor) -> torch.Tensor:
    """GPT-J's and GPT-2's GELU: three multiplications by a Python number, each kept for the backward."""
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))


class TanhGeluLM(nn.Module):
    """An embedding, a token-mixing op, tanh-GELU MLPs, an LM head and its mean loss."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.up = nn.ModuleList(nn.Linear(WIDTH, 4 * WIDTH) for _ in range(LAYERS))
        self.down = nn.ModuleList(nn.Linear(4 * WIDTH, WIDTH) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = torch.cumsum(self.emb(ids), dim=1)  # mixes tokens
        for up, down in zip(self.up, self.down):
            h = h + down(tanh_gelu(up(h)))
        return F.cross_entropy(self.head(h).view(-1, VOCAB), labels.view(-1))


def _setup() -> tuple[TanhGeluLM, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, SEQ), generator=g)
    return TanhGeluLM().train(), {"ids": ids, "labels": ids.clone()}


def _plain_peak(planner: Planner, inputs: dict) -> int:
    """The allocator's peak of one step of the planner's captured (maybe chunked) graph, bytes."""
    params = list(planner.model.parameters())
    state = params + list(planner.model.buffers())
    return measure_step_peaks(planner.capture.graph_module, (), inputs, params, state, default_loss,
                              torch.device("cpu"))[0].allocator


def _resident(model: nn.Module) -> int:
    return sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers()])


def test_an_op_that_keeps_a_number_is_seen_and_one_that_does_not_is_not():
    x = torch.randn(4, 3, requires_grad=True)
    with KeptScalars() as kept:
        kept.node = "n"
        y = x * 0.5 + 1.0  # mul keeps 0.5 (an 8-byte float64); add keeps nothing
        z = x / 3  # div keeps 3 (an 8-byte int64)
        with torch.no_grad():
            x * 0.25  # no autograd node: nothing kept
        kept.node = None
    kept.settle()
    assert kept.bytes == {"n": 16}
    assert y.grad_fn.next_functions[0][0]._saved_other.dtype == torch.float64 and z.grad_fn is not None


def test_the_plain_step_counts_the_numbers_its_gelus_keep():
    model, inputs = _setup()
    planner = Planner(model, inputs, profile_config=FLOP_TIMES, capture_method="export")
    measured = _plain_peak(planner, inputs)
    assert measured <= planner.no_checkpoint_peak_bytes <= measured + 3 * 8 * LAYERS
    # 3 numbers of 8 bytes per GELU, kept from its forward to its backward: counted with the resident bytes
    assert planner.cost.param_bytes - _resident(model) == 3 * 8 * LAYERS


def test_a_chunked_step_is_not_predicted_under_what_it_measures():
    """exact=False runs the MLPs in chunks, each chunk's GELU keeping three numbers of its own (checkpoint's
    hooks never see them), through the step's backward."""
    model, inputs = _setup()
    planner = Planner(model, inputs, profile_config=FLOP_TIMES, capture_method="export", exact=False)
    assert len(planner.chunks) == LAYERS and all(c.chunks > 1 for c in planner.chunks)  # one MLP per group
    kept = 3 * 8 * sum(c.chunks for c in planner.chunks)
    measured = _plain_peak(planner, inputs)
    assert measured <= planner.no_checkpoint_peak_bytes <= measured + kept
    assert planner.cost.param_bytes - _resident(model) == kept

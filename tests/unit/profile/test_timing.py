"""Per-node times where the timed runs disagree: the FLOP/bytes estimate stands in, held between the
fastest run and the typical one (timing.anchor_times). Times are set by hand: no clock is read."""

import dataclasses

import pytest
import torch
from ckpt_planner import ProfileConfig
from ckpt_planner.capture import capture
from ckpt_planner.profile import profile
from ckpt_planner.profile.timing import DISAGREE, anchor_times, op_key, quantize
from ckpt_planner.profile.timing_store import TimingStore

from tests.models.examples import TinyGPT

PER_FLOP = 1e-12  # seconds: the machine these hand-set times describe
PER_BYTE = 1e-10
VIEW_S = 2e-6


@pytest.fixture(scope="module")
def raw():
    """A measured profile of a small GPT whose times are replaced by a deterministic roofline, every
    node's runs agreeing."""
    torch.manual_seed(0)
    model = TinyGPT(vocab=64, d=32, layers=2, heads=2, seq=16).train()
    x = torch.randint(0, 64, (2, 16))
    cost = profile(capture(model, (x, x)), ProfileConfig(anchor=False, overheads=False, timing_store=False))
    assert cost.time_source == "measured"
    nodes = tuple(dataclasses.replace(n, time=_truth(cost, n), time_min=_truth(cost, n)) for n in cost.nodes)
    return dataclasses.replace(cost, nodes=nodes)


def _truth(cost, n) -> float:
    if n.flops > 0:
        return PER_FLOP * n.flops
    if n.out_bytes > 0:
        return PER_BYTE * (n.out_bytes + sum(cost.storages[t].nbytes for t in n.reads))
    return VIEW_S


def _disturbed(cost, pick, typical: float, fastest: float):
    """`cost` with the nodes `pick` selects timed at `typical` x and `fastest` x their true time."""
    nodes = tuple(
        dataclasses.replace(n, time=n.time * typical, time_min=n.time * fastest) if pick(n) else n for n in cost.nodes
    )
    return dataclasses.replace(cost, nodes=nodes)


def _key_of(cost, kind, which=0):
    keys = sorted({op_key(cost, n) for n in cost.nodes if n.kind == kind})
    assert len(keys) > which, f"the test needs {which + 1} {kind} keys"
    return keys[which]


@pytest.mark.parametrize("kind", ["Linear", "cross_entropy", "getitem"])
def test_a_key_whose_runs_disagree_takes_its_flop_or_bytes_estimate(raw, kind):
    """Linear: the seconds per FLOP of the other Linear keys; cross_entropy, alone of its op: the seconds per
    byte of every memory-bound key; getitem, no work to scale by: the other getitem keys' time."""
    key = _key_of(raw, kind)
    noisy = _disturbed(raw, lambda n: op_key(raw, n) == key, typical=8.0, fastest=1 / 8)
    fitted = anchor_times(noisy)
    for a, b in zip(raw.nodes, fitted.nodes):
        assert b.time_estimated == (op_key(raw, a) == key)
        assert b.time == quantize(a.time), (a.name, a.time, b.time)
    plain = anchor_times(raw)
    assert not any(n.time_estimated for n in plain.nodes)
    assert [n.time for n in plain.nodes] == [n.time for n in fitted.nodes]


def test_the_estimate_stays_within_what_the_runs_bracket(raw):
    """An estimate below the fastest run is raised to it (the fastest run happened); one above the typical
    run is lowered to it."""
    key = _key_of(raw, "Linear")
    mine = lambda n: op_key(raw, n) == key  # noqa: E731
    above = anchor_times(_disturbed(raw, mine, typical=16.0, fastest=4.0))
    below = anchor_times(_disturbed(raw, mine, typical=1 / 4, fastest=1 / 16))
    for a, hi, lo in zip(raw.nodes, above.nodes, below.nodes):
        if mine(a):
            assert hi.time_estimated and hi.time == quantize(4.0 * a.time)
            assert lo.time_estimated and lo.time == quantize(a.time / 4)


def test_runs_that_agree_within_the_threshold_keep_their_measured_time(raw):
    key = _key_of(raw, "Linear")
    spread = DISAGREE * 0.9
    fitted = anchor_times(_disturbed(raw, lambda n: op_key(raw, n) == key, typical=spread, fastest=1.0))
    for a, b in zip(raw.nodes, fitted.nodes):
        assert not b.time_estimated
        if op_key(raw, a) == key:
            assert b.time == quantize(spread * a.time)


def test_a_key_disagrees_by_its_median_node(raw):
    """One layer's runs hit by load do not make a repeated op doubtful; most of them do."""
    counts: dict[str, int] = {}
    for n in raw.nodes:
        counts[op_key(raw, n)] = counts.get(op_key(raw, n), 0) + 1
    key = max(counts, key=counts.get)
    assert counts[key] >= 3
    layers = [n.name for n in raw.nodes if op_key(raw, n) == key]
    one = anchor_times(_disturbed(raw, lambda n: n.name == layers[0], typical=8.0, fastest=1 / 8))
    most = anchor_times(_disturbed(raw, lambda n: n.name in layers[1:], typical=8.0, fastest=1 / 8))
    assert not any(n.time_estimated for n in one.nodes)
    assert {n.name for n in most.nodes if n.time_estimated} == set(layers)


def test_an_estimate_heals_no_stored_time_but_an_agreeing_run_does(raw, tmp_path):
    """With the timing store: a key stored at 4x its true time (a loaded first run whose runs agreed) keeps
    that time on a run whose runs disagree, though the estimate is lower; a run that agrees heals it."""
    key = _key_of(raw, "Linear")
    mine = lambda n: op_key(raw, n) == key  # noqa: E731
    store = TimingStore(tmp_path / "timings-x.json")
    anchor_times(_disturbed(raw, mine, typical=4.0, fastest=4.0), store)
    doubtful = anchor_times(_disturbed(raw, mine, typical=8.0, fastest=1 / 8), store)
    agreeing = anchor_times(raw, store)
    for a, d, g in zip(raw.nodes, doubtful.nodes, agreeing.nodes):
        if mine(a):
            assert d.time == quantize(4.0 * a.time) and not d.time_estimated
            assert g.time == quantize(a.time)


def test_with_no_op_whose_runs_agree_the_measured_times_stand(raw):
    """Nothing to scale an estimate by: no node is marked estimated, and each keeps its typical run."""
    fitted = anchor_times(_disturbed(raw, lambda n: True, typical=8.0, fastest=1 / 8))
    assert not any(n.time_estimated for n in fitted.nodes)
    assert [n.time for n in fitted.nodes] == [quantize(8.0 * a.time) for a in raw.nodes]


def test_a_kind_of_work_no_agreeing_op_does_is_not_estimated(raw):
    """Every memory-bound op disagrees: there is no seconds per byte to scale by, so they keep their typical
    run and are not marked; a matmul-like op that disagrees is still estimated from the others' FLOPs."""
    memory = lambda n: n.flops == 0 and n.out_bytes > 0  # noqa: E731
    linear = _key_of(raw, "Linear")
    fitted = anchor_times(_disturbed(raw, lambda n: memory(n) or op_key(raw, n) == linear, typical=8.0, fastest=1 / 8))
    for a, b in zip(raw.nodes, fitted.nodes):
        if memory(a):
            assert not b.time_estimated and b.time == quantize(8.0 * a.time)
        elif op_key(raw, a) == linear:
            assert b.time_estimated and b.time == quantize(a.time)

"""Nested regions that draw random numbers: every checkpoint call saves the generator state, the nested
ones too, in the forward; a recompute calls the checkpoints nested in it again, and each of those states
lives until that recompute ends. Counted by hand on a chain, and the same figures from replay and sweep."""

from ckpt_planner.solvers import Node, Problem, Storage, simulate
from ckpt_planner.solvers.simulate import replay

RNG = 5_056  # bytes of the CPU generator's state (torch.get_rng_state())
ACT = 1_000  # bytes of each node's output


def chain(n: int = 6, *, random: tuple[int, ...] = (2, 3)) -> Problem:
    """n nodes, each saving its input for its backward; the nodes of `random` draw random numbers."""
    nodes = tuple(
        Node(name=f"n{i}", time=1.0, inputs=(i - 1,) if i else (), reads=(i - 1,) if i else (),
             rng_state_bytes=RNG if i in random else 0, is_output=i == n - 1)
        for i in range(n)
    )
    storages = tuple(
        Storage(producer=i, nbytes=ACT, last_use=min(i + 1, n - 1), saved_by=(i + 1,) if i + 1 < n else (),
                is_output=i == n - 1)
        for i in range(n)
    )
    return Problem(nodes=nodes, storages=storages)


def test_a_nested_region_holds_its_state_from_the_forward():
    problem = chain()
    outer, inner = (1, 4), (2, 3)
    # The forward's end: outputs of 0 (the outer's input), 4 (saved by 5, outside) and 5 (the graph's
    # output), and both regions' states; the inner's state was once counted only from the outer's recompute.
    flat = simulate(problem, (outer,), timeline=True)
    nested = simulate(problem, (outer, inner), timeline=True)
    end = [b for phase, node, b in nested.timeline if phase == "forward" and node == 5][-1]
    assert end == 3 * ACT + 2 * RNG
    assert [b for phase, node, b in flat.timeline if phase == "forward" and node == 5][-1] == 3 * ACT + RNG


def test_a_recompute_that_calls_a_nested_checkpoint_again_holds_one_more_state():
    problem = chain()
    nested = simulate(problem, ((1, 4), (2, 3)), timeline=True)
    recompute = [(node, b) for phase, node, b in nested.timeline if phase == "recompute"]
    # The outer's recompute (nodes 1..4, stopping at 4, the last that saves in its context) forks the
    # generator (one state) and, at node 2, calls the inner's checkpoint again (one more), on top of the
    # forward's two states; both extra states go when it ends.
    first_of_inner = next(b for node, b in recompute if node == 2)
    last_of_outer_before = next(b for node, b in recompute if node == 1)
    assert first_of_inner - last_of_outer_before == ACT + RNG
    assert max(b for _, b in recompute) >= 4 * RNG


def test_replay_and_sweep_agree_on_deep_random_nests():
    problem = chain(9, random=(1, 3, 4, 6))
    for regions in [((0, 8), (1, 7), (3, 5), (4, 4)), ((1, 6), (3, 4), (3, 3)), ((0, 3), (2, 3), (4, 8), (6, 7))]:
        fast, slow = simulate(problem, regions), replay(problem, regions)
        assert (fast.peak_bytes, fast.peak_phase, fast.peak_node) == (slow.peak_bytes, slow.peak_phase, slow.peak_node)
        assert fast.breakdown == slow.breakdown

"""The offload terms of `ilp`'s flat-plan MILP: a third state per kept storage, offloaded (solver `ilp_offload`).

`OffloadTerms` adds to `milp_model._solve_milp`'s model, per candidate storage t (one the forward may keep:
not an output, with bytes, saved by a node or read by one that may start a region):

* o_t, binary: t is offloaded; o_t <= t is kept at all, and the offloaded bytes fit `host_budget_bytes`
  (all of them are on the host at the forward's end);
* need_t[j] >= [t's first backward use is at step j or later]: a saver k >= j outside every region
  (keep_k), or a region [s, e] it feeds with e >= j (x_se; the recompute of a saver-ended region runs at
  its end), monotone in j;
* off_t[k] <= o_t, 1 - need_t[lo_t(k)], y_t (t kept and released by then): t is off the device at
  backward step k, where lo_t(k) is the first use whose prefetch is issued at k or earlier
  (`copies.fetch_step`, which depends on the use only);
* forward: t leaves the device after node `free_t`, the node the simulator frees it after when every
  candidate is offloaded (a serial copy stream is never later with fewer copies: conservative);
* objective: the device-to-host stream's overhang past the forward's end, exact (one constraint per
  producer: the stream's end is the latest start plus the copies issued from there), plus per offload
  the prefetch's exposure when it has the stream to itself, at the latest first use any flat plan gives
  it (an estimate: prefetches waiting for one another are not modelled).

So the MILP's memory is the simulator's in the backward and an upper bound in the forward (equal when
copies are instantaneous), and its copy cost is exact for the forward stream. With copies that take no
time the MILP is exact over flat saver-ended plans x offload sets. Every plan is judged by `simulate`
on return, and the budget tightened by the excess when it does not fit.
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any

from ..copies import backward_prefix, d2h_seconds, fetch_step, h2d_seconds
from ..problem import Problem

__all__ = ["OffloadTerms", "NO_OFFLOAD"]


class OffloadTerms:
    """The offload variables and terms of one MILP (see the module docstring). Bytes in the model's unit, time
    in its `tunit`."""

    def __init__(self, problem: Problem, prob, new_var, x, keep, y_at, span, readers, unit: float, tunit: float) -> None:
        import pulp

        n, storages = problem.n, problem.storages
        self.o: dict[int, Any] = {}
        self._forward: list[list] = [[] for _ in range(n + 1)]  # terms leaving the device before node j
        self._backward: list[list] = [[] for _ in range(n)]
        forward = list(itertools.accumulate(node.time for node in problem.nodes))
        prefix = backward_prefix(problem)
        hi_end = [-1] * n  # furthest end of a candidate region starting at s
        for s_, e_ in x:
            hi_end[s_] = max(hi_end[s_], e_)
        cands = sorted((t for t in y_at if storages[t].copyable), key=lambda t: (storages[t].producer, t))
        if not cands or not problem.can_offload:
            self.cost = 0
            return
        stream = 0.0
        h2d_cost = []
        for t in cands:
            st = storages[t]
            p, nb = st.producer, st.nbytes / unit
            o = self.o[t] = new_var(f"o_{t}", 0, 1, "Binary")
            K = span[t]
            prob += o <= y_at[t][K - p]
            stream = max(forward[p], stream) + d2h_seconds(problem, st.nbytes)
            free = min(bisect.bisect_left(forward, stream, lo=st.last_use), n - 1)
            self._forward[free + 1].append(nb * o)
            # need[j - p] for j = p..n-1; the latest use any flat plan gives t bounds the prefetch's window.
            need = [new_var(f"need_{t}_{j}", 0, 1) for j in range(p, n)]
            for a, b in zip(need, need[1:]):
                prob += a >= b
            latest = p
            for k in st.saved_by:
                prob += need[k - p] >= keep[k]
                latest = max(latest, k)
            rd = sorted(i for i in readers[t] if i > p)
            for s_ in range(p + 1, (rd[-1] if rd else p) + 1):
                first = rd[bisect.bisect_left(rd, s_)]  # the first reader in a region starting at s_
                for e_ in range(first, hi_end[s_] + 1):
                    if (s_, e_) in x:
                        prob += need[e_ - p] >= x[(s_, e_)]
                        latest = max(latest, e_)
            seconds = h2d_seconds(problem, st.nbytes)
            h2d_cost.append(max(0.0, seconds - (prefix[-1] - prefix[latest])) * o)
            fetched = [fetch_step(prefix, u, seconds) for u in range(p, n)]  # by first use: monotone
            for k in range(p + 1, n):
                lo = bisect.bisect_left(fetched, k) + p  # the first use whose prefetch is issued at k or earlier
                if lo <= p:
                    continue  # back on the device at k whatever its use
                var = new_var(f"off_{t}_{k}", 0, 1)
                prob += var <= o
                prob += var <= 1 - need[lo - p] if lo < n else var <= o
                prob += var <= y_at[t][min(k, K) - p]
                self._backward[k].append(nb * var)
        prob += pulp.lpSum(storages[t].nbytes * o for t, o in self.o.items()) <= problem.host_budget_bytes
        # Device-to-host overhang: max over first copies of (its start + the copies from there) - forward end.
        overhang = new_var("d2h_overhang")
        for p, _ in itertools.groupby(cands, key=lambda t: storages[t].producer):
            later = [t for t in cands if storages[t].producer >= p]
            prob += overhang >= pulp.lpSum(d2h_seconds(problem, storages[t].nbytes) * self.o[t] for t in later) - (
                forward[-1] - forward[p]
            )
        self.cost = (overhang + pulp.lpSum(h2d_cost)) / tunit

    def forward(self, j: int):
        """Offloaded bytes off the device at forward node j."""
        import pulp

        return pulp.lpSum(itertools.chain.from_iterable(self._forward[: j + 1])) if self.o else 0

    def backward(self, k: int):
        """Offloaded bytes off the device at backward step k (and at the recomputes it triggers)."""
        import pulp

        return pulp.lpSum(self._backward[k]) if self.o else 0

    def chosen(self) -> tuple[int, ...]:
        return tuple(sorted(t for t, o in self.o.items() if (o.value() or 0) > 0.5))


class _NoOffload:
    """The terms of a MILP without offloading: nothing leaves the device, nothing costs."""

    cost = 0

    def forward(self, j: int) -> int:
        return 0

    def backward(self, k: int) -> int:
        return 0

    def chosen(self) -> tuple[int, ...]:
        return ()


NO_OFFLOAD = _NoOffload()

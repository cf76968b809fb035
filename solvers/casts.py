"""Autocast's cached casts of parameters where the first recompute empties the cache.

Under autocast a trainable float32 parameter is cast to the autocast dtype once and kept in a cache
that the whole process shares until the outermost autocast context exits. Where the backward runs on a
thread of its own (autograd's device thread on CUDA: `Problem.casts_cleared`), the first recompute enters
autocast as that thread's outermost context, and leaving it empties the cache. The model
(`simulate.replay` walks it event by event, the interval sweep takes `intervals`):

* The forward's casts are held from the step's start to the end of the first recompute, which finds them
  cached. From there a cast stays only while a node that saved it waits for its backward: a node of the
  plain forward, or one whose innermost region is the region that recomputed (`held_until`).
* Every later recompute makes each cast it uses again, at its first reader there, and holds it until
  the backward of the last of its savers in its own context, or to the recompute's end where none saves
  it (`remade`): the cache is empty again when the recompute leaves autocast.
"""

from __future__ import annotations

import numpy as np

from .problem import Cast

__all__ = ["held_until", "remade", "intervals"]


def held_until(cast: Cast, inner: list[int], r: int, s: int, stop: int, k: int) -> int | None:
    """The backward step whose end frees the forward's `cast` once region r's recompute (nodes s..stop,
    triggered at backward step k) has emptied the cache: its holder's with the least index (the backward
    runs from the last node down); None where nothing holds it and it goes at once."""
    held = [j for j in cast.savers if j <= k and (inner[j] == -1 or (inner[j] == r and s <= j <= stop))]
    return min(held) if held else None


def remade(casts: tuple[Cast, ...], inner: list[int], r: int, s: int, stop: int) -> dict[int, list[tuple[int, int | None]]]:
    """The casts region r's recompute (nodes s..stop) makes again: per first reader there, (bytes, the
    backward step of the last of its savers in r's context; None: none saves it)."""
    out: dict[int, list[tuple[int, int | None]]] = {}
    for cast in casts:
        readers = [j for j in cast.readers if s <= j <= stop]
        if readers:
            held = [j for j in cast.savers if s <= j <= stop and inner[j] == r]
            out.setdefault(min(readers), []).append((cast.nbytes, min(held) if held else None))
    return out


def intervals(arrays, inner: np.ndarray, bslot: np.ndarray, passes: np.ndarray, p_s: np.ndarray,
              p_stop: np.ndarray, p_base: np.ndarray, p_len: np.ndarray) -> list[tuple]:
    """The casts as the sweep's (start slot, end slot (exclusive), bytes, category) parts, category 4 for the
    forward's casts and 1 (recomputed) for those a later recompute makes; the recomputes (`passes`) in the
    replay's order, with their first node, stop, first slot and length. # slots and bytes int64"""
    a, big = arrays, np.iinfo(np.int64).max
    m, last = len(a.cast_bytes), len(bslot) - 1
    readers, savers = a.cast_readers, a.cast_savers
    k, c = savers[:, 0], savers[:, 1]
    r0 = passes[0]
    holds = (inner[k] == -1) | ((inner[k] == r0) & (k >= p_s[0]) & (k <= p_stop[0]))
    holder = np.full(m, big, dtype=np.int64)
    np.minimum.at(holder, c[holds], k[holds])
    # A holder whose backward ran before the first recompute (beyond its trigger) frees nothing later.
    emptied = p_base[0] + p_len[0]
    end = np.where(holder < big, np.maximum(emptied, bslot[np.minimum(holder, last)] + 1), emptied)
    parts = [(np.zeros(m, dtype=np.int64), end, a.cast_bytes, 4)]
    for q in range(1, len(passes)):
        s, stop, r = p_s[q], p_stop[q], passes[q]
        lo, hi = np.searchsorted(readers[:, 0], [s, stop + 1])
        if lo == hi:
            continue
        cast, first = np.unique(readers[lo:hi, 1], return_index=True)  # pairs come in node order
        made = readers[lo:hi, 0][first]
        lo, hi = np.searchsorted(savers[:, 0], [s, stop + 1])
        own = savers[lo:hi][inner[savers[lo:hi, 0]] == r]
        holder = np.full(m, big, dtype=np.int64)
        np.minimum.at(holder, own[:, 1], own[:, 0])
        held = holder[cast]
        end = np.where(held < big, bslot[np.minimum(held, last)] + 1, p_base[q] + p_len[q])
        parts.append((p_base[q] + made - s, end, a.cast_bytes[cast], 1))
    return parts

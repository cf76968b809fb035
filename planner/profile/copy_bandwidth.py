"""The device's host copy bandwidth, which prices offload: a kept activation copied to pinned host memory
in the forward (device to host) and fetched back for its backward (host to device).

On a CUDA device both directions are timed with CUDA events on a side stream (the stream offload copies
run on), from and into pinned buffers of a few sizes; the fastest run of the largest size that reaches
the link's rate counts. The figures are kept in the device's timing store (table `copies`, as seconds
per GiB each way: a snapshot that heals like the store's other timings), so every later profile reads
the same bandwidth and plans the same.

Each copy also has a fixed cost, whatever its bytes (`fixed_seconds`): on a launch-bound step a copy of a few
KB costs that and nothing else. Each way it is the device's latency for a small copy (`LATENCY_BYTES`, the
fastest of `REPEATS`, CUDA events on the side stream) plus the offload hooks' own host work per storage
(lower/offload.py: the pack hook, the copy's bookkeeping, its pinned buffer, the stream switch and event at
pack; the fetch at unpack), timed by packing and unpacking small tensors through the real hooks against the
same step without them (`measure_hooks`; on the CPU through their numpy path). It is kept in the store
beside the bandwidth (key `fixed`, seconds each way, healing the same way).

On the CPU the bandwidth is 0: activations already live in host memory, so a copy frees nothing and
the solvers never offload; the plan's notes say so in one line. `OffloadConfig.bandwidth` (optimize's
`offload_bandwidth`) sets a simulated bandwidth instead, for testing and for planning on fake tensors;
`OffloadConfig.fixed_s` a simulated fixed cost (else the hooks' cost measured on the device, or 0 where
node times are not measured either: FLOP-timed profiles and fake tensors).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from .timing_store import open_store

__all__ = ["CopyBandwidth", "copy_bandwidth", "measure_cuda", "measure_latency_cuda", "measure_hooks", "fixed_seconds",
           "free_host_bytes", "offload_note", "describe", "SIZES"]

SIZES = (8 << 20, 64 << 20, 256 << 20)
"""Bytes copied per timed run: small copies pay the launch, the largest shows the link's rate."""
REPEATS = 5
"""Timed runs per size and direction (the fastest counts: load only ever adds time)."""
HEAL = 2 ** -0.5
"""A stored snapshot is replaced by one whose total is at most this times it (the store's two grid steps)."""
GIB = float(1 << 30)
STORE_KEY = "pinned"
FIXED_KEY = "fixed"
LATENCY_BYTES = 4 << 10
"""Bytes of the copy whose time is the link's fixed latency (a few KB: its bytes take nanoseconds)."""
HOOK_STORAGES = 8
"""Storages offloaded per timed step of the hooks (their cost is per storage: more average the timer's noise)."""
MIN_FIXED_S = 1e-7
"""Floor of a measured per-storage cost (seconds): a difference of two noisy times may come out at or below 0."""

_memo: dict[str, CopyBandwidth] = {}
_fixed_memo: dict[str, tuple[float, float]] = {}


@dataclass(frozen=True)
class CopyBandwidth:
    """Host copy bandwidth of one device, each way (bytes/s; 0: offload is not considered)."""

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    source: str
    """'measured' (timed now), 'stored' (the timing store), 'simulated' (given by the caller), 'none'."""
    why: str = ""
    """Why there is none (source 'none'), in a few words."""
    d2h_fixed_s: float = 0.0
    """Seconds each offloaded storage's copy to the host costs beyond its bytes (`fixed_seconds`)."""
    h2d_fixed_s: float = 0.0
    """Seconds each fetch back to the device costs beyond its bytes."""

    @property
    def usable(self) -> bool:
        return self.d2h_bytes_per_s > 0 and self.h2d_bytes_per_s > 0


def copy_bandwidth(device: torch.device | str, *, store: bool = True,
                   simulated: tuple[float, float] | None = None, fixed: tuple[float, float] | None = None,
                   timed: bool = True) -> CopyBandwidth:
    """The bandwidth offload is priced at on `device`: `simulated` when given, measured (or stored) on a
    CUDA device, else none. Measured once per device and process. The fixed cost per storage, each way:
    `fixed` when given; else measured with the bandwidth on CUDA, and with a simulated bandwidth measured
    on `device` where `timed` (the profile measures node times), 0 where not."""
    device = torch.device(device)
    if simulated is not None:
        if fixed is None:
            fixed = fixed_seconds(device, store) if timed and device.type != "meta" else (0.0, 0.0)
        return CopyBandwidth(float(simulated[0]), float(simulated[1]), "simulated", "", float(fixed[0]), float(fixed[1]))
    if device.type == "meta":
        return CopyBandwidth(0.0, 0.0, "none", "on fake tensors, where no copy is timed (offload_bandwidth= gives one)")
    if device.type != "cuda":
        return CopyBandwidth(0.0, 0.0, "none", f"on the {device.type.upper()}, where activations already live in "
                             "host memory: a copy would free nothing")
    key = str(device if device.index is not None else torch.device("cuda", torch.cuda.current_device()))
    if key not in _memo:
        _memo[key] = _stored_or_measured(torch.device(key), store)
    found = _memo[key]
    if not found.usable:
        return found
    d2h_fixed, h2d_fixed = fixed if fixed is not None else fixed_seconds(torch.device(key), store)
    return dataclasses.replace(found, d2h_fixed_s=float(d2h_fixed), h2d_fixed_s=float(h2d_fixed))


def fixed_seconds(device: torch.device, store: bool = True) -> tuple[float, float]:
    """(device to host, host to device) seconds each offloaded storage costs beyond its bytes on `device`: the
    hooks' host work per storage, plus on CUDA a small copy's latency. Measured once per device and process,
    settled against the timing store (a snapshot that heals like the bandwidth); (0, 0) where nothing can be
    timed and nothing is stored."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = str(device)
    if key in _fixed_memo:
        return _fixed_memo[key]
    timings = open_store(device, store)
    try:
        pack, unpack = measure_hooks(device)
        if device.type == "cuda":
            d2h_latency, h2d_latency = measure_latency_cuda(device)
            pack, unpack = pack + d2h_latency, unpack + h2d_latency
    except (RuntimeError, torch.cuda.OutOfMemoryError):  # a full device, no pinned memory: the stored figure or none
        stored = timings.get("copies", FIXED_KEY)
        ok = isinstance(stored, dict) and {"d2h", "h2d"} <= set(stored)
        _fixed_memo[key] = (float(stored["d2h"]), float(stored["h2d"])) if ok else (0.0, 0.0)
        return _fixed_memo[key]
    snapshot = timings.settle("copies", FIXED_KEY, {"d2h": pack, "h2d": unpack}, HEAL)
    timings.save()
    _fixed_memo[key] = (float(snapshot["d2h"]), float(snapshot["h2d"]))
    return _fixed_memo[key]


def measure_latency_cuda(device: torch.device, nbytes: int = LATENCY_BYTES, repeats: int = REPEATS) -> tuple[float, float]:
    """(device to host, host to device) seconds of a copy of `nbytes` between a pinned buffer and `device`,
    each the fastest of `repeats` timed with CUDA events on a side stream (as offload's copies run)."""
    side = torch.cuda.Stream(device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    d2h, h2d = (_fastest_copy(dst, src, side, repeats) for dst, src in ((host, dev), (dev, host)))
    # a copy too short for the events' resolution (inf: none measured) counts as the floor
    return tuple(MIN_FIXED_S if t == float("inf") else max(t, MIN_FIXED_S) for t in (d2h, h2d))


def _fastest_copy(dst: torch.Tensor, src: torch.Tensor, side: Any, repeats: int) -> float:
    """Seconds of the fastest of `repeats` copies of `src` into `dst` on the stream `side`, each timed with CUDA
    events, after one untimed copy (the first maps the buffers); inf where none took measurable time."""
    best = float("inf")
    with torch.cuda.stream(side):
        dst.copy_(src, non_blocking=True)
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(side)
            dst.copy_(src, non_blocking=True)
            end.record(side)
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
            if seconds > 0:
                best = min(best, seconds)
    return best


def measure_hooks(device: torch.device, storages: int = HOOK_STORAGES, repeats: int = REPEATS) -> tuple[float, float]:
    """(pack, unpack) host seconds per offloaded storage of the offload hooks (lower/offload.py) on `device`:
    a chain of `storages` small ops, each output offloaded and saved by the next, run forward and backward
    under the real hooks and without them; the fastest of `repeats` each, the difference per storage
    (at least `MIN_FIXED_S`). Host time only: the copies' device time is `measure_latency_cuda`'s."""
    from ..lower.offload import OffloadHooks, OffloadTarget, offload_begin, offload_mark

    numel = LATENCY_BYTES // 4  # float32 elements of one small storage
    targets = [OffloadTarget(storage=i, node=f"n{i}", output=0, nbytes=LATENCY_BYTES) for i in range(storages)]
    hooks = OffloadHooks(targets)
    x = torch.randn(numel, device=device, requires_grad=True)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def run(offload: bool) -> tuple[float, float]:
        sync()
        t0 = time.perf_counter()
        with hooks.step() if offload else contextlib.nullcontext():
            h = x
            for slot in range(storages):
                if offload:
                    offload_begin()
                h = h.sin()  # sin saves its input: the next one saves this output, the offloaded storage
                if offload:
                    offload_mark(h, ((-1, slot),))
            loss = h.sin().sum()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        sync()
        return t1 - t0, t2 - t1

    fast = {True: [float("inf")] * 2, False: [float("inf")] * 2}
    for _ in range(repeats + 1):  # the first of each is a warm-up: the hooks' host buffers are made there
        for offload in (False, True):
            fwd, bwd = run(offload)
            fast[offload] = [min(fast[offload][0], fwd), min(fast[offload][1], bwd)]
    with_hooks, without = fast[True], fast[False]
    return (max((with_hooks[0] - without[0]) / storages, MIN_FIXED_S),
            max((with_hooks[1] - without[1]) / storages, MIN_FIXED_S))


def _stored_or_measured(device: torch.device, store: bool) -> CopyBandwidth:
    timings = open_store(device, store)
    stored = timings.get("copies", STORE_KEY)
    try:
        d2h, h2d = measure_cuda(device)
    except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # a full device, no pinned memory: no offload
        if isinstance(stored, dict) and {"d2h", "h2d"} <= set(stored):
            return CopyBandwidth(GIB / stored["d2h"], GIB / stored["h2d"], "stored")
        first = str(e).splitlines()[0][:120] if str(e) else type(e).__name__
        return CopyBandwidth(0.0, 0.0, "none", f"on {device}: its copy bandwidth could not be measured ({first})")
    snapshot = timings.settle("copies", STORE_KEY, {"d2h": GIB / d2h, "h2d": GIB / h2d}, HEAL)
    timings.save()
    source = "measured" if snapshot == {"d2h": GIB / d2h, "h2d": GIB / h2d} else "stored"
    return CopyBandwidth(GIB / snapshot["d2h"], GIB / snapshot["h2d"], source)


def measure_cuda(device: torch.device, sizes: tuple[int, ...] = SIZES, repeats: int = REPEATS) -> tuple[float, float]:
    """(device-to-host, host-to-device) bytes/s between pinned host buffers and `device`, timed with CUDA
    events on a side stream: the best rate over `sizes`, each the fastest of `repeats` runs."""
    side = torch.cuda.Stream(device)
    best = [0.0, 0.0]
    for size in sizes:
        host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(size, dtype=torch.uint8, device=device)
        for way, (dst, src) in enumerate(((host, dev), (dev, host))):
            best[way] = max(best[way], size / _fastest_copy(dst, src, side, repeats))
        del host, dev
    if not all(b > 0 for b in best):
        raise RuntimeError("no copy was timed")
    return best[0], best[1]


def free_host_bytes() -> int:
    """Host memory available now (bytes): psutil where installed, else /proc/meminfo's MemAvailable,
    else free pages (os.sysconf); 0 when none can be read."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except (ImportError, OSError, AttributeError):
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


def offload_note(bandwidth: CopyBandwidth, host_budget_bytes: int) -> str | None:
    """One line for the plan's notes where offload was not considered (None where it was)."""
    if bandwidth.source == "none":
        return f"offload: not considered {bandwidth.why}"
    if not bandwidth.usable:
        return "offload: not considered: a copy bandwidth of 0 was given"
    if host_budget_bytes <= 0:
        return "offload: not considered: the host budget is 0 (host_budget_gb)"
    return None


def describe(bandwidth: CopyBandwidth) -> dict[str, Any]:
    """The bandwidth as the plan's stats record it."""
    return {"d2h_bytes_per_s": bandwidth.d2h_bytes_per_s, "h2d_bytes_per_s": bandwidth.h2d_bytes_per_s,
            "d2h_fixed_s": bandwidth.d2h_fixed_s, "h2d_fixed_s": bandwidth.h2d_fixed_s, "source": bandwidth.source}

"""The device's host copy bandwidth, which prices offload: a kept activation copied to pinned host memory
in the forward (device to host) and fetched back for its backward (host to device).

On a CUDA device both directions are timed with CUDA events on a side stream (the stream offload copies
run on), from and into pinned buffers of a few sizes; the fastest run of the largest size that reaches
the link's rate counts. The figures are kept in the device's timing store (table `copies`, as seconds
per GiB each way: a snapshot that heals like the store's other timings), so every later profile reads
the same bandwidth and plans the same.

On the CPU the bandwidth is 0: activations already live in host memory, so a copy frees nothing and
the solvers never offload; the plan's notes say so in one line. `OffloadConfig.bandwidth` (optimize's
`offload_bandwidth`) sets a simulated bandwidth instead, for testing and for planning on fake tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from .timing_store import open_store

__all__ = ["CopyBandwidth", "copy_bandwidth", "measure_cuda", "free_host_bytes", "offload_note", "describe", "SIZES"]

SIZES = (8 << 20, 64 << 20, 256 << 20)
"""Bytes copied per timed run: small copies pay the launch, the largest shows the link's rate."""
REPEATS = 5
"""Timed runs per size and direction (the fastest counts: load only ever adds time)."""
HEAL = 2 ** -0.5
"""A stored snapshot is replaced by one whose total is at most this times it (the store's two grid steps)."""
GIB = float(1 << 30)
STORE_KEY = "pinned"

_memo: dict[str, CopyBandwidth] = {}


@dataclass(frozen=True)
class CopyBandwidth:
    """Host copy bandwidth of one device, each way (bytes/s; 0: offload is not considered)."""

    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    source: str
    """'measured' (timed now), 'stored' (the timing store), 'simulated' (given by the caller), 'none'."""
    why: str = ""
    """Why there is none (source 'none'), in a few words."""

    @property
    def usable(self) -> bool:
        return self.d2h_bytes_per_s > 0 and self.h2d_bytes_per_s > 0


def copy_bandwidth(device: torch.device | str, *, store: bool = True,
                   simulated: tuple[float, float] | None = None) -> CopyBandwidth:
    """The bandwidth offload is priced at on `device`: `simulated` when given, measured (or stored) on a
    CUDA device, else none. Measured once per device and process."""
    device = torch.device(device)
    if simulated is not None:
        return CopyBandwidth(float(simulated[0]), float(simulated[1]), "simulated")
    if device.type == "meta":
        return CopyBandwidth(0.0, 0.0, "none", "on fake tensors, where no copy is timed (offload_bandwidth= gives one)")
    if device.type != "cuda":
        return CopyBandwidth(0.0, 0.0, "none", f"on the {device.type.upper()}, where activations already live in "
                             "host memory: a copy would free nothing")
    key = str(device if device.index is not None else torch.device("cuda", torch.cuda.current_device()))
    if key not in _memo:
        _memo[key] = _stored_or_measured(torch.device(key), store)
    return _memo[key]


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
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)  # warm-up: the first copy maps the buffers
                for _ in range(repeats):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record(side)
                    dst.copy_(src, non_blocking=True)
                    end.record(side)
                    end.synchronize()
                    seconds = start.elapsed_time(end) / 1e3
                    if seconds > 0:
                        best[way] = max(best[way], size / seconds)
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
            "source": bandwidth.source}

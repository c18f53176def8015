"""Peak resident memory per stage, for the line each stage of a pipeline run ends with.

The kernel keeps the process's high-water mark of resident memory (VmHWM in /proc/self/status); GNU time's "Maximum
resident set size" is the same figure at exit (with the largest child's, if larger). Writing "5" to
/proc/self/clear_refs would reset it, but the kernel then forgets the old peak everywhere: getrusage and the exit
status GNU time reads would report only the peak since the last reset. So a stage's peak is measured without one:
the high-water mark when the stage raised it (exact), else the largest resident size sampled while it ran.

Child processes are not in this process's figure: a vLLM engine in its own venv (teacher.engine=vllm,
eval.served.engine=vllm), a producer, an engine-parity check. getrusage(RUSAGE_CHILDREN) gives the largest child that
has ended and been waited for; a child's figure counts this process's resident size when it was forked (so even
`uname -p`, which platform.processor() runs, reads as large as its parent's peak so far), so a stage reports a child
only when one went above this process's own peak so far: then it was the child's own memory.
"""
from __future__ import annotations

import os
import resource
import sys
import threading
from pathlib import Path

STATUS = Path("/proc/self/status")
STATM = Path("/proc/self/statm")
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _maxrss_bytes(who: int) -> int:
    """getrusage's ru_maxrss in bytes: kilobytes on Linux, bytes on macOS."""
    rss = resource.getrusage(who).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def peak_rss() -> int:
    """This process's peak resident memory so far, in bytes."""
    try:
        for line in STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # "VmHWM:   123456 kB"
    except OSError:
        pass
    return _maxrss_bytes(resource.RUSAGE_SELF)


def current_rss() -> int | None:
    """This process's resident memory now, in bytes; None without /proc."""
    try:
        return int(STATM.read_text().split()[1]) * PAGE
    except (OSError, IndexError, ValueError):
        return None


def children_peak() -> int:
    """The largest peak resident memory of any ended, waited-for child process, in bytes (0 when none)."""
    return _maxrss_bytes(resource.RUSAGE_CHILDREN)


def gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB"


class StagePeak:
    """The peak resident memory of what runs inside `with StagePeak() as peak:`; `peak.text()` reads
    `peak 2.1 GB resident`, plus `, largest child 3.4 GB` when a child process it started and waited for went
    above this process's peak so far. A stage that stays below an earlier stage's peak gets the largest size sampled
    every `interval` seconds (an allocation held for less than that can be missed); without /proc, the process's peak
    so far."""

    def __init__(self, interval: float = 0.02):
        self.interval = interval
        self.peak = self.children = self.sampled = 0

    def __enter__(self) -> StagePeak:
        self.before, self.children_before = peak_rss(), children_peak()
        self.sampled = current_rss() or 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="stage-peak", daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.sampled = max(self.sampled, current_rss() or 0)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        now, hwm, children = current_rss(), peak_rss(), children_peak()
        self.sampled = max(self.sampled, now or 0)
        self.peak = hwm if hwm > self.before or now is None else self.sampled
        self.children = children if children > max(self.children_before, hwm) else 0

    def text(self) -> str:
        child = f", largest child {gb(self.children)}" if self.children else ""
        return f"peak {gb(self.peak)} resident{child}"

"""Progress of the long stages (teacher samples, training steps, eval prompts), readable on a terminal and in a log.

On a terminal (stderr is a tty): a live tqdm bar with rate and ETA; console log lines are written above it
(tqdm.contrib.logging.logging_redirect_tqdm), so they never tear the bar.
Otherwise (a log file, CI, SLURM, a pipe): no carriage returns; one plain line when the bar starts, then at most one
per interval, and one when it closes:

    teacher: 96/800 samples, 12.1 samples/s, 310 gen tok/s, elapsed 0:08, ETA 1:02

Only the main process (rank 0) shows anything; every process can still ask a bar for its ETA.

Environment:
    DFLASH_PROGRESS           auto (default: a bar on a tty, else lines), bar, lines, or off
    DFLASH_PROGRESS_INTERVAL  seconds between plain lines (default 30; 0: a line at every update)
    TQDM_DISABLE=1            also turns both off; other TQDM_* settings (e.g. TQDM_MININTERVAL) reach the bar
"""
from __future__ import annotations

import os
import sys
import time

from tqdm import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

MODES = ("auto", "bar", "lines", "off")


def is_main_process() -> bool:
    """Rank 0 of a torch.distributed / accelerate launch (RANK is set by every launcher), or a single process."""
    return os.environ.get("RANK", "0") == "0"


def clock(seconds: float) -> str:
    """0:08, 12:34, 1:02:03."""
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def number(x: float) -> str:
    """310, 12.1, 2.49: three significant digits at most, none after the point from 100 up."""
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def rate_text(per_s: float, unit: str) -> str:
    """`12.1 samples/s`, or `3.20 s/step` below one per second."""
    if 0 < per_s < 1:
        return f"{number(1 / per_s)} s/{unit}"
    return f"{number(per_s)} {unit}s/s"


def _mode(enabled: bool, file) -> str:
    if not enabled or os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true", "yes"):
        return "off"
    mode = os.environ.get("DFLASH_PROGRESS", "auto").lower()
    if mode not in MODES:
        raise ValueError(f"DFLASH_PROGRESS={mode!r}; use one of {', '.join(MODES)}")
    if mode == "auto":
        return "bar" if _is_terminal(file) else "lines"
    return mode


def _is_terminal(file) -> bool:
    """A tty with a width (a pty of 0 columns, as some wrappers allocate, would get empty bars)."""
    try:
        return file.isatty() and os.get_terminal_size(file.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):
        return False


class Progress:
    """Count `total` units of work (floats allowed: a sample half done counts 0.5; the display floors), plus any
    number of side counters shown as rates (`add("gen tok", n)` -> `310 gen tok/s`).

    initial: work already done before this run (a resumed stage); rates and ETA count only what this run does.
    enabled: show anything at all (default: on the main process only).
    Use as a context manager, or call close(): on a terminal the bar holds the console log handlers until then.
    """

    def __init__(self, desc: str, total: float, unit: str, *, initial: float = 0, enabled: bool | None = None,
                 file=None):
        self.desc, self.total, self.unit = desc, total, unit
        self.n = self.initial = initial
        self.extras: dict[str, float] = {}
        self.file = file or sys.stderr
        self.mode = _mode(is_main_process() if enabled is None else enabled, self.file)
        self.start = self._last = time.monotonic()
        self._bar, self._redirect, self.closed = None, None, False
        if self.mode == "bar":
            self._redirect = logging_redirect_tqdm()
            self._redirect.__enter__()
            self._bar = tqdm(total=total, initial=int(initial), desc=desc, unit=unit, file=self.file,
                             dynamic_ncols=True)
        elif self.mode == "lines":
            self.interval = float(os.environ.get("DFLASH_PROGRESS_INTERVAL", "30"))
            self._line()

    # -- counting -------------------------------------------------------------------------------------------------
    def update(self, n: float = 1) -> None:
        if not n:
            return
        self.n += n
        if self._bar is not None:
            whole = int(self.n + 1e-9) - self._bar.n
            if whole:
                self._bar.update(whole)
        elif self.mode == "lines":
            self._maybe_line()

    def add(self, name: str, n: float) -> None:
        """Count n of a side quantity (e.g. generated tokens); shown as its rate since the start."""
        self.extras[name] = self.extras.get(name, 0) + n
        if self._bar is not None:
            now = time.monotonic()
            if now - self._last >= self._bar.mininterval:  # redraw at the bar's own pace, not per call
                self._last = now
                self._bar.set_postfix_str(self._extras_text(), refresh=True)
        elif self.mode == "lines":
            self._maybe_line()

    # -- what it says ---------------------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def rate(self) -> float | None:
        """Units per second done by this run, or None before the first."""
        done, t = self.n - self.initial, self.elapsed()
        return done / t if done > 0 and t > 0 else None

    def eta(self) -> float | None:
        """Seconds left at this run's average rate, or None while unknown."""
        r = self.rate()
        return max(0.0, self.total - self.n) / r if r else None

    def eta_text(self) -> str:
        eta = self.eta()
        return "?" if eta is None else clock(eta)

    def summary(self) -> str:
        """`96/800 samples, 12.1 samples/s, 310 gen tok/s, elapsed 0:08, ETA 1:02`; unknown parts are left out, and
        the ETA reads `done` at the end."""
        total = int(self.total) if float(self.total).is_integer() else self.total
        n = int(self.n + 1e-9)
        parts = [f"{n}/{total} {self.unit}s" + (" (resumed)" if self.initial and n == self.initial else "")]
        r = self.rate()
        if r:
            parts.append(rate_text(r, self.unit))
        if self.extras and self.elapsed() > 0:
            parts.append(self._extras_text())
        parts.append(f"elapsed {clock(self.elapsed())}")
        if n >= self.total:
            parts.append("done")
        elif r:
            parts.append(f"ETA {self.eta_text()}")
        return ", ".join(parts)

    def _extras_text(self) -> str:
        t = max(self.elapsed(), 1e-9)
        return ", ".join(f"{number(v / t)} {k}/s" for k, v in self.extras.items())

    def _line(self) -> None:
        self._last = time.monotonic()
        self.file.write(f"{self.desc}: {self.summary()}\n")
        self.file.flush()

    def _maybe_line(self) -> None:
        if time.monotonic() - self._last >= self.interval:
            self._line()

    # -- the end --------------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._bar is not None:
            if self.extras:
                self._bar.set_postfix_str(self._extras_text(), refresh=False)
            self._bar.close()
            self._redirect.__exit__(None, None, None)
        elif self.mode == "lines":
            self._line()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # a stage that raised: give the console log handlers back (no final line)
        try:
            if self._bar is not None:
                self.close()
        except Exception:
            pass

"""The spool: a folder through which a feature producer (data/producer.py) hands the target's features to the
trainer (trainer.features=producer), so that no trainer process loads the target's body.

Layout (every file written under a temporary name and renamed when complete, so a reader never sees half a file):
  spool.json                   what the features are of: the sample order's key (seed, batch, steps, dataset, taps),
                               the dtype; written by whoever comes first, checked by everyone after
  heldout.safetensors          features of the held-out sequences (index int64 (n,), features.<j> (T_j, taps*H))
  step-0000123.safetensors     features of the global batch of step 123, slot by slot (index, features.<slot>)
  read-<rank>.json             the step trainer rank <rank> reads: the producer keeps the steps from the slowest
                               rank's on, at most producer.capacity of them (backpressure), and deletes the others
  committed.json               the step of the trainer's last checkpoint (the position it resumes from); the
                               producer ends once it reaches trainer.steps
  producer.json                the producer's heartbeat (pid, host, step, time); `done` when it has ended
A step file holds every slot of the global batch; each rank reads its own slots only, so ranks see disjoint samples.
A trainer resumed from a checkpoint marks the checkpoint's step as the one it reads, and the producer writes the
steps from there again (deleted ones included): the spool holds at most producer.capacity step files.
"""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from dflash_pipeline.runtime.files import save_safetensors, write_json
from dflash_pipeline.data.shards import DatasetError

POLL_S = 0.05  # how often a waiting side looks again


class SpoolError(DatasetError):
    """A spool that cannot feed this run (another run's, a producer gone quiet), with the fix in the message."""


class Spool:
    """One spool folder, for either side: the producer's writes and waits, the trainer's reads and marks. `key` is
    what the run's features are of (refused when the folder holds another's); wait_s, how long a side waits."""

    def __init__(self, folder: str | Path, key: dict, wait_s: float):
        self.folder, self.key, self.wait_s = Path(folder), key, wait_s
        self.folder.mkdir(parents=True, exist_ok=True)
        info = self.folder / "spool.json"
        if info.is_file():
            theirs = json.loads(info.read_text())["key"]
            if theirs != key:
                diff = ", ".join(f"{k}: {theirs.get(k)!r} -> {v!r}" for k, v in key.items() if theirs.get(k) != v)
                raise SpoolError(f"{self.folder} spools the features of another run ({diff}): give this run its own "
                                 "producer.spool, or delete the folder")
        else:
            write_json(info, {"key": key})

    # -- files ----------------------------------------------------------------------------------------------
    def step_file(self, step: int) -> Path:
        return self.folder / f"step-{step:07d}.safetensors"

    @property
    def heldout_file(self) -> Path:
        return self.folder / "heldout.safetensors"

    def _mark(self, name: str) -> int | None:
        path = self.folder / name
        return json.loads(path.read_text())["step"] if path.is_file() else None

    # -- producer side --------------------------------------------------------------------------------------
    def write(self, path: Path, indices: list[int], features: list[torch.Tensor]) -> None:
        tensors = {"index": torch.tensor(indices, dtype=torch.int64)}
        tensors.update({f"features.{j}": f.contiguous() for j, f in enumerate(features)})
        save_safetensors(tensors, path)

    def committed(self) -> int:
        return self._mark("committed.json") or 0

    def slowest_reader(self) -> int:
        """The lowest step any trainer rank reads (the last checkpoint's step before a trainer has read)."""
        marks = [json.loads(p.read_text())["step"] for p in self.folder.glob("read-*.json")]
        return min(marks) if marks else self.committed()

    def heartbeat(self, step: int, done: bool = False) -> None:
        write_json(self.folder / "producer.json", {"pid": os.getpid(), "host": socket.gethostname(), "step": step,
                                                   "time": time.time(), "done": done})

    def next_step(self, capacity: int, steps: int) -> int | None:
        """The step to write next: the first missing one of the `capacity` steps from the slowest rank's; None when
        they are all there (the producer waits). Steps before the slowest rank's are deleted first."""
        low = self.slowest_reader()
        self.drop_before(low)
        return next((s for s in range(low, min(low + capacity, steps)) if not self.step_file(s).is_file()), None)

    def wait_for_room(self, capacity: int, steps: int, on_wait=None) -> int | None:
        """next_step, waiting (calling on_wait) while there is none, until the trainer's last checkpoint reaches
        `steps` (then None: the run is over); a trainer silent for wait_s is an error."""
        start = beat = time.monotonic()
        while self.committed() < steps:
            step = self.next_step(capacity, steps)
            if step is not None:
                return step
            if on_wait is not None and time.monotonic() - beat > 1.0:
                on_wait()
                beat = time.monotonic()
            if time.monotonic() - start > self.wait_s:
                raise SpoolError(f"no trainer has read from {self.folder} for {self.wait_s:.0f} s: is it running? "
                                 "(raise producer.wait_s above the trainer's longest pause, e.g. its held-out "
                                 "evaluation)")
            time.sleep(POLL_S)
        return None

    def drop_before(self, step: int) -> None:
        for path in self.folder.glob("step-*.safetensors"):
            if int(path.stem.split("-")[1]) < step:
                path.unlink(missing_ok=True)

    # -- trainer side ---------------------------------------------------------------------------------------
    def mark_read(self, rank: int, step: int) -> None:
        write_json(self.folder / f"read-{rank}.json", {"step": step})

    def commit(self, step: int) -> None:
        write_json(self.folder / "committed.json", {"step": step})

    def read(self, path: Path, slots: list[int], indices: list[int], check=None) -> list[torch.Tensor]:
        """The features of `slots` of a step (or held-out) file, waiting for it (calling `check` while it waits,
        which may raise: e.g. a producer this process started has died); checks that they are of the samples
        `indices` (the trainer's own order)."""
        while True:
            self._wait_for(path, check)
            try:
                return self._read(path, slots, indices)
            except FileNotFoundError:  # deleted between the look and the open (a producer going back): wait again
                continue

    def _read(self, path: Path, slots: list[int], indices: list[int]) -> list[torch.Tensor]:
        try:
            with safe_open(path, framework="pt") as f:
                stored = f.get_tensor("index")
                got = [stored[s].item() for s in slots]
                if got != list(indices):
                    raise SpoolError(f"{path} holds samples {got}, this trainer expects {list(indices)}: the producer "
                                     "was started with another config; start it with the trainer's overrides")
                return [f.get_tensor(f"features.{s}") for s in slots]
        except SafetensorError as e:
            raise SpoolError(f"{path} is not a readable spool file ({e}): delete it and restart the producer") from e

    def _wait_for(self, path: Path, check=None) -> None:
        """Wait for `path`; a producer whose heartbeat is older than wait_s (none: since the wait began) is an
        error."""
        start = time.monotonic()
        while not path.is_file():
            if check is not None:
                check()
            beat = self.folder / "producer.json"
            last = json.loads(beat.read_text())["time"] if beat.is_file() else None
            waited = time.monotonic() - start  # at least wait_s: a new producer's first heartbeat may be coming
            quiet = waited if last is None else min(waited, time.time() - last)
            if quiet > self.wait_s:
                raise SpoolError(f"no features at {path} and no word from a producer for {quiet:.0f} s: start "
                                 "`dflash-producer` with this run's overrides (README, 'Features from an engine'), "
                                 "or raise producer.wait_s")
            time.sleep(POLL_S)

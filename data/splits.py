"""Deterministic choices shared by every stage: the held-out split of a teacher dataset and per-step seeds.

Both are functions of ids and seeds only, so the same samples are held out, and step s draws the same batch, in
every run, process and stage (training, component training and evaluation agree on what is held out).
"""
from __future__ import annotations

import functools
import hashlib

import torch


def step_seed(*parts) -> int:
    """A seed derived from (seed, step, ...): the batch of a step never depends on how the run was interrupted."""
    return int(hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:15], 16)


PREFILLED = "prefill:"  # the id prefix of a sample whose replies are the dataset's own (data/teacher.py)


def split_heldout(ids: list[str], num_heldout: int, num_train: int | None = None) -> tuple[list[int], list[int]]:
    """Deterministic train / held-out indices by id hash: the same samples are held out on every run.

    num_train: train on only the next num_train samples in hash order (None: all the rest). Smaller subsets are
    nested in larger ones and share the held-out split, which is what a data-scaling curve compares. Samples the
    target regenerated are held out before prefilled ones (ids starting "prefill:", teacher.mode=mixed): held-out
    metrics then measure what decoding meets, the target's own replies."""
    order = sorted(range(len(ids)), key=lambda i: hashlib.sha256(ids[i].encode()).hexdigest())
    candidates = [i for i in order if not ids[i].startswith(PREFILLED)] + \
        [i for i in order if ids[i].startswith(PREFILLED)]
    held = set(candidates[:num_heldout])
    rest = [i for i in order if i not in held]
    rest = rest if num_train is None else rest[:num_train]
    return sorted(rest), sorted(held)


@functools.lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The shuffled order of n training samples in `epoch` (a function of seed and epoch only)."""
    gen = torch.Generator().manual_seed(step_seed(seed, "epoch", epoch))
    return torch.randperm(n, generator=gen)


def step_batch(train_idx: list[int], step: int, batch_size: int, seed: int) -> list[int]:
    """Dataset indices of the global batch of `step`: consecutive slices of per-epoch permutations of train_idx."""
    n, out = len(train_idx), []
    for pos in range(step * batch_size, (step + 1) * batch_size):
        epoch, j = divmod(pos, n)
        out.append(train_idx[int(_epoch_order(n, seed, epoch)[j])])
    return out


class TokenBudgetSteps:
    """Global batches by a token budget (trainer.tokens_per_step): consecutive sequences of the same per-epoch
    permutations as step_batch, each step taking sequences until their tokens reach `budget` (at most `most`; a
    sequence longer than the budget is a step alone). Returned longest first, so the micro-batches cut from them
    (split_points) hold sequences of like lengths and little padding. A function of (seed, step) alone, never of the
    process count: a checkpoint resumes on any number of processes to the same steps. A step's start is the sum of the
    steps before it, computed once and kept."""

    def __init__(self, train_idx: list[int], length, seed: int, budget: int, most: int):
        self.train_idx, self.length, self.seed, self.budget, self.most = train_idx, length, seed, budget, most
        self.starts = [0]

    def _index(self, pos: int) -> int:
        epoch, j = divmod(pos, len(self.train_idx))
        return self.train_idx[int(_epoch_order(len(self.train_idx), self.seed, epoch)[j])]

    def __call__(self, step: int) -> list[int]:
        while len(self.starts) <= step + 1:
            pos, tokens = self.starts[-1], 0
            while pos == self.starts[-1] or (tokens < self.budget and pos - self.starts[-1] < self.most):
                tokens += self.length(self._index(pos))
                pos += 1
            self.starts.append(pos)
        out = [self._index(p) for p in range(self.starts[step], self.starts[step + 1])]
        return sorted(out, key=lambda i: -self.length(i))


def split_points(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """(start, stop) of `parts` contiguous runs of items whose sizes add up about evenly (the micro-batches of a step
    over processes x grad_accum): equal counts when the sizes are equal. With fewer items than parts (a token-budget
    step of a few long sequences), one item each to the first runs and the last runs empty (start == stop)."""
    if len(sizes) < parts:
        return [(min(i, len(sizes)), min(i + 1, len(sizes))) for i in range(parts)]
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    cuts = [0]
    for p in range(1, parts):
        i = cuts[-1] + 1
        while i < len(sizes) - (parts - p) and prefix[i] * parts < prefix[-1] * p:
            i += 1
        cuts.append(i)
    cuts.append(len(sizes))
    return list(zip(cuts[:-1], cuts[1:]))


def anchor_generators(seed: int, step: int, slot0: int, count: int) -> list[torch.Generator]:
    """One generator per sequence of a micro-batch, seeded by (step, slot in the global batch): any split of the
    global batch over processes and micro-batches draws the same anchors."""
    return [torch.Generator().manual_seed(step_seed(seed, "anchors", step, slot0 + s)) for s in range(count)]

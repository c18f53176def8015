"""Deterministic choices shared by every stage: the held-out split of a teacher dataset and per-step seeds.

Both are functions of ids and seeds only, so the same samples are held out, and step s draws the same batch, in
every run, process and stage (training, component training and evaluation agree on what is held out).
"""
from __future__ import annotations

import hashlib


def step_seed(*parts) -> int:
    """A seed derived from (seed, step, ...): the batch of a step never depends on how the run was interrupted."""
    return int(hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()[:15], 16)


def split_heldout(ids: list[str], num_heldout: int) -> tuple[list[int], list[int]]:
    """Deterministic train / held-out indices by id hash: the same samples are held out on every run."""
    order = sorted(range(len(ids)), key=lambda i: hashlib.sha256(ids[i].encode()).hexdigest())
    held = sorted(order[:num_heldout])
    held_set = set(held)
    return [i for i in range(len(ids)) if i not in held_set], held

"""Benchmark: packed multi-anchor drafter training against a loop that trains one block per forward, with the same
anchors, model, data and machine, in one run (alternating A B B A; medians).

    python scripts/bench_train.py [--steps 4] [--repeats 2] [overrides ...]
    e.g. python scripts/bench_train.py experiment=smollm2_quick trainer.data_dir=runs/smollm2_quick/teacher

Prints anchor-blocks/s of both and the ratio (target >= 5x on 2 CPU cores).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from hydra import compose, initialize_config_module

from dflash_pipeline.conf.schema import register
from dflash_pipeline.runtime.stages import given_teacher
from dflash_pipeline.train.component import StageInputs
from dflash_pipeline.train.drafter import DrafterComponent


def single_blocks(batch: dict) -> list[dict]:
    """Every real block of a packed batch as its own batch of one sequence with one anchor."""
    out = []
    for b in range(batch["anchor_pos"].shape[0]):
        n = int(batch["context_valid"][b].sum())
        for j in batch["anchor_valid"][b].nonzero().squeeze(-1).tolist():
            one = {k: batch[k][b: b + 1] for k in ("features", "context_valid")}
            one["features"], one["context_valid"] = one["features"][:, :n], one["context_valid"][:, :n]
            for k in ("block_ids", "anchor_pos", "anchor_valid", "labels", "label_valid", "topk_ids", "topk_logprobs"):
                if k in batch:
                    one[k] = batch[k][b: b + 1, j: j + 1]
            out.append(one)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per timed run")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    register()
    with initialize_config_module(config_module="dflash_pipeline.conf", version_base=None):
        cfg = compose("config", overrides=["experiment=smollm2_quick", "trainer.data_dir=runs/smollm2_quick/teacher",
                                           *args.overrides])
    comp = DrafterComponent(cfg, StageInputs(given_teacher(cfg)), torch.device("cpu"))
    opt = torch.optim.AdamW(comp.model.parameters(), lr=1e-4)
    batches = [comp.batch(comp.step_items(s), s) for s in range(args.steps)]
    blocks = sum(int(b["anchor_valid"].sum()) for b in batches)

    def packed():
        for b in batches:
            loss, _ = comp.loss(comp.model, b)
            (loss / comp.normaliser(b)).backward()
            opt.step()
            opt.zero_grad()

    def one_per_forward():
        for b in batches:
            norm = comp.normaliser(b)
            for one in single_blocks(b):
                loss, _ = comp.loss(comp.model, one)
                (loss / norm).backward()
            opt.step()
            opt.zero_grad()

    def timed(fn):
        t0 = time.perf_counter()
        fn()
        return blocks / (time.perf_counter() - t0)

    timed(packed)  # warm-up
    rates = {"packed": [], "single": []}
    for _ in range(args.repeats):
        rates["single"].append(timed(one_per_forward))
        rates["packed"].append(timed(packed))
        rates["packed"].append(timed(packed))
        rates["single"].append(timed(one_per_forward))
    p, s = statistics.median(rates["packed"]), statistics.median(rates["single"])
    print(f"{blocks} anchor-blocks per run ({args.steps} steps x {cfg.trainer.batch_sequences} sequences x <= "
          f"{cfg.trainer.anchors_per_sequence} anchors), block {comp.block_size}, {comp.dconf.num_hidden_layers} layers, "
          f"vocab {cfg.trainer.draft_vocab_size or 'full'}")
    print(f"one block per forward: {s:8.1f} anchor-blocks/s")
    print(f"packed multi-anchor:   {p:8.1f} anchor-blocks/s")
    print(f"ratio: {p / s:.1f}x")


if __name__ == "__main__":
    main()

"""Benchmark: what DFlash2's convolution and selector cost, side by side in one run on the same data and machine:
a training step (loss, backward, AdamW) and a drafting round (the new context into the drafter's cache, the block
forward, the logits, and for the selector its top-K and greedy walk) of four drafters: DFlash (chain), DFlash + the
joint selector, the convolution, the convolution + the joint selector. Runs alternate (A B C D D C B A); medians and
ratios to the chain are printed.

    python scripts/bench_dflash2.py [--steps 3] [--repeats 3] [--rounds 20] [overrides ...]
    e.g. python scripts/bench_dflash2.py experiment=smollm2_quick trainer.data_dir=runs/smollm2_quick/teacher \\
         drafter.conv_kernel_size=3 drafter.conv_group_size=32

The overrides configure the convolution variants (their drafter.conv_kernel_size, default 3); the chain and
selector variants run with the convolution off.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from hydra import compose, initialize_config_module

from dflash_pipeline.conf.schema import register
from dflash_pipeline.runtime.stages import given_teacher
from dflash_pipeline.models.selector import top_candidates
from dflash_pipeline.train.component import StageInputs
from dflash_pipeline.train.drafter import DrafterComponent, drafter_of

VARIANTS = {"chain": (False, False), "selector": (False, True), "conv": (True, False), "conv+selector": (True, True)}


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def component(overrides: list[str], conv: bool, selector: bool) -> DrafterComponent:
    register()
    extra = [] if conv else ["drafter.conv_kernel_size=0"]
    if conv and not any(o.startswith("drafter.conv_kernel_size=") for o in overrides):
        extra.append("drafter.conv_kernel_size=3")
    with initialize_config_module(config_module="dflash_pipeline.conf", version_base=None):
        cfg = compose("config", overrides=["experiment=smollm2_quick", "trainer.data_dir=runs/smollm2_quick/teacher",
                                           *overrides, *extra, f"trainer.selector_loss_weight={1.0 if selector else 0}"])
    torch.manual_seed(0)
    return DrafterComponent(cfg, StageInputs(given_teacher(cfg)), torch.device("cpu"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps per timed training run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=20, help="drafting rounds per timed run")
    ap.add_argument("--context", type=int, default=256, help="context tokens in the drafter's cache")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    comps = {name: component(args.overrides, *flags) for name, flags in VARIANTS.items()}
    first = next(iter(comps.values()))
    batches = [first.batch(first.step_items(s), s) for s in range(args.steps)]
    opts = {n: torch.optim.AdamW(c.model.parameters(), lr=1e-4) for n, c in comps.items()}
    g = torch.Generator().manual_seed(0)
    width = batches[0]["features"].shape[-1]
    context = torch.randn(1, args.context, width, generator=g)
    B = first.block_size

    def train(name):
        comp = comps[name]
        t0 = time.perf_counter()
        for b in batches:
            loss, _ = comp.loss(comp.model, b)
            (loss / comp.normaliser(b)).backward()
            opts[name].step()
            opts[name].zero_grad()
        return (time.perf_counter() - t0) / len(batches)

    @torch.no_grad()
    def draft(name):
        comp = comps[name]
        drafter = drafter_of(comp.model)
        selector = getattr(comp.model, "selector", None)
        cache = drafter.new_cache()
        drafter.extend_cache(context, torch.arange(args.context), cache)
        block = torch.full((1, B), drafter.config.mask_token_id)
        t0 = time.perf_counter()
        for r in range(args.rounds):
            n = args.context + r * B
            hidden = drafter.forward_step(torch.randn(1, B, width, generator=g), torch.arange(n, n + B), block,
                                          torch.arange(n + B, n + 2 * B), cache)
            logits = drafter.logits(hidden[:, 1:])
            if selector is None:
                logits.argmax(-1)
            else:
                cand, U = top_candidates(logits, selector.top_k, drafter.to_target_ids)
                selector.greedy_walk(cand, U, hidden[:, 1:].float(), block[:, 0])
        return (time.perf_counter() - t0) / args.rounds

    order = list(comps) + list(comps)[::-1]
    for fn in (train, draft):  # warm-up
        for name in comps:
            fn(name)
    times = {"train": {n: [] for n in comps}, "draft": {n: [] for n in comps}}
    for _ in range(args.repeats):
        for name in order:
            times["train"][name].append(train(name))
            times["draft"][name].append(draft(name))
    c = first.cfg
    print(f"{cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}; block {B}, "
          f"{first.dconf.num_hidden_layers} layer(s), hidden {first.dconf.hidden_size}, vocabulary "
          f"{c.trainer.draft_vocab_size or 'full'}; convolution {comps['conv'].dconf.conv_kernel_size} taps, groups of "
          f"{comps['conv'].dconf.conv_group_size}; selector top-{c.selector.top_k}, rank {c.selector.rank}")
    print(f"training: {args.steps} steps of {c.trainer.batch_sequences} sequences x <= "
          f"{c.trainer.anchors_per_sequence} anchors; drafting: {args.rounds} rounds after {args.context} context "
          f"tokens; medians of {2 * args.repeats}")
    print("| drafter | train s/step | x chain | draft ms/round | x chain |")
    print("|---|---|---|---|---|")
    base = {k: statistics.median(v["chain"]) for k, v in times.items()}
    for name in comps:
        tr, dr = statistics.median(times["train"][name]), statistics.median(times["draft"][name])
        print(f"| {name} | {tr:.3f} | {tr / base['train']:.2f} | {1000 * dr:.1f} | {dr / base['draft']:.2f} |")


if __name__ == "__main__":
    main()

"""What a recurrent target's rollback costs, both ways side by side (models/cache.py Rollback): per round, the verify
forward of a block plus the rollback to the committed tokens, for each number of accepted drafts, in units of the
same run's 1-token decode step; and the verify-cost curve c(n) with each rollback inside it.

    python scripts/bench_rollback.py --family qwen3_next --block 8
    python scripts/bench_rollback.py --target <model folder>

Runs alternate record / replay per repeat and report medians of per-repeat ratios (a slow spell cancels out).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from dflash_pipeline.models import cache as target_cache

sys.path.insert(0, str(Path(__file__).parent))
import tiny_target  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen3_next", help="a tiny family (scripts/tiny_target.py --list)")
    p.add_argument("--target", help="a model folder instead of a tiny family")
    p.add_argument("--hidden", type=int, default=256, help="hidden size of the tiny family (wider: closer to real)")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args(argv)
    folder = a.target
    if not folder:
        tiny_target.COMMON.update(hidden_size=a.hidden, intermediate_size=4 * a.hidden)
        tiny_target.FAMILIES.update(tiny_target._families())
        folder = tiny_target.build(a.family, Path(tempfile.mkdtemp()) / a.family, tiny_target.smollm2_tokenizer())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if not target_cache.is_recurrent(model):
        raise SystemExit(f"{type(model).__name__} has no recurrent layers: its rollback is a crop")
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.get_text_config(decoder=True).vocab_size, (1, a.context + a.block))
    L, B = a.context, a.block
    states = {}
    for strategy in target_cache.ROLLBACKS:
        cache = target_cache.new_cache(model)
        with torch.no_grad():
            model(input_ids=ids[:, :L], cache=cache, use_cache=True)
        rb = target_cache.Rollback(model, strategy)
        rb.start(cache, B)
        states[strategy] = (cache, rb, target_cache.snapshot(cache))
    pos = torch.arange(L, L + B)[None]
    times = {(s, m): [] for s in target_cache.ROLLBACKS for m in range(B)}
    verify_only = {s: [] for s in target_cache.ROLLBACKS}
    step = {s: [] for s in target_cache.ROLLBACKS}
    with torch.no_grad():
        for r in range(a.repeats + 1):
            for strategy, (cache, rb, at_l) in states.items():
                def timed(run) -> float:
                    t0 = time.perf_counter()
                    run()
                    dt = time.perf_counter() - t0
                    target_cache.restore(cache, at_l)
                    return dt
                s1 = timed(lambda: model(input_ids=ids[:, L:L + 1], position_ids=pos[:, :1], cache=cache,
                                         use_cache=True))
                v = timed(lambda: model(input_ids=ids[:, L:L + B], position_ids=pos, cache=cache, use_cache=True))
                if r:
                    step[strategy].append(s1)
                    verify_only[strategy].append(v / s1)
                for m in range(B):  # m accepted drafts: keep the anchor and m drafts
                    def round_():
                        rb.before(cache)
                        model(input_ids=ids[:, L:L + B], position_ids=pos, cache=cache, use_cache=True)
                        rb.after(cache, L + m + 1, ids[:, L:L + m + 1], pos[:, :m + 1])
                    dt = timed(round_)
                    if r:
                        times[(strategy, m)].append(dt / s1)
    med = statistics.median
    print(f"{type(model).__name__}, context {L}, block {B}, {a.repeats} repeats, {torch.get_num_threads()} threads; "
          f"units: the same run's 1-token decode step ({1e3 * med(step['record']):.2f} ms record, "
          f"{1e3 * med(step['replay']):.2f} ms replay)")
    print("| accepted drafts | " + " | ".join(str(m) for m in range(B)) + " |")
    print("|---|" + "---|" * B)
    for s in target_cache.ROLLBACKS:
        print(f"| verify {B} + rollback, {s} | " + " | ".join(f"{med(times[(s, m)]):.2f}" for m in range(B)) + " |")
    for s in target_cache.ROLLBACKS:
        print(f"verify {B} alone, {s} cache: {med(verify_only[s]):.2f}")


if __name__ == "__main__":
    main()

"""Benchmark: teacher generation throughput: the teacher's batched, length-bucketed decoding against a plain loop that calls
`model.generate` one prompt at a time, same target, same prompts, same machine, one run.

    python scripts/bench_teacher.py [--prompts 32] [--max-new-tokens 96] [--dtype float32] [--repeats 1]

Prints generated tokens/s of both, their ratio (target >= 10x on 2 CPU cores), the cost of the feature-capture
prefill pass, and how many replies are identical between the two (greedy; batching may flip near-ties).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from hydra import compose, initialize_config_module

from dflash_pipeline.conf.schema import register
from dflash_pipeline.data.sources import load_conversations
from dflash_pipeline.data.teacher import add_features, chat_segments, regenerate
from dflash_pipeline.models.target import load_target, resolve_layer_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=1, help="alternate baseline/teacher runs; medians reported")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. target=tiny")
    args = ap.parse_args()

    register()
    with initialize_config_module(config_module="dflash_pipeline.conf", version_base=None):
        cfg = compose("config", overrides=[f"teacher.max_new_tokens={args.max_new_tokens}",
                                           f"target.dtype={args.dtype}", "teacher.max_turns=1", *args.overrides])
    target = load_target(cfg.target, cfg.cache_dir)
    tok = target.tokenizer
    convs = load_conversations(cfg.data.source, limit=args.prompts, tokenizer=tok,
                               max_prompt_tokens=cfg.data.max_prompt_tokens, log=lambda s: None)
    prompts = [chat_segments(tok, c["messages"], 1)[0] for c in convs]
    layer_ids = resolve_layer_ids(None, cfg.teacher.num_taps, target.num_layers)
    print(f"target {target.ref} ({args.dtype}), {len(prompts)} prompts, mean prompt "
          f"{statistics.mean(map(len, prompts)):.0f} tokens, max_new_tokens {args.max_new_tokens}, "
          f"{torch.get_num_threads()} threads")

    def baseline():
        replies = []
        for p in prompts:
            out = target.model.generate(input_ids=torch.tensor([p]), max_new_tokens=args.max_new_tokens,
                                        do_sample=False, eos_token_id=sorted(target.eos_ids),
                                        pad_token_id=tok.pad_token_id)
            replies.append(out[0, len(p):].tolist())
        return replies

    def teacher():
        samples = regenerate(target, convs, cfg, cfg.seed)
        t0 = time.perf_counter()
        add_features(target, samples, layer_ids, cfg)
        return [s["input_ids"][len(p):] for s, p in zip(samples, prompts)], time.perf_counter() - t0

    base_rates, teach_rates, capture_share = [], [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        base = baseline()
        t1 = time.perf_counter()
        ours, capture_s = teacher()
        t2 = time.perf_counter()
        base_rates.append(sum(map(len, base)) / (t1 - t0))
        teach_rates.append(sum(map(len, ours)) / (t2 - t1 - capture_s))
        capture_share.append(capture_s / (t2 - t1))
    same = sum(a == b for a, b in zip(base, ours))
    b, t = statistics.median(base_rates), statistics.median(teach_rates)
    print(f"one prompt at a time (model.generate): {b:8.1f} generated tok/s")
    print(f"teacher (batched, bucketed, rows leave when done): {t:8.1f} generated tok/s")
    print(f"ratio: {t / b:.1f}x   feature capture pass: {100 * statistics.median(capture_share):.0f}% of teacher "
          f"time   identical replies: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()

"""Benchmark: the adaptive block policy with a useless drafter must cost little over autoregressive decoding.

    python scripts/bench_adaptive.py [--prompts 4] [--max-new-tokens 96] [--repeats 2] [overrides ...]

An untrained (random) drafter on the configured target (default: the embedded SmolLM2) accepts almost nothing. The
adaptive policy should then stop drafting and run plain target steps, probing now and then. Prints, side by side in
one run (AR, adaptive, chain, AR per prompt and repeat, one thread): median time per token of each against
autoregressive decoding, the rounds that ran the drafter, and exactness. Target: adaptive / AR <= 1.10.
"""
from __future__ import annotations

import statistics

import torch
from omegaconf import OmegaConf

from dflash_pipeline.cli.entrypoints import compose_run, measurement_parser
from dflash_pipeline.conf.schema import PolicyConfig
from dflash_pipeline.data.sources import load_conversations
from dflash_pipeline.data.teacher import chat_segments
from dflash_pipeline.eval.decode import autoregressive, speculative
from dflash_pipeline.eval.protocol import ChainMethod
from dflash_pipeline.eval.policies import AdaptiveMethod, EvalContext, measure_costs
from dflash_pipeline.models.drafter import DFlashDrafter
from dflash_pipeline.models.families import resolve_layer_ids
from dflash_pipeline.models.target import load_target
from dflash_pipeline.train.drafter import drafter_config


def main() -> None:
    ap = measurement_parser(__doc__, prompts=4, threads=1)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = compose_run(["drafter.num_layers=2", *args.overrides])
    target = load_target(cfg.target, cfg.cache_dir)
    tok = target.tokenizer
    convs = load_conversations("mtbench", limit=args.prompts, tokenizer=tok, max_prompt_tokens=512, log=lambda s: None)
    prompts = [chat_segments(tok, c["messages"], 1)[0] for c in convs]
    torch.manual_seed(0)
    layer_ids = resolve_layer_ids(None, cfg.teacher.num_taps, target.num_layers)
    m = target.model
    drafter = DFlashDrafter(drafter_config(cfg, target, layer_ids), m.get_input_embeddings(),
                            m.get_output_embeddings()).eval()
    B = drafter.config.block_size
    costs = measure_costs(target, drafter, prompts[0], B)
    ctx = EvalContext.measured(costs, B)
    adaptive = AdaptiveMethod(drafter, OmegaConf.structured(PolicyConfig))
    adaptive.prepare(ctx)  # no calibration data: prior acceptance 0.5 everywhere, which it must unlearn
    chain = ChainMethod(drafter)
    print(f"target {target.ref}, random drafter (block {B}, {drafter.config.num_hidden_layers} layers), "
          f"{len(prompts)} MT-Bench prompts, {args.max_new_tokens} new tokens, {args.threads} thread(s)")
    print("verify cost c(n)/c(1): " + ", ".join(f"{c:.2f}" for c in costs["verify_cost"]) +
          f"; draft {costs['draft_cost']:.2f}; step {costs['step_ms']:.1f} ms")

    autoregressive(target, prompts[0], 8), speculative(target, adaptive, prompts[0], 8)  # warm-up
    ratio = {"adaptive": [], "chain": []}
    drafted, exact = [], True
    for p in prompts:
        for _ in range(args.repeats):
            ar1, t1 = autoregressive(target, p, args.max_new_tokens)
            a = speculative(target, adaptive, p, args.max_new_tokens)
            c = speculative(target, chain, p, args.max_new_tokens)
            ar2, t2 = autoregressive(target, p, args.max_new_tokens)
            ar_tok = statistics.mean([t1["total_s"] / len(ar1), t2["total_s"] / len(ar2)])
            ratio["adaptive"].append(a.total_s / len(a.tokens) / ar_tok)
            ratio["chain"].append(c.total_s / len(c.tokens) / ar_tok)
            drafted.append(sum(a.drafted) / len(a.drafted))
            exact &= a.tokens == ar1 == c.tokens
    for name, xs in ratio.items():
        print(f"{name:9s} time per token / autoregressive: median {statistics.median(xs):.3f} "
              f"(min {min(xs):.3f}, max {max(xs):.3f}, {len(xs)} runs)")
    print(f"adaptive: rounds that ran the drafter {100 * statistics.mean(drafted):.1f}%; outputs exact: {exact}")


if __name__ == "__main__":
    main()

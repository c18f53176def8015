"""Profile: where the time of a speculative round goes, against what the verify-cost curve predicts.

    python scripts/profile_round.py experiment=smollm2_ref hydra.run.dir=runs/smollm2_ref [--prompts 4]
        [--max-new-tokens 96] [--threads 1] [--set mtbench]

Loads the run's exported drafter and the target, measures the cost curve c(n) as the eval stage does, then decodes
the prompts autoregressively and speculatively (chain method) and prints, per token:
- the autoregressive step as the AR loop runs it, against the cost curve's unit (a 1-token verify-style forward);
- the speculative decode split into draft, verify and the rest of the loop (Python, bookkeeping), each against its
  predicted share (draft_cost and c(verified + 1) per round, in units of the measured 1-token step);
- measured / predicted speedup (the gap the eval's `predicted_speedup` shows as hidden overhead).
"""
from __future__ import annotations

import statistics

import torch

from dflash_pipeline.cli.entrypoints import compose_run, measurement_parser
from dflash_pipeline.eval.decode import autoregressive, speculative
from dflash_pipeline.eval.protocol import ChainMethod
from dflash_pipeline.eval.exactness import DEFAULT_TOLERANCE, ExactnessJudge
from dflash_pipeline.eval.policies import measure_costs
from dflash_pipeline.eval.costs import decode_context
from dflash_pipeline.eval.inputs import load_drafter, load_prompts
from dflash_pipeline.eval.references import ReferenceCache
from dflash_pipeline.models.target import load_target
from dflash_pipeline.runtime.stages import stage_dir


def main() -> None:
    ap = measurement_parser(__doc__, prompts=4, threads=1)
    ap.add_argument("--set", default="mtbench")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = compose_run([f"eval.num_prompts={args.prompts}", "eval.turns=1", *args.overrides])
    from pathlib import Path

    run_dir = Path(cfg.hydra.run.dir)
    target = load_target(cfg.target, cfg.cache_dir)
    drafter, folder = load_drafter(cfg, stage_dir(cfg, "train", run_dir), target)
    B = cfg.eval.block_size or drafter.config.block_size
    room = target.config.max_position_embeddings - args.max_new_tokens - B
    refs = ReferenceCache(Path(cfg.cache_dir) / "references", target)
    prompts = load_prompts(args.set, args.set, cfg, refs, room)[args.set]
    costs = measure_costs(target, drafter, decode_context(prompts, args.max_new_tokens, room), B)
    step = costs["step_ms"] / 1e3
    print(f"drafter {folder}, block {B}, {args.threads} thread(s), {len(prompts)} {args.set} prompts, "
          f"{args.max_new_tokens} new tokens")
    print("c(n), n=1..B:", [round(c, 2) for c in costs["verify_cost"]], f"draft {costs['draft_cost']:.2f}",
          f"autoregressive step {costs['ar_step_cost']:.2f}", f"unit {costs['step_ms']:.1f} ms at "
          f"{costs['context_tokens']} tokens of context")

    method, judge = ChainMethod(drafter), ExactnessJudge(target.model, DEFAULT_TOLERANCE)
    autoregressive(target, prompts[0]["prompt_ids"], 8), speculative(target, method, prompts[0]["prompt_ids"], 8, B)
    ar_ms, rows = [], []
    for p in prompts:
        tokens, t = autoregressive(target, p["prompt_ids"], args.max_new_tokens)
        ar_ms.append(1e3 * t["decode_s"] / max(1, len(tokens) - 1))
        s = speculative(target, method, p["prompt_ids"], args.max_new_tokens, B)
        judge.check(p["id"], p["prompt_ids"], tokens, s.tokens, "speculative decoding")  # near-ties pass (bf16)
        decode = s.total_s - s.prefill_s
        draft, verify = sum(s.draft_s), sum(s.verify_s)
        predicted_verify = sum(costs["verify_cost"][v] for v in s.verified) * step  # c(v + 1): index v
        predicted_draft = costs["draft_cost"] * step * len(s.accepted)
        rows.append({"tokens": len(tokens) - 1, "rounds": len(s.accepted), "tau": s.tau, "decode": decode,
                     "draft": draft, "verify": verify, "rest": decode - draft - verify,
                     "p_draft": predicted_draft, "p_verify": predicted_verify})
    tok = sum(r["tokens"] for r in rows)
    rounds = sum(r["rounds"] for r in rows)
    ar = statistics.median(ar_ms)
    print(f"AR step (as the AR loop runs it): {ar:.1f} ms = {ar / costs['step_ms']:.2f} x the cost unit "
          f"(calibrated: {costs['ar_step_cost']:.2f})")
    print(f"tau {sum(r['tau'] * r['rounds'] for r in rows) / rounds:.3f} over {rounds} rounds")
    print(f"{'per round, ms':24s} {'measured':>9s} {'predicted':>10s} {'ratio':>6s}")
    for name, key, pkey in (("draft", "draft", "p_draft"), ("verify", "verify", "p_verify")):
        m, pr = 1e3 * sum(r[key] for r in rows) / rounds, 1e3 * sum(r[pkey] for r in rows) / rounds
        print(f"{name:24s} {m:9.1f} {pr:10.1f} {m / pr:6.2f}")
    rest = 1e3 * sum(r["rest"] for r in rows) / rounds
    print(f"{'rest of the loop':24s} {rest:9.1f} {0.0:10.1f}")
    measured = ar * tok / (1e3 * sum(r["decode"] for r in rows))
    predicted = costs["ar_step_cost"] * costs["step_ms"] * tok / (1e3 * sum(r["p_draft"] + r["p_verify"] for r in rows))
    print(f"decode speedup: measured {measured:.3f}x, predicted from c(n) {predicted:.3f}x, "
          f"measured / predicted {measured / predicted:.3f}")


if __name__ == "__main__":
    main()

"""Benchmark: what the target's dtype does to speed and to exactness, side by side in one run on this machine.

    python scripts/bench_precision.py experiment=smollm2_quick hydra.run.dir=runs/smollm2_quick
        [--dtypes float32 bfloat16] [--threads 2] [--prompts 6] [--max-new-tokens 96] [--profile]

For every dtype, on the run's exported drafter and the same MT-Bench prompts:
- the verify-cost curve c(n) (eval/policies.py measure_costs, at the prompts' median decode context): the 1-token
  step in ms, c(2), c(4), c(8), c(16), the drafter's block forward and a plain autoregressive step in that unit;
- real decodes: autoregressive and speculative (chain) of every prompt, the AR step in ms, the round's cost in AR
  steps of the same dtype, tau, and the decode speedup against AR in the same dtype AND against the fastest AR of
  any dtype measured (the baseline a user compares with);
- exactness: each speculative output classified against AR of its dtype (eval/exactness.py: identical / near-tie
  with its float32 log-prob gap / wrong);
- the near-tie scale that sets eval.near_tie_tolerance: on every position of the float32 replies, how far the
  dtype's verify block (8 tokens) and its 1-token steps move the log-prob gap between the float32 top-2 tokens
  (quantiles and max, in nats); two paths can only pick different tokens where the float32 gap is within that.
--profile also prints the ops that take the 1-token step's time in each dtype (torch.profiler, self CPU time).
"""
from __future__ import annotations

import statistics
from pathlib import Path

import torch

from dflash_pipeline.cli.entrypoints import compose_run, measurement_parser
from dflash_pipeline.eval.decode import autoregressive, speculative
from dflash_pipeline.eval.protocol import ChainMethod
from dflash_pipeline.models import cache as target_cache
from dflash_pipeline.eval.exactness import DEFAULT_TOLERANCE, ExactnessJudge
from dflash_pipeline.eval.policies import measure_costs
from dflash_pipeline.eval.references import ReferenceCache
from dflash_pipeline.eval.costs import decode_context
from dflash_pipeline.eval.inputs import load_drafter, load_prompts
from dflash_pipeline.models.target import load_target
from dflash_pipeline.runtime.stages import stage_dir


@torch.no_grad()
def gap_shift(model, seq: list[int], start: int, pairs: torch.Tensor, block: int) -> torch.Tensor:
    """How much this model moves the log-prob gap of each (top-1, top-2) float32 pair at positions start.. of
    `seq`, against the float32 gaps `pairs` (P, 3: a, b, gap): once in blocks of `block` on a KV cache (verify
    shape) and once one token at a time (AR shape). Returns (2, P) absolute shifts."""
    out = []
    for width in (block, 1):
        cache = target_cache.new_cache(model)
        model(input_ids=torch.tensor([seq[: start - 1]]), cache=cache, use_cache=True)
        rows, end = [], len(seq) - 1  # rows from position start - 1 on predict the tokens start .. end
        for i in range(start - 1, end, width):
            ids = torch.tensor([seq[i: min(i + width, end)]])
            logits = model(input_ids=ids, position_ids=torch.arange(i, i + ids.shape[1])[None], cache=cache,
                           use_cache=True).logits[0].float()
            rows.append(torch.log_softmax(logits, -1))
        logp = torch.cat(rows)
        a, b = pairs[:, 0].long(), pairs[:, 1].long()
        here = logp.gather(1, a[:, None])[:, 0] - logp.gather(1, b[:, None])[:, 0]
        out.append((here - pairs[:, 2]).abs())
    return torch.stack(out)


def profile_step(model, context: list[int], top: int = 8) -> str:
    """The ops of a 1-token step on a cache of `context`, by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    cache = target_cache.new_cache(model)
    with torch.no_grad():
        model(input_ids=torch.tensor([context]), cache=cache, use_cache=True)
        at_context = target_cache.snapshot(cache)
        step = dict(input_ids=torch.tensor([[context[-1]]]), position_ids=torch.tensor([[len(context)]]),
                    cache=cache, use_cache=True)
        for _ in range(3):
            model(**step)
            target_cache.restore(cache, at_context)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                model(**step)
                target_cache.restore(cache, at_context)
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def main() -> None:
    ap = measurement_parser(__doc__, prompts=6, threads=2)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--cost-repeats", type=int, default=20)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    base = [f"eval.num_prompts={args.prompts}", "eval.turns=1", *args.overrides]
    rows, shifts, f32_replies = {}, {}, None
    for dtype in args.dtypes:
        cfg = compose_run([*base, f"target.dtype={dtype}"])
        target = load_target(cfg.target, cfg.cache_dir)
        drafter, folder = load_drafter(cfg, stage_dir(cfg, "train", cfg.hydra.run.dir), target)
        B = cfg.eval.block_size or drafter.config.block_size
        room = target.config.max_position_embeddings - args.max_new_tokens - 16
        refs = ReferenceCache(Path(cfg.cache_dir) / "references", target)
        prompts = load_prompts("mtbench", "mtbench", cfg, refs, room)["mtbench"]
        if dtype == args.dtypes[0]:
            m = target.numerics["machine"]
            print(f"drafter {folder}, block {B}; {len(prompts)} MT-Bench prompts, {args.max_new_tokens} new tokens, "
                  f"{args.threads} threads; {m['cpu']}, flags {' '.join(m['cpu_flags']) or '-'}, torch "
                  f"{m['torch']} ({m['torch_cpu_capability']})")
        context = decode_context(prompts, args.max_new_tokens, room)
        costs = measure_costs(target, drafter, context, 16 if B < 16 else B, repeats=args.cost_repeats)
        costs_b = measure_costs(target, drafter, context, B, repeats=args.cost_repeats)  # the drafter at its B
        method, judge = ChainMethod(drafter), ExactnessJudge(target.model, DEFAULT_TOLERANCE)
        autoregressive(target, prompts[0]["prompt_ids"], 8), speculative(target, method, prompts[0]["prompt_ids"], 8)
        ar_ms, spec_ms, round_cost, kinds, gaps, taus, replies = [], [], [], [], [], [], []
        for p in prompts:
            tokens, t = autoregressive(target, p["prompt_ids"], args.max_new_tokens)
            s = speculative(target, method, p["prompt_ids"], args.max_new_tokens)
            step = t["decode_s"] / max(1, len(tokens) - 1)
            ar_ms.append(1e3 * step)
            spec_ms.append(1e3 * (s.total_s - s.prefill_s) / max(1, len(s.tokens) - 1))
            round_cost.append((sum(s.draft_s) + sum(s.verify_s)) / len(s.accepted) / step)
            v = judge.classify(p["prompt_ids"], tokens, s.tokens)
            kinds.append(v.kind)
            if "logprob_gap" in v.detail:
                gaps.append(f"{v.position}: {v.detail['logprob_gap']:.3f}")
            taus.append(s.tau)
            replies.append(tokens)
        rows[dtype] = {"step_ms": costs["step_ms"], "c": costs["verify_cost"], "draft": costs_b["draft_cost"],
                       "ar_cost": costs["ar_step_cost"], "ar_ms": statistics.median(ar_ms),
                       "spec_ms": statistics.median(spec_ms), "round": statistics.median(round_cost),
                       "tau": statistics.mean(taus), "kinds": kinds, "gaps": gaps}
        if dtype == "float32":
            f32_replies = replies
            f32_model = target.model
        elif f32_replies is not None:  # the near-tie scale: this dtype's shifts of the float32 top-2 gaps
            per = []
            for p, reply in zip(prompts, f32_replies):
                seq = p["prompt_ids"] + reply
                start = len(p["prompt_ids"])
                with torch.no_grad():
                    logp = torch.log_softmax(f32_model(input_ids=torch.tensor([seq])).logits[0, start - 1:-1], -1)
                top = logp.topk(2, -1)
                pairs = torch.stack([top.indices[:, 0].float(), top.indices[:, 1].float(),
                                     top.values[:, 0] - top.values[:, 1]], 1)
                per.append(gap_shift(target.model, seq, start, pairs, 8))
            shifts[dtype] = torch.cat(per, 1)
        if args.profile:
            print(f"\n1-token step in {dtype}, ops by self CPU time (10 steps):")
            print(profile_step(target.model, context))

    fastest = min(r["ar_ms"] for r in rows.values())
    best = min(rows, key=lambda d: rows[d]["ar_ms"])
    print(f"\n{'dtype':10s} {'1-tok ms':>8s} {'c(2)':>5s} {'c(4)':>5s} {'c(8)':>5s} {'c(16)':>5s} {'draft':>6s} "
          f"{'AR ms':>6s} {'round/AR':>8s} {'tau':>5s} {'spec/AR same dtype':>18s} {'vs fastest AR':>13s}  "
          "exactness (identical / near-tie / wrong)")
    for d, r in rows.items():
        c = r["c"]
        counts = "/".join(str(r["kinds"].count(k)) for k in ("identical", "near_tie", "wrong"))
        print(f"{d:10s} {r['step_ms']:8.1f} {c[1]:5.2f} {c[3]:5.2f} {c[7]:5.2f} {c[15]:5.2f} {r['draft']:6.2f} "
              f"{r['ar_ms']:6.1f} {r['round']:8.2f} {r['tau']:5.2f} {r['ar_ms'] / r['spec_ms']:17.2f}x "
              f"{fastest / r['spec_ms']:12.2f}x  {counts}" + (f"  gaps at divergence: {r['gaps']}" if r["gaps"]
                                                               else ""))
    print(f"(decode speedups: medians of per-prompt ms per token after the prefill; the fastest AR is {best})")
    for d, sh in shifts.items():
        q = torch.tensor([0.5, 0.99, 0.999])
        for name, row in (("verify block of 8", sh[0]), ("1-token steps", sh[1])):
            qs = torch.quantile(row, q).tolist()
            print(f"{d} {name}: shift of the float32 top-2 log-prob gap over {row.numel()} positions: median "
                  f"{qs[0]:.4f}, p99 {qs[1]:.4f}, p99.9 {qs[2]:.4f}, max {float(row.max()):.4f} nats")
        both = (sh[0] + sh[1])
        print(f"{d}: the two paths can disagree only where the float32 gap is below their combined shift: max "
              f"{float(both.max()):.4f} nats (eval.near_tie_tolerance default {DEFAULT_TOLERANCE})")


if __name__ == "__main__":
    main()

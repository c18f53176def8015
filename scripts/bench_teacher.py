"""Benchmark: teacher generation throughput, side by side in one run on the same target, prompts and machine:

- `model.generate` one prompt at a time (the baseline);
- static batches (length-bucketed batches of --batch-size rows; rows leave when done, nothing takes their place);
- continuous batching (the teacher: finished rows are refilled from the queue);
- and the two ways of capturing features: a separate prefill pass over the finished sequences
  (teacher.capture=separate) against keeping the tapped layers' hidden states as generation computes them
  (teacher.capture=during, the default);
- for every --dtypes (float32 and bfloat16 by default), all of the above, then the teacher's throughput side by side;
- with --vllm, the vLLM teacher (teacher.engine=vllm: vLLM's replies, then the target's prefill capture) on the same
  prompts: reply tokens/s against HF continuous batching, with features against the HF teacher, identical replies;
  and the engine teacher (teacher.capture=engine: replies and features both from one vLLM engine, its
  extract_hidden_states), with features against the HF teacher, and its features against the HF capture's.

    python scripts/bench_teacher.py [--prompts 128] [--baseline-prompts 16] [--max-new-tokens 96]
        [--dtypes float32 bfloat16] [--batch-size 32] [--vllm]

The teacher runs a queue of many prompts through a fixed number of rows, so the batched paths get more prompts
than rows (128 through 32 by default: refilling only pays once there is a queue). The one-prompt loop is slow, so
it runs on an evenly spaced sample of the length-sorted prompts (--baseline-prompts) and is compared in generated
tokens/s. Prints tokens/s of each, the ratios to the baseline, the share of the capture pass, and how many of the
sampled prompts' replies equal the baseline's greedy replies (batching may flip near-ties in low precision), and
how many replies of the whole queue stay the same when it runs through half as many rows (a row's reply must not
depend on which rows share its batch; docs/data.md, 'Determinism in reduced precision').
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_module

from dflash_pipeline.conf.schema import register
from dflash_pipeline.data.sources import load_conversations
from dflash_pipeline.data.teacher import add_features, chat_segments
from dflash_pipeline.models.generation import budget_batches, generate, generate_capturing
from dflash_pipeline.models.families import resolve_layer_ids
from dflash_pipeline.models.target import load_target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--baseline-prompts", type=int, default=16, help="of them, decoded one at a time")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="the target's dtypes, side by side")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--skip-baseline", action="store_true", help="only the batched paths (ratios between them)")
    ap.add_argument("--vllm", action="store_true", help="also the vLLM teacher (teacher.engine=vllm) on the same "
                    "prompts: needs bash scripts/setup_vllm.sh")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides, e.g. target=tiny")
    args = ap.parse_args()
    if args.prompts < 1 or args.baseline_prompts < 1:
        ap.error("--prompts and --baseline-prompts must be at least 1 (--skip-baseline drops the one-prompt loop)")

    register()
    summary = {dtype: bench(args, dtype) for dtype in args.dtypes}
    if len(summary) > 1:
        first = next(iter(summary.values()))
        print("\nthe teacher (continuous batching + features kept), generated tok/s: " + ", ".join(
            f"{d} {r:.1f} ({r / first:.2f}x)" for d, r in summary.items()))


def bench(args, dtype: str) -> float:
    """Every path at one target dtype; returns the teacher's generated tok/s (continuous batching + features)."""
    with initialize_config_module(config_module="dflash_pipeline.conf", version_base=None):
        cfg = compose("config", overrides=[f"teacher.max_new_tokens={args.max_new_tokens}",
                                           f"target.dtype={dtype}", f"teacher.batch_size={args.batch_size}",
                                           "teacher.max_turns=1", *args.overrides])
    target = load_target(cfg.target, cfg.cache_dir)
    tok, model, t = target.tokenizer, target.model, cfg.teacher
    convs = load_conversations(cfg.data.source, limit=args.prompts, tokenizer=tok,
                               max_prompt_tokens=cfg.data.max_prompt_tokens, log=lambda s: None)
    prompts = sorted((chat_segments(tok, c["messages"], 1)[0] for c in convs), key=len)
    layer_ids = resolve_layer_ids(None, t.num_taps, target.num_layers)
    stride = max(1, len(prompts) // max(1, args.baseline_prompts))
    sample = list(range(0, len(prompts), stride))[: args.baseline_prompts]
    cpu = target.numerics["machine"]
    print(f"\ntarget {target.ref} ({target.dtype}; {cpu['cpu']}, flags {' '.join(cpu['cpu_flags'])}), "
          f"{len(prompts)} prompts ({len(sample)} one at a time), mean prompt "
          f"{statistics.mean(map(len, prompts)):.0f} tokens, max_new_tokens {args.max_new_tokens}, batch "
          f"{args.batch_size}, {torch.get_num_threads()} threads")
    common = dict(max_new_tokens=args.max_new_tokens, eos_ids=target.eos_ids, pad_id=tok.pad_token_id)

    def timed(fn):
        t0 = time.perf_counter()
        replies = fn()
        return replies, time.perf_counter() - t0

    def one_at_a_time():
        return [model.generate(input_ids=torch.tensor([p]), max_new_tokens=args.max_new_tokens, do_sample=False,
                               eos_token_id=sorted(target.eos_ids), pad_token_id=tok.pad_token_id)[0, len(p):].tolist()
                for p in (prompts[i] for i in sample)]

    def static():
        replies = []
        for batch in budget_batches(prompts, t.batch_size, t.prefill_batch_tokens):
            replies += generate(model, batch, **common)
        return replies

    def continuous():
        return generate(model, prompts, batch_size=t.batch_size, prefill_tokens=t.prefill_batch_tokens, **common)

    def half_rows():
        return generate(model, prompts, batch_size=max(1, t.batch_size // 2), prefill_tokens=t.prefill_batch_tokens,
                        **common)

    def continuous_with_taps():
        """The teacher's default (teacher.capture=during): continuous batching that keeps every tapped layer's
        hidden states of every token as generation computes them."""
        replies, _ = generate_capturing(model, prompts, layer_ids, batch_size=t.batch_size,
                                        prefill_tokens=t.prefill_batch_tokens, **common)
        return replies

    runs = {}
    for name, fn in (("one prompt at a time (model.generate)", None if args.skip_baseline else one_at_a_time),
                     ("static batches (rows leave, no refill)", static),
                     ("continuous batching", continuous),
                     ("continuous batching + features kept (the teacher)", continuous_with_taps),
                     ("continuous batching, half the rows", half_rows)):
        if fn is not None:
            runs[name] = timed(fn)
    samples = [{"input_ids": p + r} for p, r in zip(prompts, runs["continuous batching"][0])]
    _, capture_s = timed(lambda: add_features(target, samples, layer_ids, cfg))

    base = next(iter(runs.values()))
    base_rate = sum(map(len, base[0])) / base[1]
    print(f"{'':52s} {'tok/s':>8s} {'x first':>8s} {'same replies':>13s}")
    for name, (replies, secs) in runs.items():
        rate = sum(map(len, replies)) / secs
        if args.skip_baseline:  # against the first batched path, on every prompt
            same = f"{sum(x == y for x, y in zip(base[0], replies))}/{len(prompts)}"
        elif name.startswith("one prompt"):
            same = f"{len(sample)}/{len(sample)}"
        else:  # against the one-prompt replies, on the sampled prompts
            same = f"{sum(base[0][j] == replies[i] for j, i in enumerate(sample))}/{len(sample)}"
        print(f"{name:52s} {rate:8.1f} {rate / base_rate:7.2f}x {same:>13s}")
    half = runs.pop("continuous batching, half the rows")[0]
    full = runs["continuous batching"][0]
    print(f"replies unchanged when the queue runs through {max(1, t.batch_size // 2)} rows instead of {t.batch_size}: "
          f"{sum(x == y for x, y in zip(full, half))}/{len(prompts)}")
    cont = runs["continuous batching"][1]
    taps = runs["continuous batching + features kept (the teacher)"][1]
    tokens = sum(map(len, runs["continuous batching"][0]))
    print(f"features by a separate capture pass (teacher.capture=separate): {capture_s:.1f} s = "
          f"{100 * capture_s / (cont + capture_s):.0f}% of generation + pass; kept during generation "
          f"(teacher.capture=during): {taps - cont:+.1f} s")
    print(f"teacher with features, generated tok/s: separate pass {tokens / (cont + capture_s):.1f}, during "
          f"{tokens / taps:.1f} ({(cont + capture_s) / taps:.2f}x)"
          + (f"; against one prompt at a time (no features): {tokens / taps / base_rate:.2f}x"
             if not args.skip_baseline else ""))
    if args.vllm:
        vllm_side_by_side(args, cfg, target, prompts, layer_ids, runs["continuous batching"], tokens / taps)
    return tokens / taps


def vllm_side_by_side(args, cfg, target, prompts: list[list[int]], layer_ids: list[int], hf_run, hf_teacher_rate):
    """The same prompts through vLLM (teacher.engine=vllm: greedy replies from the engine, then the target's
    prefill capture of the features), against the HF teacher (continuous batching + features kept)."""
    import tempfile

    from dflash_pipeline.eval.exactness import IDENTICAL, NEAR_TIE, ExactnessJudge
    from dflash_pipeline.models.target_sources import target_folder
    from dflash_pipeline.models.vllm_engine import VLLMEngine, VLLMError, check_capture_layers

    log_file = Path(tempfile.gettempdir()) / "bench_teacher_vllm.log"
    t0 = time.perf_counter()
    with VLLMEngine(cfg.cache_dir, target_folder(cfg.target, cfg.cache_dir), target.dtype,
                    target.config.max_position_embeddings, threads=torch.get_num_threads(),
                    max_num_seqs=args.batch_size, log_file=log_file) as engine:
        start_s = time.perf_counter() - t0
        engine.generate(prompts[:2], 4, sorted(target.eos_ids), batch=True)  # warm-up
        t0 = time.perf_counter()
        replies = engine.generate(prompts, args.max_new_tokens, sorted(target.eos_ids), batch=True)["outputs"]
        gen_s = time.perf_counter() - t0
    samples = [{"input_ids": p + r} for p, r in zip(prompts, replies)]
    t0 = time.perf_counter()
    add_features(target, samples, layer_ids, cfg)
    capture_s = time.perf_counter() - t0
    judge = ExactnessJudge(target.model, cfg.eval.near_tie_tolerance)

    def same(got: list[list[int]]) -> str:
        kinds = [judge.classify(p, ref, g).kind for p, ref, g in zip(prompts, hf_run[0], got)]
        return (f"replies identical to HF {kinds.count(IDENTICAL)}/{len(kinds)}, near-ties {kinds.count(NEAR_TIE)}, "
                f"other {len(kinds) - kinds.count(IDENTICAL) - kinds.count(NEAR_TIE)}")

    tokens = sum(map(len, replies))
    print(f"vLLM ({target.dtype}, engine start {start_s:.0f} s not counted; log {log_file}): replies "
          f"{tokens / gen_s:.1f} tok/s ({tokens / gen_s / (sum(map(len, hf_run[0])) / hf_run[1]):.2f}x HF continuous "
          f"batching); with the features' prefill capture {tokens / (gen_s + capture_s):.1f} tok/s = "
          f"{tokens / (gen_s + capture_s) / hf_teacher_rate:.2f}x the HF teacher; {same(replies)}")

    # teacher.capture=engine: one engine writes the replies, then captures the features of the finished sequences
    try:
        check_capture_layers(layer_ids, target.num_layers)
    except VLLMError as err:
        print(f"vLLM engine teacher (teacher.capture=engine) not measured: {err}")
        return
    with VLLMEngine(cfg.cache_dir, target_folder(cfg.target, cfg.cache_dir), target.dtype,
                    target.config.max_position_embeddings, threads=torch.get_num_threads(),
                    max_num_seqs=args.batch_size, log_file=log_file, capture_layers=layer_ids) as engine:
        engine.generate(prompts[:2], 4, sorted(target.eos_ids), batch=True)  # warm-up
        t0 = time.perf_counter()
        own = engine.generate(prompts, args.max_new_tokens, sorted(target.eos_ids), batch=True)["outputs"]
        own_gen_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        features, _ = engine.capture([p + r for p, r in zip(prompts, own)])
        own_capture_s = time.perf_counter() - t0
    worst = max(((f.float() - s["features"].float()).norm() / s["features"].float().norm()).item()
                for f, s, a, b in zip(features, samples, own, replies) if a == b)  # where both wrote the same reply
    tokens = sum(map(len, own))
    print(f"vLLM engine teacher (teacher.capture=engine, {target.dtype}): replies {tokens / own_gen_s:.1f} tok/s, "
          f"capture {own_capture_s:.1f} s = {100 * own_capture_s / (own_gen_s + own_capture_s):.0f}%; with features "
          f"{tokens / (own_gen_s + own_capture_s):.1f} tok/s = "
          f"{tokens / (own_gen_s + own_capture_s) / hf_teacher_rate:.2f}x the HF teacher; {same(own)}; features "
          f"against the HF capture: largest relative difference {worst:.1e}")


if __name__ == "__main__":
    main()

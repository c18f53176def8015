"""What a recurrent target's rollback costs, both ways side by side (models/cache.py Rollback), beside an attention
target of the same size: the verify-cost curve c(n) = (verify n tokens + roll back to the anchor) / (1-token step), as
the eval measures it (eval/policies.py measure_costs), and per round the verify of a block plus the rollback for each
number of accepted drafts, in the same run's 1-token steps.

    python scripts/bench_rollback.py --family qwen3_next --baseline qwen3 --block 8

Tiny random families (scripts/tiny_target.py) widened to --hidden; or --target <model folder>. Medians of per-repeat
ratios, the strategies alternating within each repeat (a slow spell of the machine cancels out).
"""
from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM

from dflash_pipeline.eval.policies import measure_costs
from dflash_pipeline.models import cache as target_cache
from dflash_pipeline.models.drafter import DFlashDrafter, DFlashDrafterConfig

sys.path.insert(0, str(Path(__file__).parent))
import tiny_target  # noqa: E402


def load(family: str | None, folder: str | None, hidden: int):
    if not folder:
        tiny_target.COMMON.update(hidden_size=hidden, intermediate_size=4 * hidden, head_dim=hidden // 4)
        tiny_target.FAMILIES.update(tiny_target._families())
        folder = tiny_target.build(family, Path(tempfile.mkdtemp()) / family, tiny_target.smollm2_tokenizer())
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def drafter_for(model, block: int) -> DFlashDrafter:
    """A 1-layer drafter of the target's width (untrained: only its time is used)."""
    c = model.config.get_text_config(decoder=True)
    conf = DFlashDrafterConfig(
        hidden_size=c.hidden_size, intermediate_size=4 * c.hidden_size, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=c.hidden_size // 4, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=4096, vocab_size=c.vocab_size, block_size=block, target_hidden_size=c.hidden_size,
        target_layer_ids=[1, 3], num_target_layers=c.num_hidden_layers, mask_token_id=c.vocab_size - 1)
    return DFlashDrafter(conf, model.get_input_embeddings(), model.get_output_embeddings()).eval()


def rounds(model, ids: torch.Tensor, L: int, B: int, repeats: int) -> dict[str, list[float]]:
    """Per strategy, the median (verify B + rollback keeping m + 1 tokens) / (1-token step), m = 0 .. B-1."""
    states = {}
    for strategy in target_cache.ROLLBACKS:
        cache = target_cache.new_cache(model)
        model(input_ids=ids[:, :L], cache=cache, use_cache=True)
        rb = target_cache.Rollback(model, strategy)
        rb.start(cache, B)
        states[strategy] = (cache, rb, target_cache.snapshot(cache))
    pos = torch.arange(L, L + B)[None]
    ratios = {(s, m): [] for s in target_cache.ROLLBACKS for m in range(B)}
    for r in range(repeats + 1):
        for strategy, (cache, rb, at_l) in states.items():
            t0 = time.perf_counter()
            model(input_ids=ids[:, L:L + 1], position_ids=pos[:, :1], cache=cache, use_cache=True)
            step = time.perf_counter() - t0
            target_cache.restore(cache, at_l)
            for m in range(B):
                t0 = time.perf_counter()
                rb.before(cache)
                model(input_ids=ids[:, L:L + B], position_ids=pos, cache=cache, use_cache=True)
                rb.after(cache, L + m + 1, ids[:, L:L + m + 1], pos[:, :m + 1])
                if r:
                    ratios[(strategy, m)].append((time.perf_counter() - t0) / step)
                target_cache.restore(cache, at_l)
    return {s: [statistics.median(ratios[(s, m)]) for m in range(B)] for s in target_cache.ROLLBACKS}


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen3_next", help="a recurrent tiny family (scripts/tiny_target.py --list)")
    p.add_argument("--baseline", default="qwen3", help="an attention tiny family of the same size, for c(n)")
    p.add_argument("--target", help="a model folder instead of --family")
    p.add_argument("--hidden", type=int, default=256, help="hidden size of the tiny families")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--block", type=int, default=8)
    p.add_argument("--repeats", type=int, default=9)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    model = load(a.family, a.target, a.hidden)
    if not target_cache.is_recurrent(model):
        raise SystemExit(f"{type(model).__name__} has no recurrent layers: its rollback is a crop")
    L, B = a.context, a.block
    ids = torch.randint(0, model.config.get_text_config(decoder=True).vocab_size - 1, (1, L + B))
    print(f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}, float32; {type(model).__name__} hidden {a.hidden}, context {L}, block {B}, "
          f"{a.repeats} repeats")
    curves = {}
    for strategy in target_cache.ROLLBACKS:
        target = SimpleNamespace(model=model, rollback=strategy)
        curves[f"{type(model).__name__}, {strategy}"] = measure_costs(
            target, drafter_for(model, B), ids[0, :L].tolist(), B, repeats=a.repeats)["verify_cost"]
    if a.baseline and not a.target:
        base = load(a.baseline, None, a.hidden)
        curves[f"{type(base).__name__} (attention), crop"] = measure_costs(
            SimpleNamespace(model=base), drafter_for(base, B), ids[0, :L].tolist(), B,
            repeats=a.repeats)["verify_cost"]
    print("\nc(n): verify n tokens and roll back to the anchor, in 1-token steps\n")
    print("| target, rollback | " + " | ".join(f"n={n}" for n in range(1, B + 1)) + " |")
    print("|---|" + "---|" * B)
    for name, c in curves.items():
        print(f"| {name} | " + " | ".join(f"{x:.2f}" for x in c) + " |")
    per_round = rounds(model, ids, L, B, a.repeats)
    print(f"\nA round: verify {B} tokens, then roll back keeping the anchor and m accepted drafts, in 1-token steps\n")
    print("| rollback | " + " | ".join(f"m={m}" for m in range(B)) + " |")
    print("|---|" + "---|" * B)
    for s, row in per_round.items():
        print(f"| {s} | " + " | ".join(f"{x:.2f}" for x in row) + " |")


if __name__ == "__main__":
    main()

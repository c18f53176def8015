"""Benchmark: what building a draft tree costs per round, DDTree against the Weaver tree, at each node budget.

    python scripts/bench_tree_build.py experiment=smollm2_best hydra.run.dir=runs/smollm2_best \
        [--blocks 48] [--budgets 16 32 64 128] [--threads 2] [--repeats 3] [--weaver-dir DIR] \
        [--expansions 16 8 4] [--tau-blocks 0]

Loads the run's exported drafter, its trained Weaver (train/weaver/export) and the target; takes the first --blocks
anchor blocks of the run's held-out teacher sequences (the drafter's block states and the target's final hidden state
of each anchor's row, as a decode round has them) and times, per budget, each method's `tree` call alone (the part
a round spends on selection; the target's verify is not included). Prints the median ms per round over the blocks
(best of --repeats passes, against other processes on the machine), the Weaver's
expand calls per round, and a target step (1-token forward at 256 tokens of context) for scale. The Weaver's
root breadth follows weaver.root_children (unset: it widens with the budget, eval/components.py root_breadth; set it
to compare builders on the same trees). --expansions times the Weaver built in that many calls each (weaver.expansions:
fewer, wider calls); --tau-blocks N adds each tree's teacher-forced tau on the first N held-out anchors, so a cheaper
build is weighed against the acceptance it gives up.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from dflash_pipeline.cli.entrypoints import compose_run, measurement_parser
from dflash_pipeline.runtime.stages import component_export, stage_dir, teacher_dir
from dflash_pipeline.data.shards import TeacherDataset
from dflash_pipeline.data.splits import split_heldout
from dflash_pipeline.eval.protocol import drafter_blocks
from dflash_pipeline.eval.inputs import load_drafter
from dflash_pipeline.eval.tree import DDTreeMethod, tree_offline_metrics
from dflash_pipeline.models.generation import capture
from dflash_pipeline.models.target import load_target
from dflash_pipeline.eval.components import WeaverTreeMethod, load_weaver, weaver_tree


def main() -> None:
    ap = measurement_parser(__doc__, prompts=1, threads=2)
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--weaver-dir", type=Path,
                    help="an exported Weaver folder (default: the run's train/weaver/export); to time the same "
                         "Weaver under another checkout of the code")
    ap.add_argument("--expansions", type=int, nargs="+", default=None,
                    help="Weaver calls per tree to compare (default: weaver.expansions)")
    ap.add_argument("--tau-blocks", type=int, default=0, help="held-out anchors for teacher-forced tau (0: none)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = compose_run(args.overrides)
    run_dir = Path(cfg.hydra.run.dir)
    train_dir = stage_dir(cfg, "train", run_dir)
    weaver_dir = args.weaver_dir or component_export("weaver", train_dir)
    if not (weaver_dir / "model.safetensors").is_file():
        raise SystemExit(f"error: no trained Weaver at {weaver_dir}: run `dflash-train <same overrides> "
                         "trainer.component=weaver` first")
    target = load_target(cfg.target, cfg.cache_dir)
    drafter, folder = load_drafter(cfg, train_dir, target)
    weaver = load_weaver(weaver_dir, drafter.norm.weight.device)
    data = TeacherDataset(teacher_dir(cfg, run_dir))
    _, held = split_heldout(data.ids, cfg.trainer.heldout_samples, cfg.trainer.train_samples)
    B = drafter.config.block_size
    blocks, items = [], []  # (hidden (B, H), verifier hidden, anchor) per block, as a decode round has them
    anchors_seen = 0
    with torch.no_grad():
        for i in held:
            item = data[i]
            final = capture(target.model, [item["input_ids"].tolist()], [], pad_id=target.tokenizer.pad_token_id,
                            final=True)[0]["final_hidden"]
            items.append({**item, "final_hidden": final})
            hidden, b, keep = drafter_blocks(drafter, items[-1:], B)
            verifier, anchors = b["verifier_hidden"][keep].to(hidden.dtype), b["block_ids"][keep][:, 0]
            if len(blocks) < args.blocks:
                blocks += [(hidden[n], verifier[n], int(anchors[n])) for n in range(hidden.shape[0])]
            anchors_seen += hidden.shape[0]
            if len(blocks) >= args.blocks and anchors_seen >= args.tau_blocks:
                break
    blocks = blocks[:args.blocks]
    expansions = args.expansions or [cfg.weaver.expansions]
    ids = torch.randint(0, target.config.vocab_size, (1, 257))
    with torch.no_grad():
        out = target.model(ids[:, :256], use_cache=True)
        step = []
        for _ in range(5):
            t0 = time.perf_counter()
            target.model(ids[:, 256:], past_key_values=out.past_key_values, use_cache=False)
            step.append(time.perf_counter() - t0)
    step_ms = 1e3 * statistics.median(step)
    print(f"drafter {folder}, Weaver {weaver_dir}, block {B}, {len(blocks)} held-out blocks, {args.threads} "
          f"thread(s); target step {step_ms:.1f} ms (1 token at 256 of context)")
    tau = " | tau DDTree / Weaver" if args.tau_blocks else ""
    print(f"| nodes | weaver.expansions | DDTree ms / round | Weaver ms / round | Weaver / DDTree "
          f"| Weaver calls / round | Weaver ms in target steps{tau} |")
    print("|---|---|---|---|---|---|---|" + ("---|" if tau else ""))
    for budget in args.budgets:
        ddtree = DDTreeMethod(drafter, budget)
        dd_ms = 1e3 * time_tree(ddtree, blocks, args.repeats)
        dd_tau = tree_tau(drafter, items, B, ddtree, args.tau_blocks)
        for n in expansions:
            weaver_method = WeaverTreeMethod(drafter, weaver, budget, cfg.weaver.children, cfg.weaver.root_children, n)
            ms = 1e3 * time_tree(weaver_method, blocks, args.repeats)
            calls, counted = [], []
            with torch.no_grad():
                for hidden, verifier, anchor in blocks[:8]:
                    weaver_tree(weaver, drafter, verifier, hidden, anchor, budget, cfg.weaver.children, counted,
                                cfg.weaver.root_children, n)
                    calls.append(len(counted))
                    counted.clear()
            cell = (f" | {dd_tau:.3f} / {tree_tau(drafter, items, B, weaver_method, args.tau_blocks):.3f}"
                    if args.tau_blocks else "")
            print(f"| {budget} | {n} | {dd_ms:.2f} | {ms:.2f} | {ms / dd_ms:.1f}x | {statistics.mean(calls):.1f} "
                  f"| {ms / step_ms:.2f}{cell} |", flush=True)


def time_tree(method, blocks: list, repeats: int) -> float:
    """Median seconds of one `tree` call over the blocks, the best of `repeats` passes."""
    best = None
    for _ in range(repeats):
        per = []
        with torch.no_grad():
            for hidden, verifier, anchor in blocks:
                t0 = time.perf_counter()
                method.tree(hidden, verifier, anchor)
                per.append(time.perf_counter() - t0)
        med = statistics.median(per)
        best = med if best is None else min(best, med)
    return best


def tree_tau(drafter, items: list[dict], block_size: int, method, max_blocks: int) -> float:
    """Teacher-forced tau of the method's trees on the first `max_blocks` held-out anchors (0: not measured)."""
    if not max_blocks:
        return float("nan")
    with torch.no_grad():
        out = tree_offline_metrics(drafter, items, block_size, {"m": method}, max_blocks=max_blocks)
    return float(out["m"]["tau_offline"])


if __name__ == "__main__":
    main()

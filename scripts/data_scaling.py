"""Data-scaling curve: held-out tau_offline of the drafter against the teacher reply tokens it trained on.

Trains one drafter per subset size of ONE teacher dataset (nested subsets, `trainer.train_samples`, the same
held-out sequences for every size) at a fixed number of epochs (steps = epochs x size / batch sequences, at least
--min-steps), then writes <out>/scaling.md (table) and <out>/scaling.png (tau_offline and a_1 against reply tokens).

    python scripts/data_scaling.py --teacher runs/smollm2_ref/teacher --sizes 100 200 400 784 [--epochs 8] \
        [--reuse 784=runs/smollm2_ref/train] [--out runs/scaling] [-- extra Hydra overrides]

Each size is an ordinary `dflash-train` run in <out>/n<size> (resumable; a finished one is skipped); --reuse takes
a finished training folder of the same recipe for a size instead of training it again. Pin it to a core with
`taskset -c 1` on a shared machine.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

from dflash_pipeline.data.shards import TeacherDataset
from dflash_pipeline.data.splits import split_heldout
from dflash_pipeline.runtime.stages import recorded_stage_dir


def final_heldout(train_dir: Path) -> dict:
    """The last held-out evaluation logged by a training run (metrics.jsonl)."""
    rows = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "heldout" in r]
    if not rows:
        sys.exit(f"{train_dir}/metrics.jsonl has no held-out evaluation: set trainer.eval_every <= trainer.steps")
    return {"step": rows[-1]["step"], **rows[-1]["heldout"]}


def reply_tokens(data: TeacherDataset, heldout: int, size: int) -> int:
    """Loss (reply) tokens of the first `size` training sequences (the subset trainer.train_samples selects)."""
    train, _ = split_heldout(data.ids, heldout, size)
    return sum(int(data[i]["loss_mask"].sum()) for i in train)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--teacher", required=True, help="a finished teacher dataset folder")
    ap.add_argument("--sizes", type=int, nargs="+", required=True, help="training sequences per point")
    ap.add_argument("--epochs", type=float, default=8.0)
    ap.add_argument("--min-steps", type=int, default=100)
    ap.add_argument("--batch-sequences", type=int, default=8)
    ap.add_argument("--heldout", type=int, default=16, help="trainer.heldout_samples (the same for every size)")
    ap.add_argument("--experiment", default="smollm2_ref")
    ap.add_argument("--reuse", nargs="*", default=[], help="SIZE=TRAIN_DIR of finished runs to take as they are")
    ap.add_argument("--out", default="runs/scaling")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = ap.parse_args()

    data = TeacherDataset(args.teacher, verify=False)
    available = len(data) - args.heldout
    reuse = {int(k): Path(v) for k, v in (r.split("=", 1) for r in args.reuse)}
    out = Path(args.out)
    points = []
    for size in sorted(args.sizes):
        if size > available:
            sys.exit(f"size {size} is more than the {available} training sequences of {args.teacher}")
        steps = max(args.min_steps, math.ceil(args.epochs * size / args.batch_sequences))
        train_dir = reuse.get(size)
        if train_dir is None:
            run_dir = out / f"n{size}"
            cmd = ["dflash-train", f"experiment={args.experiment}", f"trainer.data_dir={Path(args.teacher).resolve()}",
                   f"trainer.train_samples={size}", f"trainer.steps={steps}", f"trainer.eval_every={steps}",
                   f"trainer.save_every={steps}", f"trainer.heldout_samples={args.heldout}",
                   f"trainer.batch_sequences={args.batch_sequences}", "logger=none", f"hydra.run.dir={run_dir}",
                   *args.overrides]
            print("$", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
            train_dir = recorded_stage_dir(run_dir, "train")
        held = final_heldout(train_dir)
        points.append({"sequences": size, "reply_tokens": reply_tokens(data, args.heldout, size),
                       "steps": held["step"], "tau_offline": held["tau_offline"],
                       "tau_offline_ci95": held.get("tau_offline_ci95"), "a_1": held["a_k"][0],
                       "train_dir": str(train_dir)})
        print(json.dumps(points[-1]), flush=True)

    out.mkdir(parents=True, exist_ok=True)
    def ci(p: dict) -> str:
        return "[{:.3f}, {:.3f}]".format(*p["tau_offline_ci95"]) if p.get("tau_offline_ci95") else ""

    lines = ["| training sequences | reply tokens | steps | held-out tau_offline [95% CI] | held-out a_1 |",
             "|---|---|---|---|---|"]
    lines += [f"| {p['sequences']} | {p['reply_tokens']:,} | {p['steps']} | {p['tau_offline']:.3f} {ci(p)} | "
              f"{p['a_1']:.3f} |" for p in points]
    (out / "scaling.md").write_text("\n".join(lines) + "\n")
    (out / "scaling.json").write_text(json.dumps(points, indent=2))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    xs = [p["reply_tokens"] for p in points]
    taus = [p["tau_offline"] for p in points]
    bounds = [p.get("tau_offline_ci95") or [t, t] for p, t in zip(points, taus)]
    ax.errorbar(xs, taus, yerr=[[t - b[0] for t, b in zip(taus, bounds)], [b[1] - t for t, b in zip(taus, bounds)]],
                fmt="o-", capsize=3, label="held-out tau_offline (95% CI)")
    ax.plot(xs, [1 + p["a_1"] for p in points], "s--", label="1 + held-out a_1")
    ax.set_xscale("log")
    ax.set_xlabel("teacher reply tokens trained on")
    ax.set_ylabel("accepted tokens per round")
    ax.set_title(f"{args.experiment}: data scaling ({args.epochs:g} epochs per size)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "scaling.png", dpi=120)
    print((out / "scaling.md").read_text())


if __name__ == "__main__":
    main()

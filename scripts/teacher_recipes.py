"""Drafter quality per CPU-hour of teacher data + training: which teacher recipe (regenerated, prefilled, mixed,
multi-turn) buys the most acceptance for the machine time it costs.

Each row is a training set made of one or more finished teacher datasets (merged with symbolic links:
data/shards.py `merge_datasets`), trained with the same recipe and number of steps, then evaluated on MT-Bench and
HumanEval (teacher-forced on the target's own greedy replies, and online with the exact loop), so every row is
scored on the same prompts whatever its held-out split:

    python scripts/teacher_recipes.py --out runs/recipes --steps 200 \\
        --row regen48=runs/q24/Ra --row regen48+prefill224=runs/q24/Ra,runs/q24/Pb \\
        --row regen48+prefill224@400=runs/q24/Ra,runs/q24/Pb \
        [--seconds runs/q24/Ra=55] [-- extra Hydra overrides for training and eval]

A row named NAME@STEPS trains STEPS steps instead of --steps (more data wants more steps: the CPU-hours count them).

Teacher cost is the seconds the target spent on the shards (recorded per shard by dflash-teacher; --seconds
gives it for datasets written before that); training cost is the wall time of `dflash-train`. CPU-hours count
every core of the machine (both stages use all of them). Each row is resumable: a finished training or eval is
skipped. Writes <out>/recipes.md, recipes.json and recipes.png (tau against CPU-hours).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dflash_pipeline.data.shards import DatasetError, TeacherDataset, merge_datasets
from dflash_pipeline.data.splits import PREFILLED
from dflash_pipeline.runtime.stages import recorded_stage_dir

sys.path.insert(0, str(Path(__file__).parent))
from bench_common import BENCHMARK_COLUMNS, benchmark_cells, chain_scores, tau_cell  # noqa: E402

EVAL = ["eval.datasets=[mtbench,humaneval]", "eval.turns=1", "eval.num_prompts=40", "eval.online_prompts=2",
        "eval.max_new_tokens=64", "eval.cost_repeats=2", "eval.baseline_dtypes=[]", "eval.num_threads=2"]


def run(cmd: list[str]) -> float:
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - start


def dataset_dir(path: Path) -> Path:
    """A teacher dataset folder, given it or the run folder holding it as teacher/."""
    teacher = recorded_stage_dir(path, "teacher")
    return teacher if (teacher / "manifest.json").is_file() else path


def teacher_of(row_dir: Path, sources: list[Path]) -> Path:
    """The row's training set: the one dataset, or the merge of several (made once)."""
    if len(sources) == 1:
        return dataset_dir(sources[0])
    merged = recorded_stage_dir(row_dir, "teacher")
    if not (merged / "manifest.json").is_file():
        merge_datasets([dataset_dir(s) for s in sources], merged)
    return merged


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", action="append", required=True, metavar="NAME[@STEPS]=DIR[,DIR...]",
                    help="a row: finished teacher datasets (or run folders holding teacher/) trained on together, "
                         "for STEPS steps (default --steps)")
    ap.add_argument("--seconds", action="append", default=[], metavar="DIR=SECONDS",
                    help="teacher seconds of a dataset that did not record them")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--experiment", default="smollm2_quick")
    ap.add_argument("--out", default="runs/recipes")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every training and eval")
    args = ap.parse_args()

    given = {}
    for spec in args.seconds:
        folder, _, sec = spec.partition("=")
        try:
            given[Path(folder).resolve()] = float(sec)
        except ValueError:
            sys.exit(f"error: --seconds {spec!r}: write DIR=SECONDS, e.g. runs/q24/Ra=63")
    out, cores = Path(args.out), os.cpu_count() or 1
    rows = []
    for spec in args.row:
        name, _, dirs = spec.partition("=")
        steps = name.partition("@")[2]
        if not dirs or (steps and not steps.isdigit()):
            sys.exit(f"error: --row {spec!r}: write NAME=DIR[,DIR...] or NAME@STEPS=DIR[,DIR...]")
        steps = int(steps) if steps else args.steps
        sources = [Path(d) for d in dirs.split(",")]
        row_dir = out / name
        try:
            data_dir = teacher_of(row_dir, sources)
            data = TeacherDataset(data_dir, verify=False)
            parts = [TeacherDataset(dataset_dir(s), verify=False) for s in sources]
        except DatasetError as e:
            sys.exit(f"error: row {name}: {e}")
        teacher_s = 0.0
        for s, d in zip(sources, parts):
            sec = d.teacher_seconds if d.teacher_seconds is not None else given.get(s.resolve())
            if sec is None:
                sys.exit(f"error: {s} did not record its teacher seconds; give them with --seconds {s}=SECONDS")
            teacher_s += sec
        common = [f"experiment={args.experiment}", f"trainer.data_dir={data_dir.resolve()}", "logger=none",
                  f"hydra.run.dir={row_dir}"]
        timing = row_dir / "train_seconds.json"
        if not timing.is_file():
            sec = run(["dflash-train", *common, f"trainer.steps={steps}", f"trainer.eval_every={steps}",
                       f"trainer.save_every={steps}", *args.overrides])
            timing.write_text(json.dumps({"seconds": sec}))
        train_s = json.loads(timing.read_text())["seconds"]
        if not (recorded_stage_dir(row_dir, "eval") / "eval_results.json").is_file():
            run(["dflash-eval", *common, *EVAL, *args.overrides])
        res = json.loads((recorded_stage_dir(row_dir, "eval") / "eval_results.json").read_text())
        held = res["offline"].get("teacher_heldout") or {}
        prefilled = sum(i.startswith(PREFILLED) for i in data.ids)
        row = {"name": name, "sources": [str(s) for s in sources], "samples": len(data), "prefilled": prefilled,
               "reply_tokens": data.manifest["num_loss_tokens"], "teacher_s": teacher_s, "train_s": train_s,
               "cpu_hours": cores * (teacher_s + train_s) / 3600, "steps": steps,
               "heldout": [held.get("tau_offline"), held.get("tau_offline_ci95")],
               **chain_scores(res, online_tokens=True)}
        rows.append(row)
        print(json.dumps(row), flush=True)

    out.mkdir(parents=True, exist_ok=True)
    (out / "recipes.json").write_text(json.dumps(rows, indent=2))

    lines = [f"{cores} cores; {args.experiment}'s recipe; held-out: the row's own split", "",
             "| recipe | samples (prefilled) | reply tokens | steps | teacher min | train min | CPU-hours | "
             "held-out tau | " + BENCHMARK_COLUMNS,
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        h = r["heldout"]
        lines.append(f"| {r['name']} | {r['samples']} ({r['prefilled']}) | {r['reply_tokens']:,} | {r['steps']} | "
                     f"{r['teacher_s'] / 60:.1f} | {r['train_s'] / 60:.1f} | {r['cpu_hours']:.2f} | "
                     + (tau_cell(*h) if h[0] else "") + " | " + benchmark_cells(r))
    (out / "recipes.md").write_text("\n".join(lines) + "\n")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for r in rows:
        tau = (r["mtbench"]["tau_offline"] + r["humaneval"]["tau_offline"]) / 2
        ax.plot(r["cpu_hours"], tau, "o")
        ax.annotate(r["name"], (r["cpu_hours"], tau), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel("CPU-hours of teacher + training")
    ax.set_ylabel("tau_offline, mean of MT-Bench and HumanEval")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "recipes.png", dpi=120, bbox_inches="tight")
    print((out / "recipes.md").read_text())


if __name__ == "__main__":
    main()

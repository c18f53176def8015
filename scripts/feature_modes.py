"""Benchmark: what the way features reach training costs and buys, side by side on one recipe: stored bf16 features,
stored fp8 features (teacher.feature_dtype=float8_e4m3) and none stored (teacher.feature_dtype=none: the target
captures them in the training loop, as trainer.online=true).

    python scripts/feature_modes.py --out runs/feature_modes [--modes bfloat16 float8_e4m3 none] \\
        [--memory-steps 100] [-- extra Hydra overrides]

Each mode is one `dflash-pipeline` run of the recipe (default: the teacher-recipe grid's 0.47 CPU-hour row, 272
regenerated + 672 prefilled prompts, 800 steps, evaluated teacher-forced on 40 MT-Bench and 40 HumanEval prompts
and online on 2 of each) in <out>/<mode>, resumable (a finished stage skips itself). Reported per mode: disk
per token and in all, teacher minutes (the seconds the target spent on the shards), training wall minutes (the
pipeline log's train stage, held-out evaluations included) and seconds per step, held-out tau and tau on MT-Bench
and HumanEval with their intervals. Then training alone for --memory-steps steps on the stored-bf16 and on the
tokens-only dataset, one process each after the other, for peak memory (the process's maximum resident set) and
seconds per step without the pipeline's other stages. Writes <out>/feature_modes.md and feature_modes.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from dflash_pipeline.data.shards import TeacherDataset
from dflash_pipeline.runtime.stages import recorded_stage_dir

sys.path.insert(0, str(Path(__file__).parent))
from bench_common import BENCHMARK_COLUMNS, benchmark_cells, chain_scores, run, tau_cell, train_seconds  # noqa: E402

RECIPE = ["experiment=smollm2_quick", "data.num_samples=272", "teacher.prefill_samples=672", "trainer.steps=800",
          "eval.num_prompts=40", "eval.online_prompts=2", "eval.max_new_tokens=64", "eval.cost_repeats=2",
          "eval.baseline_dtypes=[]", "eval.num_threads=2"]
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/feature_modes")
    ap.add_argument("--modes", nargs="+", default=["bfloat16", "float8_e4m3", "none"])
    ap.add_argument("--memory-steps", type=int, default=100)
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = ap.parse_args()
    out = Path(args.out)
    recipe = RECIPE + args.overrides
    steps = int(next(o for o in reversed(recipe) if o.startswith("trainer.steps=")).partition("=")[2])

    rows = []
    for mode in args.modes:
        folder = out / mode
        results = recorded_stage_dir(folder, "eval") / "eval_results.json"
        if not results.is_file():
            run(["dflash-pipeline", *recipe, f"teacher.feature_dtype={mode}", f"hydra.run.dir={folder}"])
        data = TeacherDataset(recorded_stage_dir(folder, "teacher"), verify=False)
        disk = sum(s["bytes"] for s in data.shards)
        res = json.loads(results.read_text())
        held = res["offline"]["teacher_heldout"]
        train_s = train_seconds(folder / "dflash-pipeline.log")
        row = {"mode": mode, "disk_bytes": disk, "tokens": data.num_tokens, "bytes_per_token": disk / data.num_tokens,
               "teacher_s": data.teacher_seconds, "train_s": train_s, "s_per_step": train_s / steps,
               "heldout": [held["tau_offline"], held["tau_offline_ci95"]], **chain_scores(res)}
        rows.append(row)
        print(json.dumps(row), flush=True)

    memory = {}
    for name, mode in (("stored bf16", "bfloat16"), ("online (tokens only)", "none")):
        if mode not in args.modes:
            continue
        folder = out / f"memory_{mode}"
        record = folder / "usage.json"
        if not record.is_file():
            teacher = recorded_stage_dir(out / mode, "teacher").resolve()
            usage = run(["dflash-train", *recipe, f"trainer.data_dir={teacher}",
                         f"trainer.steps={args.memory_steps}", f"trainer.eval_every={args.memory_steps}",
                         f"trainer.save_every={args.memory_steps}", "logger=none", f"hydra.run.dir={folder}"])
            usage["train_s"] = train_seconds(folder / "dflash-train.log")
            record.write_text(json.dumps(usage))
        memory[name] = json.loads(record.read_text())

    (out / "feature_modes.json").write_text(json.dumps({"rows": rows, "memory": memory}, indent=2))
    lines = [f"{os.cpu_count()} cores; recipe: {' '.join(recipe)}", "",
             "| features | bytes / token | dataset on disk | teacher min | train min (s / step) | held-out tau | "
             + BENCHMARK_COLUMNS,
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['bytes_per_token']:,.0f} | {r['disk_bytes'] / 2**20:,.1f} MiB | "
                     f"{r['teacher_s'] / 60:.1f} | {r['train_s'] / 60:.1f} ({r['s_per_step']:.2f}) | "
                     f"{tau_cell(*r['heldout'])} | " + benchmark_cells(r))
    if memory:
        lines += ["", f"Training alone, {args.memory_steps} steps, one process:", "",
                  "| features | wall s / step (train stage) | peak resident memory |", "|---|---|---|"]
        for name, u in memory.items():
            lines.append(f"| {name} | {u['train_s'] / args.memory_steps:.2f} | {u['max_rss_gib']:.2f} GiB |")
    (out / "feature_modes.md").write_text("\n".join(lines) + "\n")
    print((out / "feature_modes.md").read_text())


if __name__ == "__main__":
    main()

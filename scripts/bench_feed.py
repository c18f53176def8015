"""Benchmark: how the features reach the drafter's trainer, side by side in one run on the same target, data and
cores: stored in the teacher dataset (bf16), captured by the target inside the trainer (a tokens-only dataset,
trainer.online), or spooled by a vLLM feature producer (trainer.features=producer: the trainer loads the target's
embeddings and head only).

    python scripts/bench_feed.py --out runs/bench_feed [--samples 64] [--steps 60] [-- extra Hydra overrides]

The recipe is the main job's (experiment=smollm2_quick) with regenerated replies only (teacher.mode=regenerate).
The teacher datasets come from vLLM (teacher.engine=vllm): one with bf16 features from its own capture
(teacher.capture=engine), one with tokens only (teacher.feature_dtype=none). Each mode then trains --steps steps
(`dflash-train`, one process; the producer in a process of its own beside it, producer.launch=false, so each
process's peak memory is its own). Reported per mode: the trainer's and the producer's peak resident memory
(os.wait4), the training rate (median anchor blocks / s over the logged intervals after the first: steady state,
the engine's start not counted) and its ratio to stored features, the disk the run needs (the dataset plus the
spool's largest size, sampled every 0.2 s), and the largest weight difference to the stored run. Writes
<out>/bench_feed.md and bench_feed.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

from dflash_pipeline.data.shards import TeacherDataset
from dflash_pipeline.models.precision import machine
from dflash_pipeline.runtime.stages import export_dir, recorded_stage_dir

sys.path.insert(0, str(Path(__file__).parent))
from bench_common import run  # noqa: E402

# the main job's target and drafter; regenerated replies only (vLLM's capture does not prefill the dataset's own)
RECIPE = ["experiment=smollm2_quick", "teacher.mode=regenerate", "logger=none"]


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0


def train_with_producer(train_cmd: list[str], producer_cmd: list[str], spool: Path) -> dict:
    """Trainer and producer side by side; each one's wall seconds and peak memory, and the spool's largest size."""
    print("$", " ".join(producer_cmd), "&", flush=True)
    print("$", " ".join(train_cmd), flush=True)
    start = time.perf_counter()
    procs = {"producer": subprocess.Popen(producer_cmd), "trainer": subprocess.Popen(train_cmd)}
    usage, spool_peak = {}, 0
    while len(usage) < len(procs):
        for name, proc in procs.items():
            if name in usage:
                continue
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                if os.waitstatus_to_exitcode(status) != 0:
                    for other in procs.values():
                        other.kill()
                    sys.exit(f"error: the {name} failed (exit {os.waitstatus_to_exitcode(status)}); see its log")
                usage[name] = {"seconds": time.perf_counter() - start, "max_rss_gib": ru.ru_maxrss / 2**20}
        spool_peak = max(spool_peak, folder_bytes(spool))
        time.sleep(0.2)
    return {"trainer": usage["trainer"], "producer": usage["producer"], "spool_peak_bytes": spool_peak}


def blocks_per_s(train_dir: Path) -> float:
    rows = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines()]
    rates = [r["anchor_blocks_per_s"] for r in rows if "anchor_blocks_per_s" in r][1:]
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench_feed")
    ap.add_argument("--samples", type=int, default=64, help="teacher conversations")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    recipe = RECIPE + [f"data.num_samples={args.samples}"] + args.overrides
    teachers = {"bfloat16": out / "teacher_bf16", "none": out / "teacher_tokens"}
    for dtype, folder in teachers.items():
        capture = "engine" if dtype != "none" else "separate"
        run(["dflash-teacher", *recipe, "teacher.engine=vllm", f"teacher.capture={capture}",
             f"teacher.feature_dtype={dtype}", f"hydra.run.dir={folder}"])
    datasets = {dtype: recorded_stage_dir(folder, "teacher") for dtype, folder in teachers.items()}
    train = [*recipe, f"trainer.steps={args.steps}", f"trainer.eval_every={args.steps}",
             f"trainer.save_every={args.steps // 2}", "trainer.log_every=10"]
    modes = {
        "stored bf16 features": (["dflash-train", *train, f"trainer.data_dir={datasets['bfloat16']}"],
                                 datasets["bfloat16"]),
        "target in the trainer (tokens only, trainer.online)": (
            ["dflash-train", *train, f"trainer.data_dir={datasets['none']}", "trainer.online=true"],
            datasets["none"]),
        "vLLM producer (tokens only, trainer.features=producer)": (
            ["dflash-train", *train, f"trainer.data_dir={datasets['none']}", "trainer.features=producer",
             "producer.engine=vllm", "producer.launch=false"], datasets["none"]),
    }
    rows = []
    for i, (name, (cmd, teacher)) in enumerate(modes.items()):
        folder = out / f"train_{i}"
        cmd = [*cmd, f"hydra.run.dir={folder}"]
        if "producer" in name:
            producer = ["dflash-producer", *cmd[1:]]
            usage = train_with_producer(cmd, producer, folder / "spool")
        else:
            usage = {"trainer": run(cmd), "producer": None, "spool_peak_bytes": 0}
        train_dir = recorded_stage_dir(folder, "train")
        rows.append({"mode": name, **usage, "dataset_bytes": folder_bytes(teacher),
                     "blocks_per_s": blocks_per_s(train_dir),
                     "tokens": TeacherDataset(teacher, verify=False).num_tokens,
                     "weights": str(export_dir(train_dir) / "model.safetensors")})
        print(json.dumps(rows[-1]), flush=True)
    first = load_file(rows[0]["weights"])
    for r in rows:
        other = load_file(r["weights"])
        r["max_weight_diff"] = max((first[k].float() - other[k].float()).abs().max().item() for k in first)
    (out / "bench_feed.json").write_text(json.dumps(rows, indent=2))
    base = rows[0]["blocks_per_s"]
    cpu = machine()
    lines = [f"{cpu['cpu']} (flags {' '.join(cpu['cpu_flags'])}), {os.cpu_count()} cores, torch {cpu['torch']}; "
             f"recipe: {' '.join(train)}", "",
             "| features reach the trainer | trainer peak memory | producer peak memory | anchor blocks / s "
             "(x stored) | disk: dataset + spool peak | largest weight difference to stored |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        prod = f"{r['producer']['max_rss_gib']:.2f} GiB" if r["producer"] else "-"
        lines.append(f"| {r['mode']} | {r['trainer']['max_rss_gib']:.2f} GiB | {prod} | {r['blocks_per_s']:.1f} "
                     f"({r['blocks_per_s'] / base:.2f}x) | {r['dataset_bytes'] / 2**20:.1f} MiB + "
                     f"{r['spool_peak_bytes'] / 2**20:.1f} MiB | {r['max_weight_diff']:.1e} |")
    (out / "bench_feed.md").write_text("\n".join(lines) + "\n")
    print((out / "bench_feed.md").read_text())


if __name__ == "__main__":
    main()

"""What the benchmark scripts share (feature_modes.py, teacher_recipes.py, bench_feed.py): one reading of an
eval_results.json and one format for its tau columns, so their tables line up column for column; running a command
for its wall time and peak memory; the train stage's seconds from a run's log. A script imports it after
`sys.path.insert(0, str(Path(__file__).parent))`: tests/test_docs.py runs the scripts the docs show through runpy,
which does not put scripts/ on the path.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

BENCHMARKS = ("mtbench", "humaneval")
BENCHMARK_COLUMNS = "MT-Bench tau off [95% CI] / online | HumanEval tau off [95% CI] / online | exact |"


def ci(x: list | None) -> str:
    """A 95% interval as [low, high]; empty where the evaluation gave none."""
    return "[{:.2f}, {:.2f}]".format(*x) if x else ""


def tau_cell(tau: float, ci95: list | None) -> str:
    """A teacher-forced tau with its interval."""
    return f"{tau:.3f} {ci(ci95)}"


def chain_scores(results: dict, online_tokens: bool = False) -> dict:
    """Per benchmark, from eval_results.json: teacher-forced tau and its interval, the exact chain loop's online tau
    (and the tokens it generated, with online_tokens) and whether it matched the target's greedy reply."""
    scores = {}
    for ds in BENCHMARKS:
        off, on = results["offline"][ds], results["methods"]["chain"][ds]
        scores[ds] = {"tau_offline": off["tau_offline"], "ci95": off["tau_offline_ci95"],
                      "tau_online": on["tau_online"]}
        if online_tokens:
            scores[ds]["online_tokens"] = on["output_tokens"]
        scores[ds]["exact"] = on["exact"]
    return scores


def benchmark_cells(row: dict) -> str:
    """A table row's BENCHMARK_COLUMNS cells (row holds chain_scores' entries), closing the row."""
    return (" | ".join(f"{tau_cell(row[d]['tau_offline'], row[d]['ci95'])} / {row[d]['tau_online']:.2f}"
                       for d in BENCHMARKS)
            + f" | {'yes' if all(row[d]['exact'] for d in BENCHMARKS) else 'NO'} |")


LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")


def run(cmd: list[str]) -> dict:
    """Run a command to the end; its wall seconds and its peak resident memory (os.wait4: this child's own)."""
    print("$", " ".join(cmd), flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"error: {cmd[0]} failed (exit {os.waitstatus_to_exitcode(status)}); its log is in its run folder")
    return {"seconds": time.perf_counter() - start, "max_rss_gib": usage.ru_maxrss / 2**20}


def stamp(line: str) -> datetime:
    return datetime.strptime(LOG_TIME.match(line)[1], "%Y-%m-%d %H:%M:%S,%f")


def train_seconds(log: Path) -> float:
    """Wall seconds of the train stage in a run's log: from its first line to the export."""
    lines = [l for l in log.read_text().splitlines() if LOG_TIME.match(l)]
    start = next(l for l in lines if "] - train: " in l)
    end = next(l for l in lines if "exported the trained drafter" in l)
    return (stamp(end) - stamp(start)).total_seconds()

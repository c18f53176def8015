"""dflash-compare: the key metrics of several runs side by side, and their acceptance curves on one chart.

    dflash-compare runs/smollm2_quick                      # the experiment's run and every job of its sweeps
    dflash-compare runs/a runs/b --png ab.png --md ab.md
    dflash-compare --wandb my-entity/dflash --group smollm2_quick   # runs logged online to wandb

It reads what the stages wrote in each run folder (.hydra/config.yaml, train/metrics.jsonl, eval/eval_results.json),
so it works on runs logged to wandb offline, online or not at all; --wandb reads the same numbers from the wandb
runs' config and summary instead (network access needed).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dflash_pipeline.runtime.files import atomic_path
from dflash_pipeline.runtime.stages import marker, recorded_stage_dir, stage_of_export

# Config keys that never explain a difference in results (where outputs go, how often to log, ...).
NOISE = {"name", "cache_dir", "trainer.out_dir", "teacher.out_dir", "eval.out_dir", "trainer.data_dir",
         "eval.drafter_dir", "trainer.log_every", "trainer.save_every", "trainer.keep_checkpoints",
         "trainer.resume", "logger.kind", "logger.mode", "logger.group", "logger.project", "logger.entity",
         "logger.tags"}


class CompareError(Exception):
    """Nothing comparable was found where the user pointed."""


@dataclass
class Run:
    """One run's config (flattened, dotted keys) and the metrics the comparison shows."""

    label: str
    config: dict = field(default_factory=dict)
    heldout_tau: float | None = None  # held-out teacher tau_offline (eval stage, else the last training eval)
    train_tokens_per_s: float | None = None  # median over the logged training windows
    train_steps: int | None = None
    online: dict = field(default_factory=dict)  # "method/dataset" -> tau_off, tau_on, speedup, a_k_online, exact
    heldout_a_k: list[float] | None = None


# -- reading run folders -----------------------------------------------------------------------------------------
def flatten(node, prefix: str = "") -> dict:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            out.update(flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: node}


def has_results(folder: Path) -> bool:
    return marker("eval", recorded_stage_dir(folder, "eval")).is_file() or \
        (recorded_stage_dir(folder, "train") / "metrics.jsonl").is_file()


def discover(paths: list[str]) -> list[Path]:
    """Run folders named on the command line; a folder holding a sweep (multirun/) also brings every job."""
    found: list[Path] = []
    for p in map(Path, paths):
        if not p.is_dir():
            raise CompareError(f"{p} is not a folder; give run folders (runs/<name>, or a sweep job's folder)")
        here = [p] if has_results(p) else []
        jobs = sorted(j for j in p.glob("multirun/*") if j.is_dir() and has_results(j))
        if not here and not jobs:
            raise CompareError(f"{p} holds no run results (train/metrics.jsonl or eval/eval_results.json), and no "
                               "sweep jobs under multirun/")
        found += here + jobs
    return list(dict.fromkeys(found))


def read_run(folder: Path) -> Run:
    """A run folder's config and metrics. A sweep job is named <experiment>/<its overrides> (its folder's name),
    as its wandb runs are; another run by its folder."""
    from omegaconf import OmegaConf

    run = read_stages(recorded_stage_dir(folder, "eval"), recorded_stage_dir(folder, "train"), label=folder.name)
    cfg_file = folder / ".hydra" / "config.yaml"
    if cfg_file.is_file():
        run.config = flatten(OmegaConf.to_container(OmegaConf.load(cfg_file), resolve=False))
    if folder.parent.name == "multirun":
        run.label = f"{run.config.get('name', folder.parent.parent.name)}/{folder.name}"
    return run


def read_stages(eval_dir: Path | None, train_dir: Path | None, label: str = "") -> Run:
    """The metrics the eval and train stages wrote in these folders (either may be None or missing). Held-out tau
    comes from the eval stage when it ran, else from the training run's last held-out evaluation."""
    run = Run(label=label)
    results_file = marker("eval", eval_dir) if eval_dir is not None else None
    if results_file is not None and results_file.is_file():
        results = json.loads(results_file.read_text())
        held = results["offline"].get("teacher_heldout")
        if held:
            run.heldout_tau, run.heldout_a_k = held["tau_offline"], held["a_k"]
        for m, per in results["methods"].items():
            for ds, r in per.items():
                run.online[f"{m}/{ds}"] = {k: r.get(k) for k in ("tau_offline", "tau_online", "speedup", "a_k_online",
                                                                 "exact")}
        drafter = Path(results["drafter_dir"])  # the train stage may live elsewhere (shared by a sweep)
        if (train_dir is None or not (train_dir / "metrics.jsonl").is_file()) and \
                (stage_of_export(drafter) / "metrics.jsonl").is_file():
            train_dir = stage_of_export(drafter)
    if train_dir is not None and (train_dir / "metrics.jsonl").is_file():
        rows = [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
        speeds = [r["tokens_per_s"] for r in rows if "tokens_per_s" in r]
        run.train_tokens_per_s = statistics.median(speeds) if speeds else None
        run.train_steps = max((r["step"] for r in rows), default=None)
        held = [r["heldout"] for r in rows if "heldout" in r]
        if held and run.heldout_tau is None:
            run.heldout_tau, run.heldout_a_k = held[-1]["tau_offline"], held[-1]["a_k"]
    return run


# -- reading wandb -----------------------------------------------------------------------------------------------
def read_wandb(project: str, group: str | None, api=None) -> list[Run]:
    """Runs of a wandb project (optionally one group): the train and eval runs of a job are joined by name."""
    if api is None:
        try:
            import wandb
        except ImportError as e:
            raise CompareError("--wandb needs the wandb package: pip install wandb") from e
        api = wandb.Api()
    filters = {"group": group} if group else {}
    by_name: dict[str, Run] = {}
    for r in api.runs(project, filters=filters):
        job = r.job_type or r.name.rsplit("-", 1)[-1]
        label = r.name[: -len(job) - 1] if r.name.endswith(f"-{job}") else r.name
        run = by_name.setdefault(label, Run(label=label))
        raw = {k: v["value"] if isinstance(v, dict) and set(v) <= {"value", "desc"} and "value" in v else v
               for k, v in dict(r.config).items()}  # older API versions wrap each value as {"value": ...}
        run.config = run.config or flatten(raw)
        s = dict(getattr(r, "summary_metrics", None) or r.summary)
        if job == "train":
            run.train_steps = s.get("_step")
            run.train_tokens_per_s = s.get("tokens_per_s")
            if run.heldout_tau is None and s.get("heldout/tau_offline") is not None:
                run.heldout_tau = s["heldout/tau_offline"]
                run.heldout_a_k = _positions(s, "heldout/a")
        elif job == "eval":
            if s.get("offline/teacher_heldout/tau_offline") is not None:
                run.heldout_tau = s["offline/teacher_heldout/tau_offline"]
                run.heldout_a_k = _positions(s, "offline/teacher_heldout/a")
            turns = range(2, (run.config.get("eval.turns") or 1) + 1)  # later turns: <set>_turn<k>
            for key in [f"{m}/{ds}/" for m in run.config.get("eval.methods") or ["chain"]
                        for base in run.config.get("eval.datasets") or []
                        for ds in [base, *(f"{base}_turn{k}" for k in turns)]]:
                if s.get(key + "tau_online") is None:
                    continue
                run.online[key[:-1]] = {"tau_offline": s.get(key + "tau_offline"), "tau_online": s[key + "tau_online"],
                                  "speedup": s.get(key + "speedup"), "exact": bool(s.get(key + "exact", 0)),
                                  "a_k_online": _positions(s, key + "a_k_online")}
    if not by_name:
        raise CompareError(f"no runs in wandb project {project}" + (f" group {group}" if group else ""))
    return list(by_name.values())


def _positions(summary: dict, base: str) -> list[float]:
    """summary[base_1], summary[base_2], ... (RunLogger writes a per-position list as one scalar per position)."""
    out, k = [], 1
    while f"{base}_{k}" in summary:
        out.append(summary[f"{base}_{k}"])
        k += 1
    return out


# -- the comparison ----------------------------------------------------------------------------------------------
def config_differences(runs: list[Run]) -> list[str]:
    """Dotted config keys whose value is not the same in every run (the columns that explain the rows)."""
    keys = sorted({k for r in runs for k in r.config} - NOISE)
    return [k for k in keys if len({json.dumps(r.config.get(k, "-"), default=str) for r in runs}) > 1]


def datasets_of(runs: list[Run]) -> list[str]:
    """The "method/dataset" keys of the online results, in order of appearance."""
    return list(dict.fromkeys(key for r in runs for key in r.online))


def _short(keys: list[str]) -> dict[str, str]:
    """Column names: the dataset alone when every run used one and the same method (chain), else method/dataset."""
    one_method = len({k.split("/", 1)[0] for k in keys}) <= 1
    return {k: k.split("/", 1)[1] if one_method else k for k in keys}


def table(runs: list[Run]) -> tuple[list[str], list[list]]:
    """Header and rows: config differences, held-out tau, per eval set tau offline / online / speedup, train tok/s."""
    diffs, sets = config_differences(runs), datasets_of(runs)
    name = _short(sets)
    header = ["run", *diffs, "teacher_heldout tau_off"]
    for key in sets:
        header += [f"{name[key]} tau_off", f"{name[key]} tau_on", f"{name[key]} speedup"]
    header += ["exact", "train tok/s", "steps"]
    rows = []
    for r in runs:
        row = [r.label, *[r.config.get(k, "-") for k in diffs], r.heldout_tau]
        for ds in sets:
            o = r.online.get(ds, {})
            row += [o.get("tau_offline"), o.get("tau_online"), o.get("speedup")]
        exact = [o.get("exact") for o in r.online.values()]
        row += ["-" if not exact else ("yes" if all(exact) else "NO"), r.train_tokens_per_s, r.train_steps]
        rows.append(row)
    return header, rows


def _cell(v, column: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if column.endswith("speedup"):
            return f"{v:.2f}x"
        if column.startswith("train tok/s"):
            return f"{v:.0f}"
        return f"{v:.3f}" if abs(v) >= 1e-2 or v == 0 else f"{v:.2e}"
    return str(v)


def markdown(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v, c) for v, c in zip(row, header)) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def plot(runs: list[Run], path: Path) -> None:
    """One panel per eval set (plus the held-out teacher data): a_k per draft position, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("held-out teacher (offline)", {r.label: r.heldout_a_k for r in runs if r.heldout_a_k})]
    name = _short(datasets_of(runs))
    panels += [(f"{name[key]} (online)", {r.label: r.online[key]["a_k_online"] for r in runs
                                          if key in r.online and r.online[key].get("a_k_online")})
               for key in datasets_of(runs)]
    panels = [(t, c) for t, c in panels if c]
    if not panels:
        raise CompareError("no acceptance curves to plot: the runs have neither eval results nor held-out metrics")
    colors = {r.label: f"C{i % 10}" for i, r in enumerate(runs)}  # a run has the same color in every panel
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4 + 0.2 * len(runs)), squeeze=False,
                             sharey=True)
    for ax, (title, curves) in zip(axes[0], panels):
        for label, a_k in curves.items():
            ax.plot(range(1, len(a_k) + 1), a_k, "-o", color=colors[label], markersize=3, label=label)
        longest = max(len(a_k) for a_k in curves.values())
        ax.set(title=title, xlabel="draft position k", ylim=(0, 1.02), xticks=range(1, longest + 1))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("conditional acceptance a_k")
    handles = {h.get_label(): h for ax in axes[0] for h in ax.get_lines()}
    fig.legend([handles[r.label] for r in runs if r.label in handles], [r.label for r in runs if r.label in handles],
               loc="lower center", ncol=min(2, len(runs)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.05 + 0.1 * ((len(runs) + 1) // 2) / 2, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def compare(paths: list[str] | None = None, *, wandb_project: str | None = None, group: str | None = None,
            png: Path | None = None, md: Path | None = None, api=None) -> tuple[list[str], list[list]]:
    if wandb_project:
        runs = read_wandb(wandb_project, group, api)
    else:
        folders = discover(paths or [])
        runs = [read_run(f) for f in folders]
    header, rows = table(runs)
    if md is not None:
        md.write_text(markdown(header, rows))
    if png is not None:
        plot(runs, png)
    return header, rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="dflash-compare", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("runs", nargs="*", help="run folders; a folder with a multirun/ sweep brings all its jobs")
    parser.add_argument("--wandb", metavar="ENTITY/PROJECT", help="read runs from wandb instead of folders")
    parser.add_argument("--group", help="with --wandb: only this group (the experiment name)")
    parser.add_argument("--png", type=Path, default=Path("compare.png"), help="acceptance chart (default compare.png)")
    parser.add_argument("--md", type=Path, help="also write the table to this markdown file")
    args = parser.parse_args(argv)
    if not args.runs and not args.wandb:
        parser.error("give run folders or --wandb ENTITY/PROJECT")
    try:
        header, rows = compare(args.runs, wandb_project=args.wandb, group=args.group, png=args.png, md=args.md)
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(markdown(header, rows), end="")
    print(f"\nacceptance per position: {args.png}")

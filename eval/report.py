"""What the eval stage writes from its record (eval/results.py): eval_results.json (`as_json`: what was evaluated,
then the figures), results.md (tables), acceptance.png (a_k offline vs online), and the wandb summary (scalars, a
table, a line plot per method). Files are written atomically (tmp + os.replace); `write_outputs` writes them all.
The tables, plot and summary read the JSON form, so that a finished run's file gives the same summary.
"""
from __future__ import annotations

import logging
from pathlib import Path

from dflash_pipeline.runtime.files import atomic_path, write_json, write_text
from dflash_pipeline.eval.metrics import simulated_tau
from dflash_pipeline.eval.results import EvalRecord
from dflash_pipeline.runtime.logger import RunLogger

log = logging.getLogger(__name__)


def as_json(r: EvalRecord) -> dict:
    """The record as eval_results.json holds it: the header's keys, then the figures (keys and order unchanged
    across versions: dflash-compare and wandb read old and new runs alike)."""
    h = r.header
    out = {
        "config_hash": h.config_hash,
        "not_run": h.not_run,
        "target": h.target,
        "drafter_dir": h.drafter_dir,
        "block_size": h.block_size,
        "trained_block_size": h.trained_block_size,
        "temperature": h.temperature,
        **({"acceptance_rule": h.acceptance_rule} if h.acceptance_rule is not None else {}),
        "max_new_tokens": h.max_new_tokens,
        "datasets": h.datasets,
        "prompts": h.prompts,
        "references": h.references,
        "timing": h.timing,
        "numerics": h.numerics,
        "offline": {"teacher_heldout": r.heldout, **{label: s.offline for label, s in r.sets.items()}},
        "methods": {m: {label: s.methods[m].figures for label, s in r.sets.items() if m in s.methods}
                    for m in h.methods},
        "offline_note": r.offline_note,
        "costs": {**r.costs, "per_set": {label: s.costs for label, s in r.sets.items()}},
        "policies": r.policies,
    }
    if r.served is not None:
        v = r.served
        out["served"] = {"engine": v.engine, "target_dir": v.target_dir, "threads": v.threads, "dtype": v.dtype,
                         "tolerance": v.tolerance, "sets": v.sets, **({"gguf": v.gguf} if v.gguf else {}),
                         "pass": v.passed}
    return out


def _f(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _ci(interval) -> str:
    return "" if not interval else f" [{interval[0]:.2f}, {interval[1]:.2f}]"


def markdown(results: dict) -> str:
    """results.md: the method table, the target's numerics, the cost curve and the chosen policy settings, the
    held-out teacher figures, a_k per position (with the served section after it) and the methods not run."""
    lines = _method_table(results)
    lines += _numerics_lines(results.get("numerics"))
    lines += _cost_lines(results.get("costs"))
    for m, chosen in (results.get("policies") or {}).items():
        lines.append(f"- {m}: " + ", ".join(f"{k} {v}" for k, v in chosen.items()))
    held = results["offline"].get("teacher_heldout")
    lines += _heldout_lines(held, results.get("offline_note", "no teacher data"))
    lines += _per_position_lines(results, held)
    if results.get("not_run"):
        lines += ["", "Not run on this target:", ""] + [f"- {m}: {why}" for m, why in results["not_run"].items()]
    return "\n".join(lines) + "\n"


def _method_table(results: dict) -> list[str]:
    """The title, what was run where, and one table row per method and eval set."""
    lines = [
        f"# Evaluation: {results['target']}, block {results['block_size']} (trained {results['trained_block_size']}), "
        f"temperature {results['temperature']}",
        "",
        f"Drafter: `{results['drafter_dir']}`; up to {results['max_new_tokens']} new tokens per prompt; timing on "
        f"{results['timing']['device']} ({results['timing']['num_threads']} threads): {results['timing']['protocol']}.",
        "",
        "| method | dataset | prompts off / on | tokens | tau offline [95% CI] | tau online [95% CI over prompts] | "
        "oracle tau | a_1 off / on | fwd/token | "
        "drafts verified/round | draft ms/round | select ms/round (share) | scorings/round | verify ms/round | "
        "AR tok/s | spec tok/s | speedup total / decode (predicted) | round cost in AR steps: decode / predicted | "
        "exact (near-ties / outputs) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for m, per in results["methods"].items():
        lines += [_method_row(m, ds, r) for ds, r in per.items()]
    return lines


def _method_row(m: str, ds: str, r: dict) -> str:
    """One method on one eval set: acceptance offline and online, the round's costs, speed and exactness."""
    return (
        f"| {m} | {ds} | {r.get('offline_prompts', r['prompts'])} / {r['prompts']} | {r['output_tokens']} | "
        f"{_f(r['tau_offline'])}{_ci(r.get('tau_offline_ci95'))} | "
        f"{_f(r['tau_online'])}{_ci(r.get('tau_online_ci95'))}{_prefix(r)} | {_f(r.get('oracle_tau'))} | "
        f"{_f(r['a_k_offline'][0])} / "
        f"{_f(r['a_k_online'][0])} | {_f(r['target_forwards_per_token'])} | "
        f"{_f(r.get('verified_per_round'), 2)} | {_f(r['draft_ms_per_round'], 2)} | "
        f"{_f(r['select_ms_per_round'], 2)} ({100 * r['select_fraction']:.1f}%) | "
        f"{_f(r['scorings_per_round'], 0)} | {_f(r['verify_ms_per_round'], 2)} | {_f(r['tokens_per_s_ar'], 1)} | "
        f"{_f(r['tokens_per_s_spec'], 1)} | {_f(r['speedup'], 2)}x / {_f(r.get('speedup_decode'), 2)}x "
        f"({_f(r.get('predicted_speedup'), 2)}x)"
        + (f"; vs fastest AR ({r['fastest_ar_dtype']}) {_f(r['speedup_vs_fastest_ar'], 2)}x"
           if len(r.get("ms_per_token_ar_by_dtype", {})) > 1 else "")
        + f" | {_f(r.get('round_cost_in_decode'), 2)} / "
        f"{_f(r.get('round_cost_predicted'), 2)} | {r['exact']} ({r.get('near_tie_outputs', 0)} / "
        f"{r.get('outputs_compared', '-')}) |")


def _numerics_lines(num: dict | None) -> list[str]:
    """The target's dtype and machine, what counts as exact (near-tie tolerance), and whether the teacher data was
    made with the same numerics: the context an exactness or acceptance figure is read in."""
    if not num:
        return []
    machine = num.get("machine") or {}
    return ["", f"Target numerics: {num['dtype']} (asked: {num.get('requested')}) on {machine.get('cpu')}, "
            f"flags {', '.join(machine.get('cpu_flags', [])) or 'none listed'}"
            + (f", GPU {machine['gpu']}" if machine.get("gpu") else "")
            + (f"; near-tie tolerance {num['near_tie_tolerance']} nats (float32 log-prob gap at the first "
               "divergence): tau online counts every round; a near-tie output's rounds before the "
               "divergence alone give the figure after 'before near-ties'"
               if num.get("near_tie_tolerance") is not None else "; every output must be identical")
            + (f". Teacher data made with a {num['teacher_dtype']} target: "
               + ("the same numerics." if num["same_as_teacher"] else "OTHER numerics than this evaluation.")
               if "teacher_dtype" in num else ".")]


def _cost_lines(costs: dict | None) -> list[str]:
    """The verify-cost curve the predicted speedups rest on: the run's, each eval set's, and the tree verification
    costs, with how a prediction and a round cost are computed from them."""
    if not costs:
        return []
    curve = ", ".join(f"{n}: {c:.2f}" for n, c in enumerate(costs["verify_cost"], 1))
    lines = ["", f"Verify cost c(n) / c(1) on this target, measured at the start of this run at "
             f"{costs.get('context_tokens', '?')} tokens of context: {curve}; the drafter's block forward "
             f"{costs['draft_cost']:.2f}; a plain autoregressive step {costs.get('ar_cost', 1.0):.2f}; one target "
             f"step {costs['step_ms']:.1f} ms. Each eval set's prediction uses a curve measured again just before "
             "its timing, at its median decode context (prompt + half the reply): predicted speedup = tokens x "
             "autoregressive step / sum over rounds of (c(drafts verified + 1) + draft cost), the decode without "
             "prefill, so it compares with the decode speedup. Round cost in AR steps: a round's draft + verify "
             "time inside the timed decodes over the autoregressive runs' step (decode), and as the curve "
             "predicts it."]
    for label, c in (costs.get("per_set") or {}).items():
        lines.append(f"- {label}: at {c['context_tokens']} tokens, c(n) " +
                     ", ".join(f"{x:.2f}" for x in c["verify_cost"]) +
                     f"; draft {c['draft_cost']:.2f}; autoregressive step {c['ar_cost']:.2f}")
    if costs.get("tree_cost"):
        trees = ", ".join(f"{n} nodes: {c:.2f}" for n, c in costs["tree_cost"].items())
        lines += ["", f"Tree verification (one forward over anchor + N nodes with the ancestor mask, greedy walk, "
                  f"KV compaction) / a 1-token step: {trees}. For tree methods, drafts verified/round are the "
                  "tree's nodes and select ms/round is the tree's build time (after the drafter's forward)."]
    return lines


def _heldout_lines(held: dict | None, note: str) -> list[str]:
    """The drafter's teacher-forced figures on the held-out teacher sequences, or why there are none."""
    lines = ["", "## Offline (teacher-forced) on the held-out teacher sequences", ""]
    if held:
        return lines + [f"{held['sequences']} sequences, {held['blocks']} blocks: tau_offline "
                        f"{_f(held['tau_offline'])}{_ci(held.get('tau_offline_ci95'))}.", ""]
    return lines + [f"Not measured: {note}.", ""]


def _per_position_lines(results: dict, held: dict | None) -> list[str]:
    """a_k (and the held-out Recall@K) per draft position k, then the served section: served_markdown adds its
    sets' rows to this table (through row) and returns its own section, which follows the table."""
    B = results["block_size"]
    positions = " | ".join(str(k) for k in range(1, B))
    lines = ["## Per position k", "", f"| series | {positions} |", "|---|" + "---|" * (B - 1)]

    def row(name, values):
        lines.append(f"| {name} | " + " | ".join(_f(v) for v in values) + " |")

    if held:
        row("teacher held-out a_k", held["a_k"])
        for k, v in held["recall"].items():
            row(f"teacher held-out Recall@{k}", v)
    for m, per in results["methods"].items():
        for ds, r in per.items():
            row(f"{m} {ds} a_k offline", r["a_k_offline"])
            row(f"{m} {ds} a_k online", r["a_k_online"])
    served = served_markdown(results.get("served"), row)  # after its rows were added to the table
    return lines + served


def _prefix(r: dict) -> str:
    """The online tau over the rounds before near-tie divergences, where some output diverged."""
    if not r.get("near_tie_outputs") or r.get("tau_online_verified_prefix") is None:
        return ""
    return (f"; before near-ties {_f(r['tau_online_verified_prefix'])} "
            f"({r['rounds_verified_prefix']} of {r['rounds']} rounds)")


def summary(results: dict, out: Path | None = None) -> str:
    """What the console shows when an evaluation ends (or is found complete): one line per method and set with the
    headline figures, the served figures and gate when vLLM ran, and where the full tables and the plot are."""
    lines = [f"{'method':<18} {'set':<14} {'tau offline':>11} {'tau online':>10} {'a_1 / a_2 / a_3 online':>22} "
             f"{'AR tok/s':>8} {'spec tok/s':>10} {'speedup':>7}  exact"]
    for m, per in results["methods"].items():
        for ds, r in per.items():
            a = " / ".join(_f(x, 2) for x in r["a_k_online"][:3])
            lines.append(f"{m:<18} {ds:<14} {_f(r['tau_offline']):>11} {_f(r['tau_online']):>10} {a:>22} "
                         f"{_f(r['tokens_per_s_ar'], 1):>8} {_f(r['tokens_per_s_spec'], 1):>10} "
                         f"{_f(r['speedup'], 2) + 'x':>7}  {r['exact']}")
    held = results["offline"].get("teacher_heldout")
    if held:
        lines.append(f"held-out teacher sequences: tau_offline {_f(held['tau_offline'])}"
                     f"{_ci(held.get('tau_offline_ci95'))}")
    served = results.get("served")
    if served:
        for ds, r in served["sets"].items():
            speed = f", {_f(r['speedup'], 2)}x its plain decoding" if "speedup" in r else \
                f" at T={r['temperature']}, {r['rule']} rule"
            lines.append(f"served ({served['engine']}, {served['dtype']}) {ds}: tau {_f(r['tau_served'])} "
                         f"(own loop {_f(r['tau_own'])}){speed}; gate {'pass' if r['gate']['pass'] else 'FAIL'}")
    if out is not None:
        lines.append(f"tables: {out / 'results.md'}; plot: {out / 'acceptance.png'}")
    return "\n".join(lines)


def served_markdown(served: dict | None, row) -> list[str]:
    """The served section: per set the three acceptance figures per position (teacher-forced, own loop, served),
    the gate's verdict, exactness and speed of the engine's speculative against its plain decoding."""
    if not served:
        return []
    if any("temperature" in r for r in served["sets"].values()):
        return sampled_markdown(served)
    lines = ["", f"## Served ({served['engine']}, {served['dtype']}, {served['threads']} threads)", "",
             "Parity gate: " + ("passed on every set." if served["pass"] else "FAILED (see the lines below)."), "",
             "| set | prompts | tau teacher-forced / own loop / served | drafts own / served | spec = plain outputs | "
             "near-ties / wrong vs own AR | plain tok/s | spec tok/s | speedup | batched plain / spec tok/s (speedup) "
             "| spec vs own fastest AR | gate |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for ds, r in served["sets"].items():
        tau_tf = simulated_tau(r["a_k_teacher_forced"])
        batched = (f"{_f(r['tokens_per_s_plain_batched'], 1)} / {_f(r['tokens_per_s_spec_batched'], 1)} "
                   f"({_f(r['speedup_batched'], 2)}x, {r['batch']} requests)" if "batch" in r else "-")
        lines.append(f"| {ds} | {r['prompts']} | {_f(tau_tf)} / {_f(r['tau_own'])} / {_f(r['tau_served'])} | "
                     f"{r['counters_own']['drafts']} / {r['counters_served']['drafts']} | "
                     f"{r['spec_identical_to_plain']} / {r['prompts']} | {len(r['near_ties'])} / {len(r['wrong'])} | "
                     f"{_f(r['tokens_per_s_plain'], 1)} | {_f(r['tokens_per_s_spec'], 1)} | {_f(r['speedup'], 2)}x | "
                     f"{batched} | {_f(r['speedup_vs_own_fastest_ar'], 2)}x | {'pass' if r['gate']['pass'] else 'FAIL'} |")
    lines.append("")
    lines += [f"- {ds}: {r['gate']['line']}" for ds, r in served["sets"].items()]
    lines.append("")
    for ds, r in served["sets"].items():
        row(f"{ds} a_k teacher-forced", r["a_k_teacher_forced"])
        row(f"{ds} a_k own loop", r["a_k_own"])
        row(f"{ds} a_k served", r["a_k_served"])
    return lines


def _rate(cell: dict) -> str:
    return f"{_f(cell['rate'])} [{_f(cell['low'])}, {_f(cell['high'])}]"


def sampled_markdown(served: dict) -> list[str]:
    """The served section at temperature > 0: per set and run kind (own loop under both rules, served seeded,
    unseeded, batched) tau and a_1..a_3 with 95% intervals over decodes, the tests and the gate's verdict."""
    lines = ["", f"## Served at temperature ({served['engine']}, {served['dtype']}, {served['threads']} threads)", "",
             "Statistical gate: " + ("passed on every set." if served["pass"] else "FAILED (see the lines below)."),
             "", "| set | run | decodes | drafts | tau [95%] | a_1 [95%] | a_2 [95%] | a_3 [95%] |",
             "|---|---|---|---|---|---|---|---|"]
    for ds, r in served["sets"].items():
        for kind, t in r["rates"].items():
            cells = " | ".join(_rate(a) for a in (t["a_k"] + [{"rate": None, "low": None, "high": None}] * 3)[:3])
            lines.append(f"| {ds} | {kind} | {t['decodes']} | {t['drafts']} | {_f(t['tau'])} [{_f(t['tau_low'])}, "
                         f"{_f(t['tau_high'])}] | {cells} |")
    lines.append("")
    for ds, r in served["sets"].items():
        dist = r["distribution"]
        lines.append(f"- {ds} (T={r['temperature']}, engine draft sampling {r['draft_sample_method']}, own rule "
                     f"{r['rule']}; vLLM {r['engine']['version']}, checks {r['engine']['checks']}, repaired "
                     f"{r['engine']['repaired'] or 'nothing'}): {r['gate']['line']}; seeded vs unseeded differ at "
                     f"positions {r['seeded_vs_unseeded']['differ'] or 'none'}; PIT chi-square p served "
                     f"{_f(dist['served']['p'])}, own {_f(dist['own']['p'])}")
    return lines


def plot_acceptance(results: dict, path: Path) -> None:
    """One panel per method: a_k per position, offline (dashed) vs online (solid) per eval set, and the teacher
    held-out offline curve (black, dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(results["methods"])
    xs = list(range(1, results["block_size"]))
    fig, axes = plt.subplots(1, max(1, len(methods)), figsize=(6 * max(1, len(methods)), 4), squeeze=False)
    held = results["offline"].get("teacher_heldout")
    for ax, m in zip(axes[0], methods):
        for i, (ds, r) in enumerate(results["methods"][m].items()):
            color = f"C{i}"
            ax.plot(xs, r["a_k_online"], "-o", color=color, label=f"{ds} online (tau {r['tau_online']:.2f})")
            ax.plot(xs, r["a_k_offline"], "--", color=color, label=f"{ds} offline (tau {r['tau_offline']:.2f})")
        if held:
            ax.plot(xs, held["a_k"], ":", color="black", label=f"teacher held-out (tau {held['tau_offline']:.2f})")
        ax.set(title=f"{m}: conditional acceptance a_k", xlabel="draft position k", ylabel="a_k", ylim=(0, 1.02),
               xticks=xs)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    served = results.get("served")
    if served and "chain" in methods:  # the chain panel also shows the served curve of each set
        ax = axes[0][methods.index("chain")]
        for i, (ds, r) in enumerate(served["sets"].items()):
            ax.plot(xs, r["a_k_served"], "-.s", color=f"C{i}", markersize=4,
                    label=f"{ds} served {served['engine']} (tau {r['tau_served']:.2f})")
        ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


def loggable(results: dict) -> dict:
    """The numeric part of the results, nested, for RunLogger.log (lists become one scalar per position)."""

    def numeric(d: dict) -> dict:
        out = {}
        for k, v in d.items():
            if isinstance(v, bool) or v is None or isinstance(v, str):
                if isinstance(v, bool):
                    out[k] = int(v)
                continue
            if isinstance(v, dict):
                out[k] = numeric(v)
            elif isinstance(v, (int, float)) or (isinstance(v, list) and all(isinstance(x, (int, float)) for x in v)):
                out[k] = v
        return out

    metrics = {f"offline/{ds}": numeric(r) for ds, r in results["offline"].items() if r}
    for m, per in results["methods"].items():
        metrics.update({f"{m}/{ds}": numeric(r) for ds, r in per.items()})
    for ds, r in ((results.get("served") or {}).get("sets") or {}).items():
        metrics[f"served/{ds}"] = {**numeric(r), "gate_pass": int(r["gate"]["pass"])}
    return metrics


def log_wandb(logger, results: dict) -> None:
    """A summary table and per-method line plots of a_k (offline vs online) when logging to wandb."""
    run = getattr(logger, "wandb", None)
    if run is None:
        return
    import wandb

    columns = ["method", "dataset", "prompts", "output_tokens", "tau_offline", "tau_online", "oracle_tau", "speedup",
               "select_ms_per_round", "scorings_per_round",
               "tokens_per_s_ar", "tokens_per_s_spec", "target_forwards_per_token", "exact"]
    table = wandb.Table(columns=columns)
    for m, per in results["methods"].items():
        for ds, r in per.items():
            table.add_data(m, ds, *[r[c] for c in columns[2:]])
    payload = {"eval/summary": table}
    xs = list(range(1, results["block_size"]))
    for m, per in results["methods"].items():
        ys, keys = [], []
        for ds, r in per.items():
            ys += [r["a_k_online"], r["a_k_offline"]]
            keys += [f"{ds} online", f"{ds} offline"]
        held = results["offline"].get("teacher_heldout")
        if held:
            ys.append(held["a_k"])
            keys.append("teacher held-out")
        if m == "chain" and results.get("served"):
            for ds, r in results["served"]["sets"].items():
                ys.append(r["a_k_served"])
                keys.append(f"{ds} served")
        payload[f"eval/{m}_acceptance"] = wandb.plot.line_series(xs=xs, ys=ys, keys=keys, xname="draft position k",
                                                                 title=f"{m}: a_k offline vs online")
    run.log(payload, step=0)
    for m, per in results["methods"].items():
        for ds, r in per.items():
            run.summary[f"{m}/{ds}/tau_online"] = r["tau_online"]
            run.summary[f"{m}/{ds}/speedup"] = r["speedup"]


def write_outputs(cfg, out: Path, record: EvalRecord, results_name: str) -> None:
    """Every output of the eval stage: metrics.jsonl (+ wandb), results.md, acceptance.png, and last the results
    file, whose presence marks the stage complete."""
    results = as_json(record)
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    logger = RunLogger(cfg, out, "eval")
    logger.log(loggable(results), step=0)
    log_wandb(logger, results)
    logger.finish()
    write_text(out / "results.md", markdown(results))
    plot_acceptance(results, out / "acceptance.png")
    write_json(out / results_name, results, indent=2)  # last: its presence marks the stage complete
    log.info("evaluation written to %s; results:\n%s", out, summary(results, out))

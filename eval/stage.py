"""Evaluation stage (dflash-eval): the drafter's acceptance offline and with real verification, and its speed.

Offline (teacher-forced, no generation; every anchor of every sequence; docs/metrics.md, 'Offline evaluation'):
- `teacher_heldout`: the held-out teacher sequences of the training run (DrafterComponent.heldout_idx), reported
  once: they come from teacher data, not from an eval set. Skipped (null) when the teacher data is absent or is not
  the data the drafter was trained on (then the held-out split is unknown).
- per eval set: the same metrics on [prompt + the target's own autoregressive reply] of that set's prompts. This is
  cheap (one feature-capture prefill per prompt) and puts offline and online numbers on the SAME tokens, so the
  gap between tau_offline and tau_online is measured, not guessed across data sets.
Online (per method and eval set): speculative decoding vs autoregressive decoding of the same prompts. Timing
protocol: one warm-up pair per eval set, then per prompt A B B A (AR, spec, spec, AR) x timing_repeats; times are
medians of per-run seconds per output token. Acceptance statistics come from the first speculative run of each
prompt. Greedy: every speculative output must equal the autoregressive one token for token (ExactnessError).

Outputs (atomic): eval_results.json, results.md, acceptance.png, metrics.jsonl (+ wandb with logger=wandb).
"""
from __future__ import annotations

import json
import logging
import statistics
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from omegaconf import DictConfig, OmegaConf

from dflash_pipeline.conf.progress import Progress
from dflash_pipeline.conf.schema import PolicyConfig, check_config
from dflash_pipeline.conf.stages import config_hash, recorded_hash
from dflash_pipeline.data.files import write_json, write_text
from dflash_pipeline.data.shards import TeacherDataset
from dflash_pipeline.data.sources import load_conversations
from dflash_pipeline.eval import report
from dflash_pipeline.eval import served as served_eval
from dflash_pipeline.models.vllm_engine import vllm_python
from dflash_pipeline.eval.decode import SpecResult, autoregressive, speculative
from dflash_pipeline.eval.exactness import DEFAULT_TOLERANCE, NEAR_TIE, WRONG, ExactnessJudge, rounds_before
from dflash_pipeline.eval.metrics import accepted_length_stats, bootstrap_tau, offline_metrics
from dflash_pipeline.eval.policies import EvalContext, measure_costs
from dflash_pipeline.eval.references import ReferenceCache, turn_prompts
from dflash_pipeline.eval.tree import TreeMethod, check_target, tree_offline_metrics
from dflash_pipeline.models.drafter import DFlashDrafter
from dflash_pipeline.models.generation import recapture
from dflash_pipeline.models.target import Target, load_target, target_folder, torch_dtype
from dflash_pipeline.data.splits import split_heldout, step_seed
from dflash_pipeline.conf import catalogue
from dflash_pipeline.conf.logger import RunLogger

log = logging.getLogger(__name__)

RESULTS = "eval_results.json"
COST_CONTEXT = 256  # context of the policies' verify-cost curve (each eval set measures its own: decode_context)
BUILTIN = {  # benchmark sets are used whole; the ShareGPT train/held-out split applies only to "heldout"
    "mtbench": {"source": "mtbench", "split": "all"},
    "humaneval": {"source": "humaneval", "split": "all"},
    "heldout": {"source": "sharegpt", "split": "heldout"},
}
FILE_SUFFIXES = (".json", ".jsonl", ".parquet")


class EvalError(Exception):
    """An evaluation that cannot start (missing drafter, bad dataset name, ...), with the fix in the message."""


# -- inputs ------------------------------------------------------------------------------------------------------
def dataset_source(name: str) -> tuple[str, dict]:
    """(label, load_conversations kwargs) of an eval set name."""
    if name in BUILTIN:
        return name, dict(BUILTIN[name])
    if name.startswith("hf:"):
        return name[3:].replace("/", "_"), {"source": "hf", "path": name[3:], "split": "all"}
    if name.lower().endswith(FILE_SUFFIXES):
        return Path(name).stem, {"source": "file", "path": name, "split": "all"}
    raise EvalError(f"unknown eval dataset {name!r}: use {', '.join(BUILTIN)}, a path ending in "
                    f"{'/'.join(FILE_SUFFIXES)}, or hf:<dataset id>")


def load_prompts(name: str, label: str, cfg: DictConfig, references: ReferenceCache, room: int
                 ) -> dict[str, list[dict]]:
    """The prompts of an eval set as chat-templated ids, per turn: {label: first turns, label_turn2: second turns
    (conditioned on the target's own first replies), ...} up to eval.turns. room: the most prompt tokens that still
    leave space for the reply in the target's context."""
    _, kwargs = dataset_source(name)
    tokenizer = references.target.tokenizer
    limit = cfg.eval.max_prompt_tokens or room
    convs = load_conversations(**kwargs, heldout_fraction=cfg.data.heldout_fraction, limit=cfg.eval.num_prompts,
                               tokenizer=tokenizer, max_prompt_tokens=limit, log=log.info)
    per_turn = turn_prompts(tokenizer, convs, cfg.eval.turns, references, cfg.eval.max_new_tokens, room)
    if len(per_turn[0]) < len(convs):  # the template adds tokens the filter did not count
        log.warning("%s: %d prompts over %d tokens with their template: skipped", name,
                    len(convs) - len(per_turn[0]), room)
    return {label if k == 0 else f"{label}_turn{k + 1}": prompts for k, prompts in enumerate(per_turn)}


def load_drafter(cfg: DictConfig, train_dir: Path, target: Target) -> tuple[DFlashDrafter, Path]:
    folder = Path(cfg.eval.drafter_dir) if cfg.eval.drafter_dir else train_dir / "export"
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise EvalError(f"no exported drafter at {folder} (config.json + model.safetensors); run dflash-train "
                        "first or set eval.drafter_dir to an exported folder")
    model = target.model
    drafter = DFlashDrafter.from_pretrained(str(folder), model.get_input_embeddings(), model.get_output_embeddings())
    drafter.set_attn_implementation(str(cfg.drafter.attn_implementation))
    c = drafter.config
    if c.num_target_layers != target.num_layers or c.target_hidden_size != target.hidden_size:
        raise EvalError(f"drafter {folder} was trained for a target with {c.num_target_layers} layers and hidden size "
                        f"{c.target_hidden_size}; the configured target ({target.ref}) has {target.num_layers} and "
                        f"{target.hidden_size}")
    dtype = next(model.parameters()).dtype
    return drafter.to(device=next(model.parameters()).device, dtype=dtype).eval(), folder


# -- offline metrics ---------------------------------------------------------------------------------------------
def reply_items(target: Target, layer_ids: list[int], seqs: list[tuple[list[int], list[int]]],
                final: bool = False) -> list[dict]:
    """(prompt ids, reply ids) pairs as teacher-style items: features captured now, loss mask on the reply."""
    items = [{"input_ids": torch.tensor(prompt + reply),
              "loss_mask": torch.tensor([0] * len(prompt) + [1] * len(reply), dtype=torch.bool)}
             for prompt, reply in seqs]
    return recapture(target.model, items, layer_ids, pad_id=target.tokenizer.pad_token_id, final=final)


def teacher_heldout_items(cfg: DictConfig, data_dir: Path, drafter_dir: Path, target: Target,
                          layer_ids: list[int]) -> tuple[list[dict] | None, str]:
    """The training run's held-out teacher sequences, or (None, why not)."""
    if not (data_dir / "manifest.json").is_file():
        return None, f"no teacher dataset at {data_dir}"
    data = TeacherDataset(data_dir, verify=False)
    trained_on = json.loads((drafter_dir / "config.json").read_text()).get("dflash_pipeline", {})
    if trained_on.get("teacher_config_hash") not in (None, data.manifest["config_hash"]):
        return None, (f"the drafter was trained on teacher data {trained_on['teacher_config_hash']}, not on "
                      f"{data_dir} ({data.manifest['config_hash']}): its held-out split is unknown")
    if data.manifest["target"]["ref"] != target.ref:
        return None, f"teacher data of target {data.manifest['target']['ref']}, not {target.ref}"
    _, held = split_heldout(data.ids, cfg.trainer.heldout_samples)
    items = [data[i] for i in held]
    if data.layer_ids != layer_ids or not data.has_features:  # other taps stored, or none: capture the drafter's now
        recapture(target.model, items, layer_ids, pad_id=target.tokenizer.pad_token_id)
    return items, f"{len(items)} held-out sequences of {data_dir}"


# -- online metrics ----------------------------------------------------------------------------------------------
def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


@dataclass
class Passes:
    """The timed decodes of one prompt in one repeat, in the order they ran: AR, [other dtypes], spec, spec,
    [other dtypes], AR."""

    prompt: dict
    repeat: int
    ar: list[tuple[list[int], dict]]  # the two autoregressive runs: (tokens, timings)
    spec: list[SpecResult]  # the two speculative runs
    other: dict[str, list[tuple[float, float]]]  # per other dtype: (s per token, s per step) of its two runs
    verified_upto: int | None = None  # greedy: where the first speculative run diverged at a near-tie


def timed_passes(target: Target, method, prompts: list[dict], *, label: str, block_size: int, max_new_tokens: int,
                 temperature: float, seed: int, repeats: int, baselines: dict[str, torch.nn.Module],
                 acceptance: str = "sampled"):
    """Yields the Passes of every prompt and repeat (A F B B F A), after one warm-up of each kind on prompt 0."""
    device = next(target.model.parameters()).device
    others = {d: SimpleNamespace(model=m, eos_ids=target.eos_ids) for d, m in baselines.items()}
    bar = Progress(f"eval {label} {method.name}", len(prompts), "prompt")
    part = 1 / (4 * repeats)  # a prompt is done after repeats x (AR, spec, spec, AR)

    def gen(*parts):
        if temperature <= 0:
            return None
        return torch.Generator(device=device).manual_seed(step_seed(seed, label, *parts) % (2 ** 63))

    def ar(i, run):
        out = autoregressive(target, prompts[i]["prompt_ids"], max_new_tokens, temperature, gen(i, "ar", run))
        bar.update(0 if run == "warmup" else part)
        return out

    def spec(i, run):
        out = speculative(target, method, prompts[i]["prompt_ids"], max_new_tokens, block_size, temperature,
                          gen(i, "spec", run), acceptance=acceptance)
        bar.update(0 if run == "warmup" else part)
        return out

    def ar_in(dtype: str, i: int) -> tuple[float, float]:
        """(s per token, s per decode step) of plain decoding of prompt i by the target in another dtype."""
        tokens, t = autoregressive(others[dtype], prompts[i]["prompt_ids"], max_new_tokens, temperature,
                                   gen(i, "ar", dtype))
        return t["total_s"] / len(tokens), t["decode_s"] / max(1, len(tokens) - 1)

    ar(0, "warmup"), spec(0, "warmup")
    for d in others:
        ar_in(d, 0)
    for i, p in enumerate(prompts):
        for r in range(repeats):
            a1 = ar(i, 2 * r)
            other = {d: [ar_in(d, i)] for d in others}
            s1, s2 = spec(i, 2 * r), spec(i, 2 * r + 1)
            for d in others:
                other[d].append(ar_in(d, i))
            a2 = ar(i, 2 * r + 1)
            yield Passes(p, r, [a1, a2], [s1, s2], other)
    bar.close()


def check_passes(judge: ExactnessJudge, passes: Passes, strict: bool, near_ties: list, mismatches: list) -> None:
    """Greedy: the second AR run and both speculative runs against the first AR run (eval/exactness.py), each
    divergence recorded in near_ties or mismatches (raised when strict); a near-tie of the first speculative run in
    the first repeat bounds the rounds its acceptance counts."""
    p, reference = passes.prompt, passes.ar[0][0]
    for what, other in (("the second autoregressive run", passes.ar[1][0]),
                        ("speculative decoding", passes.spec[0].tokens),
                        ("a repeated speculative run", passes.spec[1].tokens)):
        v = judge.check(p["id"], p["prompt_ids"], reference, other, what, strict)
        if v.kind in (NEAR_TIE, WRONG):
            (near_ties if v.kind == NEAR_TIE else mismatches).append(
                {"prompt": p["id"], "position": v.position, "run": what, "repeat": passes.repeat, **v.detail})
        if passes.repeat == 0 and other is passes.spec[0].tokens and v.kind == NEAR_TIE:
            passes.verified_upto = v.position


def run_online(target: Target, method, prompts: list[dict], *, label: str, block_size: int, max_new_tokens: int,
               temperature: float = 0.0, seed: int = 0, repeats: int = 1, strict: bool = True,
               costs: EvalContext | None = None, judge: ExactnessJudge | None = None,
               baselines: dict[str, torch.nn.Module] | None = None, acceptance: str = "sampled") -> dict:
    """Speculative vs autoregressive decoding of `prompts` (A B B A per prompt per repeat, after one warm-up).

    Returns the online metrics of the eval set and, under "ar_outputs", the first autoregressive reply per prompt.
    With `costs` (the measured verify-cost curve), also the speedup that curve predicts for the rounds run.
    Greedy outputs are classified by `judge` (eval/exactness.py; default: one for the target's dtype with the
    default tolerance); acceptance counts every round, and beside it (`*_verified_prefix`) the rounds before a
    near-tie divergence. baselines: the target in
    other dtypes ({dtype: model}, eval.baseline_dtypes), whose plain decoding is timed in the same passes
    (A F B B F A); speedups against the fastest autoregressive decoding of any dtype are reported beside.
    """
    judge = judge or ExactnessJudge(target.model, DEFAULT_TOLERANCE)
    runs, near_ties, mismatches = [], [], []
    for passes in timed_passes(target, method, prompts, label=label, block_size=block_size,
                               max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, repeats=repeats,
                               baselines=baselines or {}, acceptance=acceptance):
        if temperature <= 0:
            check_passes(judge, passes, strict, near_ties, mismatches)
        runs.append(passes)
    res = online_metrics(runs, block_size, target.dtype, costs)
    res.update({"exact": (not mismatches) if temperature <= 0 else None,  # None: not defined when sampling
                "mismatches": mismatches,  # wrong outputs (recorded with eval.strict_exact=false; raised otherwise)
                # reduced precision: outputs that diverged at a near-tie (eval/exactness.py), and counts per kind
                "near_ties": near_ties,
                "outputs_compared": 3 * len(runs) if temperature <= 0 else 0,
                "near_tie_outputs": len(near_ties),
                "identical": (not mismatches and not near_ties) if temperature <= 0 else None})
    log.info("%s %s: tau_online %.3f a_k %s speedup %.2fx (AR %.1f tok/s, spec %.1f tok/s), exact %s", method.name,
             label, res["tau_online"], [round(x, 3) for x in res["a_k_online"]], res["speedup"],
             res["tokens_per_s_ar"], res["tokens_per_s_spec"], res["exact"])
    res["ar_outputs"] = [r.ar[0][0] for r in runs if r.repeat == 0]
    res["spec_rounds"] = [r.spec[0].accepted for r in runs if r.repeat == 0]  # every round, near-ties or not
    res["spec_outputs"] = [r.spec[0].tokens for r in runs if r.repeat == 0]
    return res


def online_metrics(runs: list[Passes], block_size: int, target_dtype: str, costs: EvalContext | None) -> dict:
    """The online metrics of an eval set from its passes: acceptance over the first speculative run of the first
    repeat of each prompt (every round; and up to a near-tie divergence), times as medians over every timed run."""
    first = [r for r in runs if r.repeat == 0]
    ars = [t for r in runs for _, t in r.ar]
    ar_tokens = [tokens for r in runs for tokens, _ in r.ar]
    specs = [s for r in runs for s in r.spec]
    ar_s_per_tok = [t["total_s"] / len(tokens) for tokens, t in zip(ar_tokens, ars)]
    ar_decode = [t["decode_s"] / max(1, len(tokens) - 1) for tokens, t in zip(ar_tokens, ars)]
    spec_s_per_tok = [s.total_s / len(s.tokens) for s in specs]
    spec_decode = [(s.total_s - s.prefill_s) / max(1, len(s.tokens) - 1) for s in specs]
    draft_s = [x for s in specs for x in s.draft_s]
    verify_s = [x for s in specs for x in s.verify_s]
    select_s = [x for s in specs for x in s.select_s]
    scorings = [x for s in specs for x in s.scorings]
    # Every round a speculative run made is exact against its own verification, also after a near-tie divergence
    # from the autoregressive reference (reduced precision): the headline counts them all. Beside it, the rounds
    # before that divergence, whose tokens are the reference's (`*_verified_prefix`; equal when nothing diverged).
    every_round = [r.spec[0].accepted for r in first]
    per_prompt = [rounds_before(r.spec[0].accepted, r.verified_upto) for r in first]
    accepted = [n for kept in per_prompt for n in kept]
    timed_accepted = [n for kept in every_round for n in kept]  # every round of the first runs (timed)
    verified = [n for r in first for n in r.spec[0].verified]
    drafted = [d for r in first for d in r.spec[0].drafted]
    out_tokens = sum(len(r.spec[0].tokens) for r in first)
    forwards = sum(r.spec[0].target_forwards for r in first)

    stats = accepted_length_stats(timed_accepted, block_size)
    prefix = accepted_length_stats(accepted, block_size)
    ms_ar, ms_spec = 1e3 * _median(ar_s_per_tok), 1e3 * _median(spec_s_per_tok)
    total_draft, total_verify = sum(draft_s), sum(verify_s)
    res = {
        "prompts": len(first),
        "output_tokens": out_tokens,
        "rounds": stats["rounds"],
        "a_k_online": stats["a_k"],
        "accepted_hist": stats["accepted_hist"],  # rounds that accepted 0 .. B-1 drafts
        "tau_online": stats["tau"],
        "tau_online_ci95": bootstrap_tau(every_round),  # bootstrap over prompts
        "rounds_verified_prefix": prefix["rounds"],
        "a_k_online_verified_prefix": prefix["a_k"],
        "tau_online_verified_prefix": prefix["tau"],
        "tau_online_verified_prefix_ci95": bootstrap_tau(per_prompt),
        "target_forwards_per_token": forwards / out_tokens if out_tokens else 0.0,
        "draft_ms_per_round": 1e3 * _median(draft_s),
        "verify_ms_per_round": 1e3 * _median(verify_s),
        "prefill_ms": 1e3 * _median([s.prefill_s for s in specs]),
        "draft_fraction": total_draft / (total_draft + total_verify) if draft_s else 0.0,
        "select_ms_per_round": 1e3 * _median(select_s),  # choosing among the candidates, part of draft ms
        "select_fraction": sum(select_s) / (total_draft + total_verify) if draft_s else 0.0,
        "scorings_per_round": sum(scorings) / len(scorings) if scorings else 0.0,
        "verified_per_round": sum(verified) / len(verified) if verified else 0.0,  # drafts verified
        "drafted_fraction": sum(drafted) / len(drafted) if drafted else 0.0,  # rounds that ran the drafter
        "ms_per_token_ar": ms_ar,
        "ms_per_token_spec": ms_spec,
        "tokens_per_s_ar": 1e3 / ms_ar if ms_ar else 0.0,
        "tokens_per_s_spec": 1e3 / ms_spec if ms_spec else 0.0,
        "speedup": ms_ar / ms_spec if ms_spec else 0.0,
        "speedup_decode": _median(ar_decode) / _median(spec_decode) if spec_decode and _median(spec_decode) else 0.0,
        "target_dtype": target_dtype,
        "timed_runs": len(ar_s_per_tok) + len(spec_s_per_tok),
    }
    # the baseline a user compares with: the fastest plain decoding on the machine, in any dtype timed
    per_dtype = {target_dtype: (ms_ar, _median(ar_decode))}
    for d in (runs[0].other if runs else {}):
        timed = [x for r in runs for x in r.other[d]]
        per_dtype[d] = (1e3 * _median([t for t, _ in timed]), _median([x for _, x in timed]))
    fastest = min(per_dtype, key=lambda d: per_dtype[d][0])
    res["ms_per_token_ar_by_dtype"] = {d: ms for d, (ms, _) in per_dtype.items()}
    res["fastest_ar_dtype"] = fastest
    res["speedup_vs_fastest_ar"] = per_dtype[fastest][0] / ms_spec if ms_spec else 0.0
    spec_step = _median(spec_decode)
    res["speedup_decode_vs_fastest_ar"] = per_dtype[fastest][1] / spec_step if spec_step else 0.0
    ar_step_ms = 1e3 * _median(ar_decode)
    res["ar_step_ms"] = ar_step_ms  # a decoding step of the autoregressive runs
    if draft_s and ar_step_ms:  # what a round cost inside these decodes, in those steps
        res["round_cost_in_decode"] = 1e3 * (total_draft + total_verify) / len(draft_s) / ar_step_ms
    if costs is not None and timed_accepted:  # tokens over the rounds' cost in AR steps, from the curve
        spent = sum(costs.round_cost(v, d) for v, d in zip(verified, drafted))
        res["round_cost_predicted"] = spent / len(timed_accepted)
        res["predicted_speedup"] = (sum(timed_accepted) + len(timed_accepted)) / spent
        res["measured_over_predicted"] = res["speedup_decode"] / res["predicted_speedup"]
    return res


# -- the stage ---------------------------------------------------------------------------------------------------
def run_eval(cfg: DictConfig, out: Path, teacher_dir: Path | None = None, train_dir: Path | None = None,
             component_dirs: dict[str, Path] | None = None) -> Path:
    """Evaluate the exported drafter of `train_dir` (default: this run's train stage; eval.drafter_dir overrides);
    offline metrics on the held-out part of `teacher_dir` (default: this run's teacher stage). Writes
    eval_results.json, results.md and acceptance.png in `out`. component_dirs: the stage folder of each component
    whose methods are evaluated (default: <train_dir>/<component>). Skipped when eval_results.json exists for the same
    config; a different config's results are replaced (eval is read-only on its inputs: rerun with another
    eval.out_dir to keep both)."""
    check_config(cfg)
    e = cfg.eval
    digest = config_hash(cfg, "eval")
    results_file = out / RESULTS
    old = recorded_hash("eval", out)
    if old == digest:
        log.info("evaluation already complete at %s (config %s): skipping", out, digest)
        log.info("results:\n%s", report.summary(json.loads(results_file.read_text()), out))
        return out
    if old is not None:
        log.warning("%s holds results of config %s; replacing them with config %s", results_file, old, digest)
    labels = [dataset_source(name)[0] for name in e.datasets]  # fails early on a bad name
    if len(set(labels)) != len(labels):
        raise EvalError(f"eval.datasets {list(e.datasets)} give duplicate names {labels}")

    threads = torch.get_num_threads()
    if e.num_threads:
        torch.set_num_threads(e.num_threads)
    try:
        teacher_dir = Path(cfg.trainer.data_dir or teacher_dir or out.parent / cfg.teacher.out_dir)
        train_dir = Path(train_dir or out.parent / cfg.trainer.out_dir)
        results = _evaluate(cfg, teacher_dir, train_dir, digest, labels, component_dirs or {})
    finally:
        torch.set_num_threads(threads)

    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    logger = RunLogger(cfg, out, "eval")
    logger.log(report.loggable(results), step=0)
    report.log_wandb(logger, results)
    logger.finish()
    write_text(out / "results.md", report.markdown(results))
    report.plot_acceptance(results, out / "acceptance.png")
    write_json(results_file, results, indent=2)  # last: its presence marks the stage complete
    log.info("evaluation written to %s; results:\n%s", out, report.summary(results, out))
    return out


def make_method(name: str, drafter, exports: dict[str, Path] | None = None, policy=None, budget: int | None = None,
                config=None):
    """An eval method of the catalogue on `drafter`, with the export folders of the components it uses, the
    eval.policy settings and its component's config section (defaults of each when not given); a tree method with
    its node budget."""
    if name not in catalogue.methods():
        raise KeyError(f"unknown eval method {name!r}; available: {', '.join(sorted(catalogue.methods()))}")
    owner, entry = catalogue.methods()[name]
    own = catalogue.module(owner).CONFIG
    policy = OmegaConf.structured(PolicyConfig) if policy is None else policy
    if config is None and own is not None:
        config = OmegaConf.structured(own)
    if entry.tree and budget is None:
        raise ValueError(f"{name} is a tree method: give it a node budget")
    return entry.make(catalogue.MethodInputs(drafter, dict(exports or {}), policy, config, budget))


def load_methods(cfg: DictConfig, drafter: DFlashDrafter, train_dir: Path, component_dirs: dict[str, Path],
                 drafter_dir: Path | None = None) -> dict:
    """{name: method} for eval.methods, each on the drafter with its component's trained export (refused when that
    export was trained on another drafter than the one of `drafter_dir`)."""
    methods, checked = {}, set()
    for name, (base, budget) in catalogue.evaluated_names(cfg.eval.methods, cfg.eval.tree_budgets).items():
        exports = {}
        for component in catalogue.method_components(base)[1:]:
            exports[component] = Path(component_dirs.get(component, train_dir / component)) / "export"
            if not (exports[component] / "config.json").is_file():
                raise EvalError(f"eval method {name} needs the trained {component} at {exports[component]}: run "
                                f"dflash-train trainer.component={component} (or add it to pipeline.components)")
            if drafter_dir is not None and component not in checked:
                differs = drafter_difference(exports[component], drafter_dir)
                if differs:
                    raise EvalError(f"eval method {name}: the {component} at {exports[component]} was trained on "
                                    f"another drafter than {drafter_dir} ({differs}); retrain it on this drafter or "
                                    f"set eval.drafter_dir to the drafter it was trained on")
                checked.add(component)
        try:
            owner = catalogue.methods()[base][0]
            methods[name] = make_method(base, drafter, exports, cfg.eval.policy, budget,
                                                  cfg.get(owner) if catalogue.module(owner).CONFIG else None)
        except ValueError as err:  # exports that do not fit together
            raise EvalError(f"eval method {name}: {err}") from err
    return methods


def eval_context(cfg: DictConfig, target: Target, drafter: DFlashDrafter, block_size: int, heldout: list[dict],
                 prompt_sets: dict[str, list[dict]]) -> EvalContext:
    """What the decoding policies calibrate on (eval/policies.py): the verify-cost curve measured now, and held-out
    teacher sequences that are none of the eval prompts."""
    used = {p["id"] for prompts in prompt_sets.values() for p in prompts}
    calibration = [it for it in heldout if it.get("id") not in used][: cfg.eval.policy.calibration_sequences]
    first = next(iter(prompt_sets.values()))[0]["prompt_ids"]
    context = calibration[0]["input_ids"][:COST_CONTEXT].tolist() if calibration else first[-COST_CONTEXT:]
    trees = tuple(cfg.eval.tree_budgets) if any(catalogue.methods()[m][1].tree for m in cfg.eval.methods) else ()
    return cost_curve(target, drafter, context, block_size, trees, calibration, "calibration", cfg.eval.cost_repeats)


def cost_curve(target: Target, drafter: DFlashDrafter, context: list[int], block_size: int, trees: tuple[int, ...],
               calibration: list[dict], label: str, repeats: int) -> EvalContext:
    """measure_costs after a prefill of `context`, logged and wrapped as an EvalContext."""
    costs = measure_costs(target, drafter, context, block_size, repeats=repeats, tree_sizes=trees)
    log.info("%s: verify cost c(n) / c(1), n = 1..%d, at %d tokens of context: %s; draft %.2f; autoregressive "
             "step %.2f; 1-token step %.1f ms; trees of N nodes: %s", label, block_size, len(context),
             [round(c, 2) for c in costs["verify_cost"]], costs["draft_cost"], costs["ar_step_cost"],
             costs["step_ms"], {n: round(c, 2) for n, c in costs["tree_cost"].items()})
    return EvalContext.measured(costs, block_size, calibration)


def decode_context(prompts: list[dict], max_new_tokens: int, room: int) -> list[int]:
    """Tokens as many as the median context of these prompts' decodes (prompt plus half the reply), so a set's
    cost curve is measured where its decoding runs (attention grows with the context; turn-2 prompts are long)."""
    length = min(room, int(statistics.median(len(p["prompt_ids"]) + max_new_tokens // 2 for p in prompts)))
    ids = list(prompts[0]["prompt_ids"])
    return (ids * (length // len(ids) + 1))[:length]


def baseline_models(target: Target, dtypes: list[str], judge: ExactnessJudge) -> dict:
    """The target in each of `dtypes` other than its own (the float32 one shared with the exactness judge): plain
    decoding in the dtype that is fastest on this machine is the baseline a user compares with (on a CPU without
    native bf16, bf16 decodes faster one token at a time but verifies blocks slower; docs/results/precision.md)."""
    import copy

    out = {}
    for d in dict.fromkeys(dtypes):
        if d != target.dtype:
            out[d] = judge.float32_model() if d == "float32" else copy.deepcopy(target.model).to(torch_dtype(d))
    return out


def numerics(target: Target, teacher_dir: Path, tolerance: float) -> dict:
    """The target's dtype here (and why, on which machine) beside the teacher data's: a drafter trained on features
    of other numerics than it is evaluated with is reported as such (and logged), not refused: a GPU-made bf16
    teacher evaluated on a CPU without native bf16 is a normal case."""
    out = {**target.numerics, "near_tie_tolerance": tolerance if target.dtype != "float32" else None}
    manifest = teacher_dir / "manifest.json"
    if manifest.is_file():
        theirs = json.loads(manifest.read_text())["target"]
        out["teacher_dtype"] = theirs.get("dtype", "float32")  # datasets from before the field: float32 only
        out["teacher_machine"] = theirs.get("numerics", {}).get("machine")
        out["same_as_teacher"] = out["teacher_dtype"] == target.dtype
        if not out["same_as_teacher"]:
            log.warning("the teacher data was made with a %s target, this evaluation runs it in %s: offline metrics "
                        "on stored features and online decoding use different numerics", out["teacher_dtype"],
                        target.dtype)
    return out


def drafter_difference(export: Path, drafter_dir: Path) -> str | None:
    """How a component's export differs from the drafter it should carry unchanged (None: it carries it). A DFlash2
    drafter's pass-through selector is not the drafter's: a trained selector replaces it."""
    from safetensors import safe_open

    from dflash_pipeline.models.selector import SELECTOR_PREFIX

    with safe_open(str(drafter_dir / "model.safetensors"), "pt") as base, \
            safe_open(str(export / "model.safetensors"), "pt") as comp:
        own = set(comp.keys())
        for key in base.keys():
            if key.startswith(SELECTOR_PREFIX):
                continue
            if key not in own:
                return f"no tensor {key}"
            if not torch.equal(base.get_tensor(key), comp.get_tensor(key)):
                return f"tensor {key} differs"
    return None


def _evaluate(cfg: DictConfig, teacher_dir: Path, train_dir: Path, digest: str, labels: list[str],
              component_dirs: dict[str, Path]) -> dict:
    e = cfg.eval
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(cfg.target, cfg.cache_dir)
    target.model.to(device)
    drafter, drafter_dir = load_drafter(cfg, train_dir, target)
    trained_B = drafter.config.block_size
    B = e.block_size or trained_B
    if not 2 <= B <= trained_B:
        raise EvalError(f"eval.block_size={B} must be in 2 .. {trained_B} (the trained block size)")
    layer_ids = list(drafter.config.target_layer_ids)
    judge = ExactnessJudge(target.model, e.near_tie_tolerance)
    dtypes = e.baseline_dtypes if e.baseline_dtypes is not None else \
        ([] if device.type == "cuda" else ["float32", "bfloat16"])
    baselines = baseline_models(target, [str(d) for d in dtypes], judge)
    methods = load_methods(cfg, drafter, train_dir, component_dirs, drafter_dir)
    if e.served.engine:  # refused before any decoding: what the served eval needs
        if "chain" not in methods:
            raise EvalError("eval.served compares the served drafter with the own loop's chain method: add chain to "
                            "eval.methods")
        vllm_python(cfg.cache_dir)
    not_run = {}  # methods this target family cannot serve (trees on a recurrent target): named in the results
    for name, method in list(methods.items()):
        try:
            method.check(B, e.temperature)
        except ValueError as err:
            raise EvalError(f"eval method {name}: {err}") from err
        try:
            check_target(method, target.model)
        except ValueError as err:
            log.warning("eval method %s not run: %s", name, err)
            not_run[name] = str(err)
            del methods[name]
    room = target.config.max_position_embeddings - e.max_new_tokens - B
    ks = sorted(set(e.recall_k))
    references = ReferenceCache(Path(cfg.cache_dir) / "references", target)
    prompt_sets = {}
    for name, label in zip(e.datasets, labels):
        prompt_sets.update(load_prompts(name, label, cfg, references, room))
        if not prompt_sets[label]:
            raise EvalError(f"eval dataset {name!r} gave no prompt that fits the target's context")
    # The target's greedy replies to every prompt (cached across runs): what the teacher-forced metrics run on.
    replies = {label: references.replies([p["prompt_ids"] for p in prompts], e.max_new_tokens)
               for label, prompts in prompt_sets.items()}
    log.info("AR references: %d reused, %d generated (%s)", references.reused, references.generated,
             references.folder)

    results = {
        "config_hash": digest,
        "not_run": not_run,
        "target": target.ref,
        "drafter_dir": str(drafter_dir),
        "block_size": B,
        "trained_block_size": trained_B,
        "temperature": e.temperature,
        **({"acceptance_rule": str(e.acceptance_rule)} if e.temperature > 0 else {}),
        "max_new_tokens": e.max_new_tokens,
        "datasets": list(prompt_sets),
        "prompts": {label: {"offline": len(prompts), "online": len(prompts[: e.online_prompts])}
                    for label, prompts in prompt_sets.items()},
        "references": {"folder": str(references.folder), "reused": references.reused,
                       "generated": references.generated},
        "timing": {"protocol": "one warm-up per eval set, then per prompt AR, spec, spec, AR x timing_repeats "
                               "(plain decoding in each other dtype of eval.baseline_dtypes after the first AR and "
                               "after the second spec); medians of per-run time per output token",
                   "device": str(device), "num_threads": torch.get_num_threads(), "repeats": e.timing_repeats},
        "numerics": numerics(target, teacher_dir, e.near_tie_tolerance),
        "offline": {},
        "methods": {m: {} for m in methods},
    }
    trees = {m: method for m, method in methods.items() if isinstance(method, TreeMethod)}
    blocks = {m: method for m, method in methods.items() if m not in trees}

    def offline(items: list[dict], label: str, subset: int | None = None) -> dict:
        """Every method's teacher-forced metrics on `items` (trees: built per block, walked along the labels)."""
        with Progress(f"eval {label} offline", len(items), "sequence") as bar:
            res = offline_metrics(drafter, items, B, ks, progress=bar, methods=blocks, subset=subset)
        if trees:
            if "final_hidden" not in items[0]:
                recapture(target.model, items, layer_ids, pad_id=target.tokenizer.pad_token_id, final=True)
            with Progress(f"eval {label} offline trees", len(items), "sequence") as bar:
                res["methods"].update(tree_offline_metrics(drafter, items, B, trees, progress=bar))
        return res

    items, note = teacher_heldout_items(cfg, teacher_dir, drafter_dir, target, layer_ids)
    results["offline"]["teacher_heldout"] = None
    if items:
        results["offline"]["teacher_heldout"] = offline(items, "teacher_heldout")
        log.info("offline on %s: a_k %s tau_offline %.3f", note,
                 [round(x, 3) for x in results["offline"]["teacher_heldout"]["a_k"]],
                 results["offline"]["teacher_heldout"]["tau_offline"])
    else:
        log.warning("no offline metrics on held-out teacher data: %s", note)
    results["offline_note"] = note
    ctx = eval_context(cfg, target, drafter, B, items or [], prompt_sets)
    results["costs"] = {**ctx.report(), "calibration_sequences": len(ctx.calibration), "per_set": {}}
    results["policies"] = {}
    for m, method in methods.items():
        chosen = method.prepare(ctx)
        if chosen:
            results["policies"][m] = chosen
            log.info("%s: %s", m, chosen)

    def evaluate_set(label: str, prompts: list[dict]) -> dict:
        """The offline metrics and every method's online decode of one eval set; {method: (AR outputs, rounds)}."""
        own_runs = {}
        seqs = [(p["prompt_ids"], r) for p, r in zip(prompts, replies[label])]
        on_replies = offline(reply_items(target, layer_ids, seqs, final=bool(trees)), label, e.online_prompts)
        results["offline"][label] = on_replies
        timed = prompts[: e.online_prompts]  # never empty: an empty set is refused above; online_prompts >= 1
        here = cost_curve(target, drafter, decode_context(timed, e.max_new_tokens, room), B,
                          tuple(ctx.tree_cost), [], label, e.cost_repeats)  # just before this set's timing
        results["costs"]["per_set"][label] = here.report()
        for m, method in methods.items():
            online = run_online(target, method, timed, label=label, block_size=B,
                                max_new_tokens=e.max_new_tokens, temperature=e.temperature, seed=e.seed,
                                repeats=e.timing_repeats, strict=e.strict_exact, costs=here, judge=judge,
                                baselines=baselines, acceptance=str(e.acceptance_rule))
            own_runs[m] = (online.pop("ar_outputs"), online.pop("spec_rounds"), online.pop("spec_outputs"))
            own = on_replies["methods"][m]  # the path this method proposes, teacher-forced on the replies
            results["methods"][m][label] = {
                **online,
                "a_k_offline": own["a_k"],
                "recall": on_replies["recall"],
                "tau_offline": own["tau_offline"],
                "tau_offline_ci95": own.get("tau_offline_ci95"),
                "offline_prompts": len(prompts),
                # offline minus online on the same (online) prompts and, past a near-tie, the same tokens; trees:
                # over all prompts
                "tau_gap": own.get("tau_offline_subset", own["tau_offline"]) - online["tau_online_verified_prefix"],
                "oracle_tau": on_replies["oracle_tau"].get(str(method.top_k if method.top_k > 1 else max(ks))),
                "prompt_ids": [p["id"] for p in prompts[: e.online_prompts]],
            }
        return own_runs

    own_runs = {label: evaluate_set(label, prompts) for label, prompts in prompt_sets.items()}
    if e.served.engine:  # after the own loop's timing, so that no engine process shares the cores with it
        results["served"] = serve(cfg, target, drafter, drafter_dir, B, judge, prompt_sets, own_runs, results)
    return results


def serve(cfg: DictConfig, target: Target, drafter: DFlashDrafter, drafter_dir: Path, B: int, judge: ExactnessJudge,
          prompt_sets: dict[str, list[dict]], own_runs: dict, results: dict) -> dict:
    """The exported drafter served by vLLM on each set's online prompts, beside the own loop's chain runs of the
    same prompts (eval/served.py): per-position acceptance served / own loop / teacher-forced, exactness, speed,
    and the parity gate's verdict per set."""
    e = cfg.eval
    folder = target_folder(cfg.target, cfg.cache_dir)
    threads = e.num_threads or torch.get_num_threads()
    out = {"engine": str(e.served.engine), "target_dir": str(folder), "threads": threads,
           "dtype": target.dtype, "tolerance": e.served.tolerance, "sets": {}}
    log_file = Path(cfg.cache_dir) / "vllm" / "engine.log"
    log_file.parent.mkdir(parents=True, exist_ok=True)
    log_file.unlink(missing_ok=True)  # this run's engines only
    log.info("serving %s on %s in vLLM (%s, %d threads; engine log %s)", drafter_dir, folder, target.dtype, threads,
             log_file)
    if e.temperature > 0:  # statistical: several seeds per prompt, both acceptance rules in the own loop
        engine = served_eval.ServedEval(cfg.cache_dir, folder, drafter_dir, target.dtype, B,
                                        target.config.max_position_embeddings, threads, log_file, plain=False,
                                        draft_sample_method=e.served.draft_sample_method, repair=e.served.repair)
        seeds = [e.seed + i for i in range(e.served.seeds)]
        try:
            for label, prompts in prompt_sets.items():
                out["sets"][label] = served_eval.sampled_set(
                    engine, target, drafter, [p["prompt_ids"] for p in prompts[: e.online_prompts]], B,
                    e.max_new_tokens, e.temperature, seeds, e.served.batch, e.served.alpha,
                    e.served.draft_sample_method, label)
        finally:
            engine.close()
        return _served_verdict(out, e.served.strict)
    served_contract, own_contract = served_eval.export_contract(drafter_dir), served_eval.drafter_contract(drafter)
    engine = served_eval.ServedEval(cfg.cache_dir, folder, drafter_dir, target.dtype, B,
                                    target.config.max_position_embeddings, threads, log_file,
                                    repair=e.served.repair)
    try:
        for label, prompts in prompt_sets.items():
            timed = prompts[: e.online_prompts]
            ar, rounds, spec = own_runs[label]["chain"]
            out["sets"][label] = served_eval.compare(
                engine.run([p["prompt_ids"] for p in timed], e.max_new_tokens, target.eos_ids, e.timing_repeats,
                           e.served.batch, label), timed, rounds, spec, ar, B - 1, target.dtype, judge,
                e.served.tolerance,
                served_contract, own_contract, results["offline"][label]["methods"]["chain"]["a_k"],
                results["methods"]["chain"][label]["a_k_online"])
            own = results["methods"]["chain"][label]
            fastest = min(own.get("ms_per_token_ar_by_dtype", {}).values(), default=own["ms_per_token_ar"])
            out["sets"][label]["speedup_vs_own_fastest_ar"] = out["sets"][label]["tokens_per_s_spec"] * fastest / 1e3
    finally:
        engine.close()
    return _served_verdict(out, e.served.strict)


def _served_verdict(out: dict, strict: bool) -> dict:
    out["pass"] = all(r["gate"]["pass"] for r in out["sets"].values())
    if not out["pass"] and strict:
        raise EvalError("; ".join(r["gate"]["line"] for r in out["sets"].values() if not r["gate"]["pass"])
                        + " (eval.served.strict=true)")
    return out


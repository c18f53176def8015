"""Evaluation stage (dflash-eval): the drafter's acceptance offline and with real verification, and its speed.

Build, run, close: `build` loads the target, the exported drafter and every method of eval.methods (eval/methods.py);
`_evaluate` runs the named steps, each in the module whose name says it: the inputs (eval/inputs.py: prompts, the
target's replies, the held-out teacher sequences), the teacher-forced metrics (eval/metrics.py, eval/tree.py), the
cost curve and the policies' calibration (eval/costs.py), the online passes of every method on every set
(eval/online.py), and the served run (eval/served.py), and assembles what they return into the typed record
(eval/results.py); `run_eval` is the stage's bookkeeping (config hash, skip, threads), and eval/report.py alone
writes the record out.

Outputs (atomic): eval_results.json, results.md, acceptance.png, metrics.jsonl (+ wandb with logger=wandb).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from dflash_pipeline.conf.schema import check_config
from dflash_pipeline.runtime import stages
from dflash_pipeline.runtime.stages import (MARKERS, component_export, config_hash, differences, recorded, run_dir_of,
                                            same_config, set_aside, stage_dir)
from dflash_pipeline.eval import costs, report
from dflash_pipeline.eval import served as served_eval
from dflash_pipeline.eval.exactness import ExactnessJudge
from dflash_pipeline.eval.errors import EvalError
from dflash_pipeline.eval.gates import OwnSet
from dflash_pipeline.eval.inputs import (dataset_source, load_drafter, numerics, prompt_sets, reply_items,
                                         teacher_heldout_items)
from dflash_pipeline.eval.methods import check_names, components_used, load_methods, runnable
from dflash_pipeline.eval.metrics import offline_metrics
from dflash_pipeline.eval.online import baseline_models, run_online
from dflash_pipeline.eval.policies import EvalContext
from dflash_pipeline.eval.references import ReferenceCache
from dflash_pipeline.eval.results import EvalRecord, Header, MethodOnSet, SetResult
from dflash_pipeline.eval.tree import TreeMethod, tree_offline_metrics
from dflash_pipeline.models.drafter import DFlashDrafter
from dflash_pipeline.models.generation import recapture
from dflash_pipeline.models.target import Target, load_target
from dflash_pipeline.models.vllm_engine import vllm_python
from dflash_pipeline.runtime.progress import Progress

log = logging.getLogger(__name__)

RESULTS = MARKERS["eval"]


@dataclass
class Setup:
    """What every step of one evaluation reads: the models, the methods and the settings they run at."""

    cfg: DictConfig
    device: torch.device
    target: Target
    drafter: DFlashDrafter
    drafter_dir: Path
    block_size: int
    methods: dict  # {name as evaluated: method}, those this target can run
    not_run: dict[str, str]  # {name: why} of those it cannot (trees on a recurrent target)
    judge: ExactnessJudge
    baselines: dict  # the target in other dtypes, timed beside (eval.baseline_dtypes)

    @property
    def layer_ids(self) -> list[int]:
        return list(self.drafter.config.target_layer_ids)

    @property
    def trees(self) -> dict:
        return {m: method for m, method in self.methods.items() if isinstance(method, TreeMethod)}


def run_eval(cfg: DictConfig, out: Path, teacher_dir: Path | None = None, train_dir: Path | None = None,
             component_dirs: dict[str, Path] | None = None) -> Path:
    """Evaluate the exported drafter of `train_dir` (default: this run's train stage; eval.drafter_dir overrides);
    offline metrics on the held-out part of `teacher_dir` (default: this run's teacher stage). Writes
    eval_results.json, results.md and acceptance.png in `out`. component_dirs: the stage folder of each component
    whose methods are evaluated (default: <train_dir>/<component>). Skipped when eval_results.json exists for the same
    config; a different config's results are moved aside to <out>/superseded/<their hash>/ (never deleted)."""
    check_config(cfg)
    e = cfg.eval
    check_names(e.methods)
    digest, uses = eval_hash(cfg), components_used(cfg.eval.methods)
    results_file = out / RESULTS
    old = recorded("eval", out)
    if same_config(old, cfg, "eval", uses):
        log.info("evaluation already complete at %s (config %s): skipping", out, digest)
        log.info("results:\n%s", report.summary(json.loads(results_file.read_text()), out))
        return out
    if old is not None:
        kept = set_aside(out, old)
        log.warning("%s held results of another config (%s): moved to %s; evaluating config %s", out,
                    differences(old, cfg, "eval", uses), kept, digest)
    labels = [dataset_source(name)[0] for name in e.datasets]  # fails early on a bad name
    if len(set(labels)) != len(labels):
        raise EvalError(f"eval.datasets {list(e.datasets)} give duplicate names {labels}")

    threads = torch.get_num_threads()
    if e.num_threads:
        torch.set_num_threads(e.num_threads)
    try:
        run_dir = run_dir_of("eval", out)
        teacher_dir = stages.teacher_dir(cfg, run_dir, teacher_dir)
        train_dir = Path(train_dir or stage_dir(cfg, "train", run_dir))
        record = _evaluate(cfg, teacher_dir, train_dir, digest, labels, component_dirs or {})
    finally:
        torch.set_num_threads(threads)
    report.write_outputs(cfg, out, record, RESULTS)
    return out


def eval_hash(cfg: DictConfig) -> str:
    """The eval stage's config hash: its own section and those of every component its methods use."""
    return config_hash(cfg, "eval", components_used(cfg.eval.methods))


def _evaluate(cfg: DictConfig, teacher_dir: Path, train_dir: Path, digest: str, labels: list[str],
              component_dirs: dict[str, Path]) -> EvalRecord:
    e = cfg.eval
    s = build(cfg, train_dir, component_dirs)
    room = s.target.config.max_position_embeddings - e.max_new_tokens - s.block_size
    references = ReferenceCache(Path(cfg.cache_dir) / "references", s.target)
    prompts = prompt_sets(cfg, labels, references, room)
    # The target's greedy replies to every prompt (cached across runs): what the teacher-forced metrics run on.
    replies = {label: references.replies([p["prompt_ids"] for p in ps], e.max_new_tokens)
               for label, ps in prompts.items()}
    log.info("AR references: %d reused, %d generated (%s)", references.reused, references.generated,
             references.folder)
    header = Header.of(s, digest, prompts, references, numerics(s.target, teacher_dir, e.near_tie_tolerance))
    heldout, note = teacher_heldout_items(cfg, teacher_dir, s.drafter_dir, s.target, s.layer_ids)
    # before the policies are calibrated on these sequences: their figures here are at the policies' defaults
    held = offline(s, heldout, "teacher_heldout", note=note) if heldout else None
    if not heldout:
        log.warning("no offline metrics on held-out teacher data: %s", note)
    ctx, policies = calibrate(s, heldout or [], prompts)
    record = EvalRecord(header, held, note, {**ctx.report(), "calibration_sequences": len(ctx.calibration)}, policies)
    for label, ps in prompts.items():
        record.sets[label] = evaluate_set(s, label, ps, replies[label], ctx, room)
    if e.served.engine:  # after the own loop's timing, so that no engine process shares the cores with it
        served_dir = s.drafter_dir if str(e.served.method) == "chain" else \
            component_export("selector", train_dir, component_dirs)
        settings = served_eval.ServeSettings.of(cfg, s.target, served_dir, s.block_size)
        record.served = served_eval.serve(settings, s.target, s.drafter, s.judge, prompts, record.sets)
    return record


def build(cfg: DictConfig, train_dir: Path, component_dirs: dict[str, Path]) -> Setup:
    """The target, the exported drafter and the methods, each refused in one line when it cannot run here."""
    e = cfg.eval
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(cfg.target, cfg.cache_dir)
    target.model.to(device)
    drafter, drafter_dir = load_drafter(cfg, train_dir, target)
    trained_B = drafter.config.block_size
    B = e.block_size or trained_B
    if not 2 <= B <= trained_B:
        raise EvalError(f"eval.block_size={B} must be in 2 .. {trained_B} (the trained block size)")
    judge = ExactnessJudge(target.model, e.near_tie_tolerance)
    dtypes = e.baseline_dtypes if e.baseline_dtypes is not None else \
        ([] if device.type == "cuda" else ["float32", "bfloat16"])
    baselines = baseline_models(target, [str(d) for d in dtypes], judge)
    methods = load_methods(cfg, drafter, train_dir, component_dirs, drafter_dir)
    if e.served.engine:  # refused before any decoding: what the served eval needs
        check_served(cfg)
        if str(e.served.engine) == "llamacpp":
            check_llamacpp(cfg, drafter)
        else:
            vllm_python(cfg.cache_dir)
    methods, not_run = runnable(methods, B, e.temperature, target.model)
    return Setup(cfg, device, target, drafter, drafter_dir, B, methods, not_run, judge, baselines)


def check_served(cfg: DictConfig) -> None:
    """eval.served settings that do not fit together, refused in one line from the config alone (dflash-pipeline
    asks before any stage runs)."""
    e = cfg.eval
    if not e.served.engine:
        return
    method, llamacpp = str(e.served.method), str(e.served.engine) == "llamacpp"
    if method not in [str(m) for m in e.methods]:
        raise EvalError(f"eval.served compares the served drafter with the own loop's {method} method: add {method} "
                        "to eval.methods")
    if method != "chain" and not llamacpp:
        raise EvalError(f"eval.served.method={method} serves the DFlash2 selector, which vLLM's CPU build does not "
                        "run (its DFlash2 proposer is in the GPU runner): eval.served.engine=llamacpp")
    if method != "chain" and e.temperature > 0:
        raise EvalError(f"eval.served.method={method} is gated at eval.temperature=0; at temperature the served gate "
                        "compares the chain method (eval.served.method=chain)")
    if llamacpp and e.temperature > 0 and str(e.served.draft_sample_method) != "greedy":
        raise EvalError("llama.cpp drafts the drafter's argmax at any temperature and keeps drafts while the target's "
                        "sample matches them (the own loop's greedy_draft rule): set "
                        "eval.served.draft_sample_method=greedy, or serve in vLLM (eval.served.engine=vllm)")


def check_llamacpp(cfg: DictConfig, drafter) -> None:
    """What eval.served.engine=llamacpp needs of the drafter and this machine, refused in one line before any
    decoding: a drafter over the target's whole vocabulary (llama.cpp's converter maps no draft vocabulary for DFlash)
    and llama.cpp's build."""
    from dflash_pipeline.models.llamacpp_engine import draft_vocabulary_refused, paths

    ids = drafter.draft_to_target
    if ids is not None and len(ids) != drafter.config.vocab_size:
        raise EvalError(draft_vocabulary_refused("the drafter", len(ids)))
    paths(cfg.cache_dir)


def offline(s: Setup, items: list[dict], label: str, subset: int | None = None, note: str | None = None) -> dict:
    """Every method's teacher-forced metrics on `items` (trees: built per block, walked along the labels)."""
    trees = s.trees
    blocks = {m: method for m, method in s.methods.items() if m not in trees}
    ks = sorted(set(s.cfg.eval.recall_k))
    with Progress(f"eval {label} offline", len(items), "sequence") as bar:
        res = offline_metrics(s.drafter, items, s.block_size, ks, progress=bar, methods=blocks, subset=subset)
    if trees:
        if "final_hidden" not in items[0]:
            recapture(s.target.model, items, s.layer_ids, pad_id=s.target.tokenizer.pad_token_id, final=True)
        with Progress(f"eval {label} offline trees", len(items), "sequence") as bar:
            res["methods"].update(tree_offline_metrics(s.drafter, items, s.block_size, trees, progress=bar))
    if note:
        log.info("offline on %s: a_k %s tau_offline %.3f", note, [round(x, 3) for x in res["a_k"]],
                 res["tau_offline"])
    return res


def calibrate(s: Setup, heldout: list[dict], prompts: dict[str, list[dict]]) -> tuple[EvalContext, dict]:
    """The cost curve and the policies' choices ({method: chosen}), calibrated on held-out teacher sequences."""
    ctx = costs.eval_context(s.cfg, s.target, s.drafter, s.block_size, heldout, prompts)
    policies = {}
    for m, method in s.methods.items():
        chosen = method.prepare(ctx)
        if chosen:
            policies[m] = chosen
            log.info("%s: %s", m, chosen)
    return ctx, policies


def evaluate_set(s: Setup, label: str, prompts: list[dict], replies: list[list[int]], ctx: EvalContext,
                 room: int) -> SetResult:
    """The offline metrics and every method's online decode of one eval set."""
    e, B = s.cfg.eval, s.block_size
    seqs = [(p["prompt_ids"], r) for p, r in zip(prompts, replies)]
    on_replies = offline(s, reply_items(s.target, s.layer_ids, seqs, final=bool(s.trees)), label, e.online_prompts)
    timed = prompts[: e.online_prompts]  # never empty: an empty set is refused above; online_prompts >= 1
    here = costs.cost_curve(s.target, s.drafter, costs.decode_context(timed, e.max_new_tokens, room), B,
                            tuple(ctx.tree_cost), [], label, e.cost_repeats)  # just before this set's timing
    ks = sorted(set(e.recall_k))
    result = SetResult(on_replies, here.report())
    for m, method in s.methods.items():
        run = run_online(s.target, method, timed, label=label, block_size=B, max_new_tokens=e.max_new_tokens,
                         temperature=e.temperature, seed=e.seed, repeats=e.timing_repeats, strict=e.strict_exact,
                         costs=here, judge=s.judge, baselines=s.baselines, acceptance=str(e.acceptance_rule))
        online = run.figures
        own = on_replies["methods"][m]  # the path this method proposes, teacher-forced on the replies
        figures = {
            **online,
            "a_k_offline": own["a_k"],
            "recall": on_replies["recall"],
            "tau_offline": own["tau_offline"],
            "tau_offline_ci95": own.get("tau_offline_ci95"),
            "offline_prompts": len(prompts),
            # offline minus online on the same (online) prompts and, past a near-tie, the same tokens; trees: over
            # all prompts
            "tau_gap": own.get("tau_offline_subset", own["tau_offline"]) - online["tau_online_verified_prefix"],
            "oracle_tau": on_replies["oracle_tau"].get(str(method.top_k if method.top_k > 1 else max(ks))),
            "prompt_ids": [p["id"] for p in timed],
        }
        fastest = min(online.get("ms_per_token_ar_by_dtype", {}).values(), default=online["ms_per_token_ar"])
        first = OwnSet(timed, run.ar_outputs, run.spec_rounds, run.spec_outputs, online["a_k_online"], own["a_k"],
                       fastest)
        result.methods[m] = MethodOnSet(figures, first)
    return result

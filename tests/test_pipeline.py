"""The experiment configs and the one-command pipeline."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dflash_pipeline.cli.entrypoints import run_stages
from dflash_pipeline.eval.stage import eval_hash
from dflash_pipeline.runtime.stages import config_hash
from dflash_pipeline.eval.stage import EvalError, run_eval
from dflash_pipeline.eval.methods import METHODS, evaluated_names

from conftest import make_config

EXPERIMENTS = sorted(p.stem for p in (Path(__file__).parents[1] / "conf" / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_resolves(name):
    cfg = make_config(f"experiment={name}")
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert resolved["name"] == name
    assert resolved["drafter"]["block_size"] >= 2


def test_qwen3_8b_is_the_paper_scale_recipe():
    cfg = make_config("experiment=qwen3_8b")
    assert cfg.target.kind == "hf" and cfg.target.path == "Qwen/Qwen3-8B"
    assert (cfg.drafter.num_layers, cfg.drafter.block_size, cfg.teacher.num_taps) == (5, 16, 5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2_quick", "smollm2_ref", "smollm2_best"])
def test_smollm2_experiments_run_a_few_steps_on_the_real_target(name, tmp_path):
    cfg = make_config(f"experiment={name}", "data.num_samples=3", "teacher.prefill_samples=2",
                      "teacher.max_new_tokens=6", "trainer.steps=1", "trainer.heldout_samples=1",
                      "trainer.batch_sequences=2", "logger=none")
    out = run_stages(cfg, tmp_path, ["teacher", "train"])
    manifest = json.loads((out["teacher"] / "manifest.json").read_text())
    assert manifest["layer_ids"] == [1, 8, 14, 20, 27]
    assert manifest["num_samples"] == 3 + manifest.get("num_prefilled", 0)  # smollm2_quick: mixed
    assert (out["train"] / "export" / "model.safetensors").is_file()


@pytest.mark.slow
def test_long_context_recipe_takes_long_conversations_and_steps_by_tokens(tmp_path, monkeypatch):
    """experiment=long_context on the real target, shortened (first turns of 512 prompt tokens and 48 reply tokens
    of conversations of at least 2,000 tokens over all their turns: only 2 of the package's conversations reach 4,000
    with a first prompt that short), prefilled, trained in token-budget steps, with the logits and the packed
    attention in slices (small slices here, as the recipe's sequences of 8k tokens need at its own settings)."""
    from dflash_pipeline.models.drafter import PackedMask
    from dflash_pipeline.train.drafter import DrafterComponent

    recipe = make_config("experiment=long_context")
    assert (recipe.teacher.mode, recipe.data.min_tokens, recipe.trainer.tokens_per_step) == ("prefill", 4000, 16384)
    seen = {"steps": [], "loss_slices": [], "attention_slices": []}

    def spy(name, real, record):
        def wrapper(*args, **kwargs):
            out = real(*args, **kwargs)
            seen[name].append(record(args, out))
            return out
        return wrapper

    monkeypatch.setattr(DrafterComponent, "step_items", spy(
        "steps", DrafterComponent.step_items, lambda a, out: [a[0].data.length(i) for i in out]))
    monkeypatch.setattr(DrafterComponent, "loss_slices", spy("loss_slices", DrafterComponent.loss_slices,
                                                             lambda a, out: len(out)))
    monkeypatch.setattr(PackedMask, "row_chunks", spy("attention_slices", PackedMask.row_chunks, lambda a, out: len(out)))
    cfg = make_config("experiment=long_context", "data.num_samples=3", "data.max_prompt_tokens=512",
                      "data.min_tokens=2000", "teacher.max_turns=1", "teacher.max_new_tokens=48", "trainer.steps=2",
                      "trainer.heldout_samples=1", "trainer.tokens_per_step=600", "trainer.logits_chunk_mb=2",
                      "drafter.attention_chunk_mb=1", "logger=none")
    out = run_stages(cfg, tmp_path, ["teacher", "train"])
    manifest = json.loads((out["teacher"] / "manifest.json").read_text())
    assert manifest["num_samples"] == manifest["num_prefilled"] == 3
    lines = [json.loads(l) for l in (out["train"] / "metrics.jsonl").read_text().splitlines()]
    assert [l["step"] for l in lines] == [1, 2] and "tau_offline" in lines[-1]["heldout"]
    # each step takes sequences until their tokens reach the budget (without the one that reached it: below)
    assert len(seen["steps"]) == 2
    for lengths in seen["steps"]:
        assert len(lengths) >= 2 and sum(lengths) - max(lengths) < 600 <= sum(lengths), lengths
    assert max(seen["loss_slices"]) > 1 and max(seen["attention_slices"]) > 1, seen  # the sliced paths ran


def test_smollm2_best_is_the_measured_recipe_as_one_command():
    """docs/results/best-cpu-recipe.md reproduces the teacher-recipe grid's 1.6 CPU-hour row with this config."""
    cfg = make_config("experiment=smollm2_best")
    assert (cfg.teacher.mode, cfg.data.num_samples, cfg.teacher.prefill_samples) == ("mixed", 272, 3360)
    assert (cfg.trainer.steps, cfg.drafter.num_layers, cfg.drafter.intermediate_size) == (3200, 1, 768)
    assert list(cfg.pipeline.components) == ["selector", "weaver"] and cfg.weaver.root_children is None
    assert {"selector_greedy", "weaver_tree"} <= set(cfg.eval.methods)


def test_decode_settings_rerun_the_eval_and_not_the_training():
    """A tree's shape (weaver.children, weaver.root_children, weaver.expansions) is an eval setting: the Weaver's
    training stage keeps its hash (no retraining), the eval's changes (it re-runs); a training setting changes both."""
    base = make_config("experiment=tiny")
    wider = make_config("experiment=tiny", "weaver.root_children=8", "weaver.children=3",
                         "weaver.expansions=4")
    retrained = make_config("experiment=tiny", "weaver.rank=8")
    assert config_hash(wider, "train/weaver") == config_hash(base, "train/weaver")
    assert eval_hash(wider) != eval_hash(base)
    assert config_hash(retrained, "train/weaver") != config_hash(base, "train/weaver")
    assert eval_hash(retrained) != eval_hash(base)


@pytest.mark.slow
def test_tiny_pipeline_runs_every_stage_and_skips_finished_ones(tmp_path, caplog):
    """teacher -> drafter -> every component of pipeline.components -> eval of every method, each exact; a rerun
    skips everything."""
    cfg = make_config()
    assert {str(c) for c in cfg.pipeline.components} == {"selector", "jump", "jump_head", "weaver"}
    out = run_stages(cfg, tmp_path, ["teacher", "components", "eval"])
    assert (out["teacher"] / "manifest.json").is_file()
    for stage in ("train", "train/selector", "train/jump", "train/jump_head", "train/weaver"):
        assert (out[stage] / "export" / "config.json").is_file()
    results = json.loads((out["eval"] / "eval_results.json").read_text())
    # every method of the catalogue (tests/test_components.py: tiny lists them all), trees once per budget
    assert set(results["methods"]) == set(evaluated_names(METHODS, [4, 8]))
    assert {"boltzmann", "act", "adaptive", "bmobs"} <= set(results["policies"]) and results["costs"]["verify_cost"]
    assert set(results["costs"]["tree_cost"]) == {"4", "8"}
    # each set's speed is predicted from a curve measured at its own decode context, in autoregressive steps
    assert set(results["costs"]["per_set"]) == set(results["datasets"])
    for ds, r in results["methods"]["chain"].items():
        assert results["costs"]["per_set"][ds]["ar_cost"] > 0
        assert r["predicted_speedup"] == pytest.approx(r["tau_online"] / r["round_cost_predicted"])
        assert r["round_cost_in_decode"] > 0 and r["ar_step_ms"] > 0
    for tree in ("ddtree_8", "weaver_tree_8"):  # every round verifies the whole tree
        assert all(r["verified_per_round"] == 8 for r in results["methods"][tree].values())
    num = results["numerics"]  # float32 here: the strict check, no near-ties; the teacher's numerics recorded
    assert num["dtype"] == num["teacher_dtype"] == "float32" and num["same_as_teacher"] and num["machine"]["cpu"]
    for method, per in results["methods"].items():
        for ds, r in per.items():
            assert r["exact"] is True and r["mismatches"] == [], (method, ds)
            assert r["identical"] is True and r["near_tie_outputs"] == 0 and r["outputs_compared"] == 3
            assert set(r["ms_per_token_ar_by_dtype"]) == {"float32", "bfloat16"} and r["speedup_vs_fastest_ar"] > 0
            assert r["oracle_tau"] >= 1.0 and 0.0 <= r["select_fraction"] < 1.0
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    caplog.set_level(logging.INFO, logger="dflash_pipeline")
    run_stages(cfg, tmp_path, ["teacher", "components", "eval"])
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} == stamps
    # a finished run still ends with its headline figures and where the tables are
    chain = results["methods"]["chain"]["mtbench"]
    assert f"{chain['tau_online']:.3f}" in caplog.text and "results.md" in caplog.text

    # a method that cannot run with the asked settings is refused before any decoding, in one line
    with pytest.raises(EvalError, match=r"eval method selector_viterbi: .* greedily only"):
        run_eval(make_config("eval.temperature=0.5"), tmp_path / "eval-sampling", teacher_dir=out["teacher"],
                 train_dir=out["train"])
    assert not (tmp_path / "eval-sampling").exists()


@pytest.mark.slow
def test_a_changed_component_setting_retrains_that_component_and_reruns_the_eval_only(tmp_path):
    """A changed selector setting retrains the selector and reruns the eval; the teacher, the drafter and the other
    components are kept (a pipeline of two components and one eval set: the rule is the same for every size)."""
    small = ["pipeline.components=[selector,jump]", "eval.methods=[chain,selector_greedy,jump]",
             "eval.datasets=[mtbench]", "eval.turns=1", "eval.baseline_dtypes=[]", "eval.cost_repeats=1"]
    out = run_stages(make_config(*small), tmp_path, ["teacher", "components", "eval"])
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    # memory and speed settings change no output: nothing is made again
    runtime = ["trainer.logits_chunk_mb=1", "trainer.activation_checkpointing=true", "drafter.attention_chunk_mb=1",
               "trainer.eval_every=7", "trainer.keep_checkpoints=3"]
    run_stages(make_config(*small, *runtime), tmp_path, ["teacher", "components", "eval"])
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} == stamps
    old_selector = json.loads((out["train"] / "selector" / "done.json").read_text())["config_hash"]
    old_eval = json.loads((out["eval"] / "eval_results.json").read_text())["config_hash"]
    run_stages(make_config(*small, "selector.rank=8"), tmp_path, ["teacher", "components", "eval"])
    changed = {p for p in tmp_path.rglob("*") if p.is_file() and stamps.get(p) != p.stat().st_mtime_ns}
    assert out["train"] / "selector" / "done.json" in changed and out["eval"] / "eval_results.json" in changed
    untouched = [out["teacher"] / "manifest.json", out["train"] / "done.json", out["train"] / "jump" / "done.json"]
    assert not changed & set(untouched)
    # what the earlier config wrote is kept, moved aside under its hash, never deleted
    for folder, digest, files in ((out["train"] / "selector", old_selector, ["done.json", "export/model.safetensors"]),
                                  (out["eval"], old_eval, ["eval_results.json", "results.md"])):
        kept = folder / "superseded" / digest
        for name in files:
            assert (kept / name).is_file() and stamps[folder / name] == (kept / name).stat().st_mtime_ns, name

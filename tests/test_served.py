"""Served acceptance and the parity gates (eval/served.py, eval/gates.py, eval/engine_contract.py), and the vLLM
teacher (teacher.engine=vllm).

The gate's arithmetic and its diagnosis run everywhere; the tests that serve through vLLM need its venv
(`bash scripts/setup_vllm.sh`, which .ci/run runs) and are skipped, with that reason, where it is absent.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_pipeline.eval import served
from dflash_pipeline.eval import engine_contract as contract
from dflash_pipeline.eval import engines
from dflash_pipeline.eval import gates
from dflash_pipeline.eval.metrics import accepted_length_stats
from dflash_pipeline.models.drafter import DFlashDrafter
from dflash_pipeline.models.vllm_engine import VLLMError, venv_dir, vllm_python
from dflash_pipeline.train.drafter import drafter_config

from conftest import ROOT, make_config, run_command, user_env

TAPS = [1, 3]


def vllm_missing() -> str | None:
    try:
        vllm_python(make_config().cache_dir)
    except VLLMError as err:
        return str(err)
    return None


needs_vllm = pytest.mark.skipif(vllm_missing() is not None, reason=f"{vllm_missing()}")


# -- counters and the gate ---------------------------------------------------------------------------------------
def test_counters_from_own_rounds_mean_what_vllm_counts():
    """vLLM counts, per draft position k, the drafts that accepted at least k tokens: from the own loop's rounds
    that gives the same a_k and tau as the own eval's accepted_length_stats."""
    rounds = [[0, 2, 1], [3, 0], []]
    counts = gates.own_counts(rounds, 3)
    assert counts == {"drafts": 5, "accepted": 6, "accepted_per_pos": [3, 2, 1]}
    stats = accepted_length_stats([n for r in rounds for n in r], 4)
    r = gates.rates(counts)
    assert r["a_k"] == pytest.approx(stats["a_k"]) and r["tau"] == pytest.approx(stats["tau"])
    assert gates.summed([{"drafts": 2, "accepted": 1, "accepted_per_pos": [1]},
                         {"drafts": 3, "accepted": 5, "accepted_per_pos": [3, 2]}], 3) == \
        {"drafts": 5, "accepted": 6, "accepted_per_pos": [4, 2, 0]}


def test_gate_needs_equal_counters_in_float32_and_a_tolerance_in_bf16():
    own = {"drafts": 100, "accepted": 40, "accepted_per_pos": [30, 8, 2]}
    near = {"drafts": 101, "accepted": 41, "accepted_per_pos": [31, 8, 2]}
    same = {}
    assert gates.gate(own, dict(own), "float32", 0.02, True, same, same)["pass"]
    assert not gates.gate(own, near, "float32", 0.02, True, same, same)["pass"]  # one round off: fails
    assert gates.gate(own, near, "bfloat16", 0.02, True, same, same)["pass"]  # within 2% per position
    far = {"drafts": 100, "accepted": 30, "accepted_per_pos": [22, 6, 2]}
    verdict = gates.gate(own, far, "bfloat16", 0.02, True, same, same)
    assert not verdict["pass"] and verdict["line"].startswith("PARITY FAILED")
    assert "first apart at draft position 1: served rate 0.220 vs own 0.300 (the engine accepts less)" in verdict["line"]
    later = {"drafts": 100, "accepted": 45, "accepted_per_pos": [30, 13, 2]}
    assert "first apart at draft position 2" in gates.gate(own, later, "float32", 0.02, True, same, same)["line"]
    # equal counters but a served output that is not exact: fails too
    assert not gates.gate(own, dict(own), "float32", 0.02, False, same, same)["pass"]


def test_sampled_gate_names_what_moved():
    """At T > 0: samples off the target's distribution with acceptance within noise name the engine's sampler chain;
    acceptance that differs from the configured rule and matches the other one names the draft sampling."""
    def decodes(per_pos, n=40):
        return [{"drafts": 10, "accepted": sum(per_pos), "accepted_per_pos": list(per_pos)} for _ in range(n)]

    engine = {"version": "x", "checks": {}, "repaired": []}
    same, other = decodes([6, 3, 1]), decodes([2, 0, 0])
    biased = gates.sampled_gate(same, decodes([6, 3, 1]), 3, 0.01, "greedy_draft", 0.7, {"p": 1e-9}, engine, other)
    assert not biased["pass"] and "sampler chain" in biased["line"]
    swapped = gates.sampled_gate(same, decodes([2, 0, 0]), 3, 0.01, "greedy_draft", 0.7, {"p": 0.5}, engine, other)
    assert not swapped["pass"] and "eval.served.draft_sample_method" in swapped["line"]
    assert gates.sampled_gate(same, decodes([6, 3, 1]), 3, 0.01, "greedy_draft", 0.7, {"p": 0.5}, engine)["pass"]


def test_reduced_precision_gate_compares_the_prompts_that_took_the_same_tokens():
    """A bf16 decode that parted at a near-tie runs other tokens from there on: the gate compares the prompts whose
    own and served speculative outputs both equal the reference, and reports the whole set beside."""
    from dflash_pipeline.eval.exactness import IDENTICAL, NEAR_TIE, Verdict, first_mismatch

    class Judge:  # near-tie for every divergence (what a bf16 target's judge says of a tied pair)
        def classify(self, prompt_ids, reference, other):
            pos = first_mismatch(reference, other)
            return Verdict(IDENTICAL) if pos is None else Verdict(NEAR_TIE, pos, {})

    prompts = [{"id": "a", "prompt_ids": [1]}, {"id": "b", "prompt_ids": [2]}]
    ar = [[5, 6, 7, 8], [9, 10, 11, 12]]
    own_spec = [list(ar[0]), [9, 10, 13, 14]]  # prompt b parted from the reference at a near-tie
    vllm = {"outputs_plain": [list(ar[0]), list(ar[1])], "outputs_spec": [list(ar[0]), [9, 10, 15, 16]],
            "counters": [{"drafts": 2, "accepted": 2, "accepted_per_pos": [1, 1, 0]},
                         {"drafts": 4, "accepted": 0, "accepted_per_pos": [0, 0, 0]}]}
    rounds = [[2, 0], [1, 1]]
    own = gates.OwnSet(prompts, ar, rounds, own_spec, [0.5, 0.5, 0.5], [0.5, 0.5, 0.5])
    bf16 = gates.compare(vllm, own, gates.Gate(3, "bfloat16", 0.02, Judge(), {}, {}))
    assert bf16["gate"]["pass"] and bf16["gate"]["prompts_compared"] == 1 and bf16["same_path_prompts"] == [0]
    assert "1 of 2 prompts" in bf16["gate"]["line"] and len(bf16["near_ties"]) == 1
    assert bf16["counters_served"]["drafts"] == 6 and bf16["counters_own"]["drafts"] == 4  # the whole set, reported
    float32 = gates.compare(vllm, own, gates.Gate(3, "float32", 0.02, Judge(), {}, {}))
    assert not float32["gate"]["pass"]  # float32: every prompt, and no near-ties


def test_a_target_the_engine_decodes_differently_is_named_as_the_cause():
    """When the engine's plain decoding (no drafter) already differs from the target's own, the failed gate says the
    engine runs the target differently instead of naming a drafter contract key (seen with gpt-oss on vLLM's CPU
    build, docs/targets.md)."""
    from dflash_pipeline.eval.exactness import IDENTICAL, WRONG, Verdict, first_mismatch

    class Judge:
        def classify(self, prompt_ids, reference, other):
            pos = first_mismatch(reference, other)
            return Verdict(IDENTICAL) if pos is None else Verdict(WRONG, pos, {})

    prompts = [{"id": "a", "prompt_ids": [1]}]
    ar = [[5, 6, 7, 8]]
    vllm = {"outputs_plain": [[9, 6, 7, 8]], "outputs_spec": [[9, 6, 7, 8]],
            "counters": [{"drafts": 3, "accepted": 1, "accepted_per_pos": [1, 0, 0]}]}
    out = gates.compare(vllm, gates.OwnSet(prompts, ar, [[0, 0, 0, 0]], ar, [0.0] * 3, [0.0] * 3),
                        gates.Gate(3, "float32", 0.02, Judge(), {}, {}))
    line = out["gate"]["line"]
    assert line.startswith("PARITY FAILED") and "engine's plain decoding" in line and "from output position 0" in line
    assert "likely contract key" not in line and out["gate"]["likely_keys"] == []


@pytest.fixture(scope="module")
def export(tmp_path_factory, target):
    """A draft-vocabulary export of a tiny drafter and the drafter the own loop would run."""
    torch.manual_seed(0)
    m = target.model
    # a DFlash drafter: vLLM's CPU build serves DFlashDraftModel only (DFlash2's speculator is in its GPU runner)
    drafter = DFlashDrafter(drafter_config(make_config("drafter.conv_kernel_size=0"), target, TAPS),
                            m.get_input_embeddings(), m.get_output_embeddings())
    drafter.set_draft_vocab(torch.arange(0, drafter.config.vocab_size, 7))
    folder = tmp_path_factory.mktemp("export")
    drafter.save_pretrained(str(folder))
    return folder, drafter.eval()


def plant(src: Path, dst: Path, mismatch: str) -> Path:
    """A copy of an export with one classic trainer/engine mismatch planted."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    if mismatch == "taps":
        config["dflash_config"]["target_layer_ids"] = [i + 1 for i in config["dflash_config"]["target_layer_ids"]]
    elif mismatch == "mask":
        config["dflash_config"]["mask_token_id"] += 1
    elif mismatch == "causal":
        config["dflash_config"]["causal"] = True
    elif mismatch == "scale":  # the drafter's input embeddings scaled as a Gemma target's would be
        config["dflash_config"]["input_embedding_scale"] = 4.0
    elif mismatch == "rope":
        config["rope_theta"] = config["rope_theta"] * 10
    elif mismatch == "d2t":
        tensors = load_file(str(dst / "model.safetensors"))
        tensors["d2t"] = torch.roll(tensors["d2t"], 1)
        save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def test_a_scaled_embedding_is_exported_and_read_as_each_engine_reads_it(tmp_path, target):
    """A drafter on a target whose embedding module scales (Gemma's sqrt(hidden)) exports that scale with its logits
    as trained (multiplier 1, no soft-capping), as DFlash and as DFlash2: llama.cpp and vLLM's DFlash2 read it, so
    their contract matches the own loop's; vLLM's DFlash reads none, and the gate names input_embedding_scale."""
    m = target.model

    class Scaled(torch.nn.Module):  # transformers' Gemma scaled word embedding, as the drafter sees it
        def __init__(self, inner):
            super().__init__()
            self.inner, self.embedding_dim, self.embed_scale = inner, inner.embedding_dim, torch.tensor(8.0)

        def forward(self, ids):
            return self.inner(ids) * self.embed_scale

    for conv in (0, 3):
        cfg = make_config(f"drafter.conv_kernel_size={conv}")
        drafter = DFlashDrafter(drafter_config(cfg, target, TAPS), Scaled(m.get_input_embeddings()),
                                m.get_output_embeddings())
        folder = tmp_path / f"conv{conv}"
        drafter.save_pretrained(str(folder))
        nested = json.loads((folder / "config.json").read_text())["dflash_config"]
        assert nested["input_embedding_scale"] == 8.0 and nested["output_multiplier"] == 1.0
        assert "final_logit_softcapping" not in nested
        own = contract.drafter_contract(drafter)
        assert contract.likely_keys(contract.export_contract(folder, "llamacpp"), own) == []
        in_vllm = contract.likely_keys(contract.export_contract(folder, "vllm"), own)
        assert in_vllm == ([] if conv else [contract.SCALE])


PLANTED = {"taps": "dflash_config.target_layer_ids", "mask": "dflash_config.mask_token_id",
           "causal": "dflash_config.causal", "rope": "rope_theta", "d2t": "d2t"}


@pytest.mark.parametrize("mismatch", list(PLANTED))
def test_gate_names_the_planted_contract_key(tmp_path, export, mismatch):
    folder, drafter = export
    own = contract.drafter_contract(drafter)
    assert contract.likely_keys(contract.export_contract(folder), own) == []  # the export as written: nothing to name
    planted = contract.export_contract(plant(folder, tmp_path / mismatch, mismatch))
    assert contract.likely_keys(planted, own) == [PLANTED[mismatch]]
    counts = {"drafts": 10, "accepted": 4, "accepted_per_pos": [3, 1, 0]}
    worse = {"drafts": 12, "accepted": 1, "accepted_per_pos": [1, 0, 0]}
    line = gates.gate(counts, worse, "float32", 0.02, True, planted, own)["line"]
    assert line.startswith("PARITY FAILED") and PLANTED[mismatch] in line and "\n" not in line


# -- missing vLLM: one line naming the install command -----------------------------------------------------------
@pytest.mark.slow
def test_vllm_options_without_vllm_fail_in_one_line(tmp_path):
    env = dict(user_env(), DFLASH_VLLM_ENV=str(tmp_path / "no-venv"))
    proc = subprocess.run(["dflash-teacher", "experiment=tiny", "teacher.engine=vllm", f"hydra.run.dir={tmp_path}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "bash scripts/setup_vllm.sh" in lines[0], proc.stderr[-2000:]
    assert not (tmp_path / "teacher").exists()  # refused before any output
    proc = subprocess.run(["dflash-teacher", "experiment=tiny", "teacher.engine=vllm", "teacher.temperature=0.7",
                           f"hydra.run.dir={tmp_path}"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "teacher.temperature=0" in proc.stderr


def test_a_folder_made_by_the_other_engine_is_refused_in_one_line(tiny_teacher):
    """Refused before vLLM is needed: the folder's recorded config names the engine that made it."""
    from dflash_pipeline.data.shards import DatasetError
    from dflash_pipeline.data.teacher import run_teacher

    with pytest.raises(DatasetError, match=r"\(teacher.engine: 'hf' -> 'vllm'\)"):
        run_teacher(make_config("teacher.engine=vllm"), tiny_teacher)


def test_venv_location_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_VLLM_ENV", str(tmp_path / "v"))
    assert venv_dir("/anything") == tmp_path / "v"
    monkeypatch.delenv("DFLASH_VLLM_ENV")
    assert venv_dir(tmp_path) == tmp_path / "vllm" / "venv"


# -- through vLLM --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory) -> Path:
    """`dflash-pipeline experiment=tiny_vllm`: vLLM teacher, a drafter that is accepted, the served eval."""
    run_dir = tmp_path_factory.mktemp("tiny_vllm")
    run_command(["dflash-pipeline", "experiment=tiny_vllm", f"hydra.run.dir={run_dir}"], timeout=1800)
    return run_dir


@pytest.mark.slow
@needs_vllm
def test_served_acceptance_equals_the_own_loop_in_float32(vllm_run):
    results = json.loads((vllm_run / "eval" / "eval_results.json").read_text())
    s = results["served"]
    assert s["pass"] and s["dtype"] == "float32"
    for label, r in s["sets"].items():
        assert r["counters_served"] == r["counters_own"], label
        assert r["counters_own"]["accepted"] > 0, label  # a drafter that is accepted: real acceptance compared
        assert r["a_k_own"] == pytest.approx(results["methods"]["chain"][label]["a_k_online"])
        assert r["spec_identical_to_plain"] == r["prompts"] and not r["wrong"] and not r["near_ties"]
        assert r["gate"]["pass"] and r["tokens_per_s_spec"] > 0 and r["tokens_per_s_spec_batched"] > 0
    md = (vllm_run / "eval" / "results.md").read_text()
    assert "## Served (vllm" in md and "a_k served" in md and "Parity gate: passed" in md


@pytest.mark.slow
@needs_vllm
def test_vllm_teacher_equals_the_hf_teacher(vllm_run, tmp_path):
    """Replies token-identical in float32, features (vLLM's capture against transformers') equal to bf16 storage
    rounding, the engine in the manifest, and a folder made by one engine refused by the other in one line."""
    from dflash_pipeline.data.shards import DatasetError, TeacherDataset
    from dflash_pipeline.data.teacher import run_teacher

    hf_dir = run_teacher(make_config("experiment=tiny_vllm", "teacher.engine=hf", "teacher.capture=separate"),
                         tmp_path / "teacher")
    hf, vl = TeacherDataset(hf_dir), TeacherDataset(vllm_run / "teacher")
    assert hf.ids == vl.ids and len(hf) == 64
    assert (hf.manifest["engine"], vl.manifest["engine"]) == ("hf", "vllm")
    for i in range(len(hf)):
        a, b = hf[i], vl[i]
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        fa, fb = a["features"].float(), b["features"].float()
        assert torch.allclose(fa, fb, rtol=1 / 64, atol=1e-2 * float(fa.abs().max()))
    with pytest.raises(DatasetError, match="teacher.engine: 'hf' -> 'vllm'"):
        run_teacher(make_config("experiment=tiny_vllm"), hf_dir)


@pytest.mark.slow
@needs_vllm
def test_vllm_teacher_killed_and_rerun_gives_the_same_dataset(vllm_run, tmp_path):
    """SIGKILL once the first shard is committed (vLLM mid-way through the second), then the same command: the
    dataset equals an uninterrupted run's."""
    import signal
    import time

    from dflash_pipeline.data.shards import TeacherDataset

    cmd = ["dflash-teacher", "experiment=tiny_vllm", f"hydra.run.dir={tmp_path}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=user_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 900
    while not list((tmp_path / "teacher").glob("shard-00000*")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (tmp_path / "teacher" / "manifest.json").exists()
    subprocess.run(cmd, cwd=ROOT, env=user_env(), check=True, capture_output=True, timeout=900)
    again, whole = TeacherDataset(tmp_path / "teacher"), TeacherDataset(vllm_run / "teacher")
    assert again.ids == whole.ids
    for i in range(len(whole)):
        for key in ("input_ids", "loss_mask", "features"):
            assert torch.equal(again[i][key], whole[i][key]), (i, key)


def served_run(run_dir: Path):
    """The tiny_vllm run's config, target, export, the drafter loaded from it and four chat prompts."""
    from dflash_pipeline.models.target import load_target

    from conftest import chat_prompt_ids

    cfg = make_config("experiment=tiny_vllm")
    target = load_target(cfg.target, cfg.cache_dir)
    export = run_dir / "train" / "export"
    drafter = DFlashDrafter.from_pretrained(str(export), target.model.get_input_embeddings(),
                                            target.model.get_output_embeddings()).eval()
    prompts = chat_prompt_ids(target.tokenizer, ["Write a haiku about the sea.", "What is 12 times 7?",
                                                 "Name three rivers in Europe.", "How do magnets work?"])
    return cfg, target, export, drafter, prompts


@pytest.mark.slow
@needs_vllm
def test_gate_catches_each_planted_mismatch_when_served(vllm_run, tmp_path):
    """The run's export with each classic mismatch planted, served by vLLM on the prompts the own loop decodes with
    the export as trained: the gate fails and names the planted key."""
    from dflash_pipeline.eval.decode import speculative
    from dflash_pipeline.models.target_sources import target_folder
    from dflash_pipeline.models.vllm_engine import VLLMEngine, close_engines, speculative_config

    cfg, target, export, drafter, prompts = served_run(vllm_run)
    B, new = drafter.config.block_size, 32
    own = gates.own_counts([speculative(target, drafter, p, new).accepted for p in prompts], B - 1)
    assert own["accepted"] > 0
    own_contract = contract.drafter_contract(drafter)
    folder = target_folder(cfg.target, cfg.cache_dir)
    exports = {m: export if key is None else plant(export, tmp_path / m, m)
               for m, key in {"none": None, **PLANTED}.items()}
    caught, names = {}, list(exports)
    for pair in (names[i: i + 2] for i in range(0, len(names), 2)):  # two servers build side by side
        servers = {m: VLLMEngine(cfg.cache_dir, folder, "float32", 512, speculative_config(exports[m], B),
                                 log_file=tmp_path / f"vllm-{m}.log", wait=False) for m in pair}
        try:
            for mismatch, engine in servers.items():
                counts = gates.summed(engine.generate(prompts, new, sorted(target.eos_ids))["spec"], B - 1)
                verdict = gates.gate(own, counts, "float32", 0.02, True,
                                     contract.export_contract(exports[mismatch]), own_contract)
                caught[mismatch] = (verdict["pass"], verdict["likely_keys"], counts["accepted_per_pos"])
        finally:
            close_engines(*servers.values())
    assert caught.pop("none")[0], "the export as trained must serve at parity"
    for mismatch, (passed, keys, per_pos) in caught.items():
        assert not passed and keys == [PLANTED[mismatch]], (mismatch, per_pos, own)


@pytest.mark.slow
@needs_vllm
def test_gate_at_temperature_on_the_tiny_target(vllm_run, tmp_path):
    """At T > 0 the statistical gate passes the run's export served by vLLM (with the engine's known CPU bug
    mended) against the own loop's greedy-draft rule, with the served samples distributed as the target's; it
    fails a planted export (a shifted d2t: position 1 named); and the engine as installed fails it with the engine
    named as the cause where its self-check finds the bug (vLLM 0.32's CPU build). A shifted MASK token or taps
    move this tiny drafter's acceptance at T = 0.1 too little for 16 decodes to tell: the greedy gate catches those
    exactly (test_gate_catches_each_planted_mismatch_when_served). Served without the drafter (a drafter that did not
    load: vLLM's plain engine, once the others are closed), the greedy and the sampled gate both fail, saying the
    engine drafted nothing."""
    from dflash_pipeline.eval.decode import speculative
    from dflash_pipeline.models.target_sources import target_folder
    from dflash_pipeline.models.vllm_engine import VLLMEngine

    cfg, target, export, drafter, prompts = served_run(vllm_run)
    B, new, T, seeds = drafter.config.block_size, 32, 0.1, [0, 1, 2, 3]
    alpha = 0.001  # unseeded requests differ run to run: a pass must not be a coin flip, a planted fault is far off
    own = {r: served.own_sampled(target, drafter, prompts, B, new, T, seeds, r) for r in ("sampled", "greedy_draft")}
    folder = target_folder(cfg.target, cfg.cache_dir)

    def start(name, served_dir, repair):  # the three engines build side by side
        return engines.VLLMPair(cfg.cache_dir, folder, served_dir, "float32", B, 512, 1,
                                tmp_path / f"vllm-{name}.log", plain=False, repair=repair, wait=False)

    pairs = {"mended": start("mended", export, True),
             "planted": start("planted", plant(export, tmp_path / "d2t", "d2t"), True),
             "stock": start("stock", export, False)}
    try:
        verdicts = {name: served.sampled_set(engine, target, drafter, prompts, B, new, T, seeds, 4, alpha, "greedy",
                                             "t", own) for name, engine in pairs.items()}
    finally:
        for engine in pairs.values():
            engine.close()
    eos = sorted(target.eos_ids)
    with VLLMEngine(cfg.cache_dir, folder, "float32", 512, log_file=tmp_path / "vllm-unloaded.log") as unloaded:
        plain_counts = gates.summed(unloaded.generate(prompts, new, eos)["spec"], B - 1)
        plain_sampled = []  # as EnginePair.run_sampled records them: per seed, every prompt
        for seed in seeds:
            for p in prompts:
                res = unloaded.generate([p], new, eos, temperature=T, seeds=[seed])
                plain_sampled.append({**res["spec"][0], "output": res["outputs"][0], "seed": seed})
        plain_info = {"version": unloaded.version, "checks": unloaded.checks, "repaired": unloaded.repaired}
    mended, planted, stock = verdicts["mended"], verdicts["planted"], verdicts["stock"]
    checks = pairs["mended"].spec.checks
    assert mended["gate"]["pass"], mended["gate"]["line"]
    assert mended["rates"]["own_greedy_draft"]["a_k"][0]["accepted"] > 0  # real acceptance compared
    assert mended["distribution"]["served"]["p"] > alpha and mended["distribution"]["own"]["p"] > alpha
    assert not planted["gate"]["pass"] and 1 in planted["gate"]["positions"]["differ"], planted["gate"]["line"]
    if not checks["rejection_temperature"]:
        line = stock["gate"]["line"]
        assert not stock["gate"]["pass"] and "the engine's bug, vLLM" in line and "repair=true" in line, line
    else:  # a vLLM whose CPU rejection sampler is right: as installed is as mended
        assert stock["gate"]["pass"], stock["gate"]["line"]
    own_greedy = gates.own_counts([speculative(target, drafter, p, new).accepted for p in prompts], B - 1)
    unloaded_gates = (gates.gate(own_greedy, plain_counts, "float32", 0.02, True, {}, {}),
                      gates.sampled_gate(own["greedy_draft"], plain_sampled, B - 1, alpha, "greedy_draft", T,
                                         served.distribution(target, prompts, plain_sampled, T), plain_info,
                                         seeds=len(seeds)))
    for v in unloaded_gates:
        assert not v["pass"] and "the engine drafted nothing" in v["line"] and "is the drafter loaded?" in v["line"], \
            v["line"]


@pytest.mark.slow
@needs_vllm
def test_served_eval_at_temperature_reports_every_run_kind(vllm_run):
    """dflash-eval with eval.temperature > 0 and the served engine: per set the own loop under both rules and the
    served seeded / unseeded / batched runs with intervals, the gate's line, in results.md and eval_results.json."""
    proc = subprocess.run(["dflash-eval", "experiment=tiny_vllm", f"hydra.run.dir={vllm_run}", "eval.temperature=0.1",
                           "eval.out_dir=eval_t", "eval.served.repair=true", "eval.served.seeds=2",
                           "eval.online_prompts=3", "eval.datasets=[mtbench]", "eval.acceptance_rule=greedy_draft"],
                          cwd=ROOT, env=user_env(), capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((vllm_run / "eval_t" / "eval_results.json").read_text())
    assert results["acceptance_rule"] == "greedy_draft"
    r = results["served"]["sets"]["mtbench"]
    assert set(r["rates"]) == {"own_sampled", "own_greedy_draft", "served_seeded", "served_unseeded",
                               "served_batched"}
    assert r["rates"]["served_seeded"]["decodes"] == 6 and r["engine"]["repaired"] == ["rejection_temperature"] or \
        r["engine"]["checks"]["rejection_temperature"]
    assert r["gate"]["line"] and r["distribution"]["served"]["n"] > 0
    md = (vllm_run / "eval_t" / "results.md").read_text()
    assert "## Served at temperature" in md and "served_unseeded" in md and r["gate"]["line"] in md

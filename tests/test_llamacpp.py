"""llama.cpp at the serving end: the exported drafter and the target converted to GGUF by llama.cpp's own converter,
served by llama-server beside the own loop, and the parity gate (eval/served.py, eval/gates.py, models/llamacpp_engine.py)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import make_config, run_command
from dflash_pipeline.eval import engine_contract as contract
from dflash_pipeline.eval import gates
from dflash_pipeline.eval.errors import EvalError
from dflash_pipeline.models import llamacpp_engine
from test_served import plant, served_run


def llamacpp_missing() -> str | None:
    try:
        llamacpp_engine.paths(make_config().cache_dir)
    except llamacpp_engine.LlamaCppError as e:
        return str(e)
    return None


needs_llamacpp = pytest.mark.skipif(llamacpp_missing() is not None, reason=f"{llamacpp_missing()}")


def test_a_draft_vocabulary_drafter_is_refused_in_one_line_naming_the_way_out(tmp_path):
    from dflash_pipeline.eval.stage import check_llamacpp

    folder = tmp_path / "export"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"vocab_size": 512, "draft_vocab_size": 64}))
    with pytest.raises(llamacpp_engine.LlamaCppError, match=r"64-token vocabulary.*trainer.draft_vocab_size=null"):
        llamacpp_engine.to_gguf(tmp_path, folder, tmp_path / "gguf", target_dir=tmp_path)
    drafter = SimpleNamespace(draft_to_target=torch.arange(64), config=SimpleNamespace(vocab_size=512))
    with pytest.raises(EvalError, match=r"64-token vocabulary.*trainer.draft_vocab_size=null"):
        check_llamacpp(make_config("eval.served.engine=llamacpp"), drafter)


@pytest.mark.parametrize("overrides, refusal", [
    (["eval.temperature=0.5", "eval.served.draft_sample_method=probabilistic"], "draft_sample_method=greedy"),
    (["eval.served.method=selector_greedy", "eval.methods=[chain]"], "add selector_greedy to eval.methods"),
    (["eval.served.method=selector_greedy", "eval.served.engine=vllm"], "eval.served.engine=llamacpp"),
    (["eval.served.method=selector_greedy", "eval.temperature=0.5"], "eval.served.method=chain"),
])
def test_served_settings_that_do_not_fit_are_refused_before_any_stage(tmp_path, overrides, refusal):
    """From the config alone, before the teacher runs: the one draft sampling llama.cpp runs at temperature, the
    method whose runs the gate reads, and where the DFlash2 selector is served."""
    from dflash_pipeline.cli.entrypoints import run_stages

    cfg = make_config("eval.served.engine=llamacpp", *overrides)
    with pytest.raises(EvalError, match=refusal):
        run_stages(cfg, tmp_path / "run", ["teacher", "components", "eval"])
    assert not (tmp_path / "run").exists()


def test_export_gguf_is_refused_before_training_for_a_draft_vocabulary(tmp_path):
    """export.gguf with a draft-vocabulary recipe stops in one line before any stage runs (no teacher data, no
    training to throw away)."""
    from dflash_pipeline.cli.entrypoints import run_stages

    cfg = make_config("export.gguf=[f32]", "trainer.draft_vocab_size=64")
    with pytest.raises(llamacpp_engine.LlamaCppError, match="64-token vocabulary.*draft_vocab_size=null"):
        run_stages(cfg, tmp_path / "run", ["teacher", "components"])
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def llamacpp_run(tmp_path_factory) -> Path:
    """`dflash-pipeline experiment=tiny_llamacpp`: a full-vocabulary drafter that is accepted, served in llama.cpp."""
    run_dir = tmp_path_factory.mktemp("tiny_llamacpp")
    run_command(["dflash-pipeline", "experiment=tiny_llamacpp", f"hydra.run.dir={run_dir}"], timeout=1800)
    return run_dir


@pytest.mark.slow
@needs_llamacpp
def test_export_writes_gguf_files_llama_server_serves(llamacpp_run):
    """export.gguf (tiny_llamacpp: f32): the drafter and the target as GGUF beside the export, the same files the
    served eval converted, and serve.json's llama-server command naming them."""
    out = llamacpp_run / "train" / "export" / "gguf"
    serve = json.loads((out / "serve.json").read_text())
    assert serve["architecture"] == "DFlashDraftModel" and serve["block_size"] == 4
    for role in ("drafter", "target"):
        assert (out / serve[role]["f32"]).stat().st_size > 0
    served_files = json.loads((llamacpp_run / "eval" / "eval_results.json").read_text())["served"]["gguf"]
    assert (out / "drafter-f32.gguf").read_bytes() == Path(served_files["drafter"]).read_bytes()
    assert "-md drafter-f32.gguf --spec-type draft-dflash --spec-draft-n-max 3" in serve["command"]
    # files are written under <name>.tmp<pid> and renamed when complete (runtime/files.py atomic_path): none is left
    assert not list(out.glob("*.tmp[0-9]*"))


@pytest.mark.slow
@needs_llamacpp
def test_dflash2_selector_walk_in_llamacpp_passes_the_gate(llamacpp_run, tmp_path):
    """experiment=tiny_llamacpp_dflash2 on the fixture's teacher data: the DFlash2 checkpoint (convolution and the
    trained selector) written as GGUF and served by llama-server, whose selector walk drafts what the own loop's
    selector_greedy drafts: the gate passes, and the selector changes the drafts (its tau is not the chain's)."""
    run = tmp_path / "dflash2"
    # the convolution drafter starts from the fixture's trained DFlash drafter (its convolution the identity, as a
    # DFlash2 fine-tune does): 40 steps then give it the acceptance 150 from random weights would
    run_command(["dflash-pipeline", "experiment=tiny_llamacpp_dflash2", f"trainer.data_dir={llamacpp_run / 'teacher'}",
                 f"drafter.init_from={llamacpp_run / 'train' / 'export'}", "trainer.steps=40",
                 "eval.datasets=[mtbench]", f"hydra.run.dir={run}"], timeout=1800)
    serve = json.loads((run / "train" / "selector" / "export" / "gguf" / "serve.json").read_text())
    assert serve["architecture"] == "DFlash2DraftModel"
    results = json.loads((run / "eval" / "eval_results.json").read_text())
    s = results["served"]["sets"]["mtbench"]
    assert results["served"]["pass"] and not s["wrong"], s["gate"]["line"]
    assert s["counters_served"]["accepted"] > 0 and s["gate"]["prompts_compared"] >= 3
    if len(s["same_path_prompts"]) == s["prompts"]:  # every decode took the same tokens: the same rounds (docs)
        assert s["counters_served"] == s["counters_own"], (s["counters_served"], s["counters_own"])
    chain, walk = (results["methods"][m]["mtbench"]["a_k_online"] for m in ("chain", "selector_greedy"))
    assert chain != walk


@pytest.mark.slow
@needs_llamacpp
def test_sampled_gate_in_llamacpp(llamacpp_run):
    """At T > 0 llama-server drafts the argmax and keeps drafts while the target's sample matches them: the
    statistical gate against the own loop's greedy_draft rule passes, and the served samples follow the target's
    distribution (a sampler chain that truncates, e.g. llama.cpp's default top-k 40, fails it: PIT p ~ 0)."""
    run_command(["dflash-pipeline", "experiment=tiny_llamacpp", f"hydra.run.dir={llamacpp_run}",
                 "eval.temperature=0.1", "eval.out_dir=eval_t01", "eval.datasets=[mtbench]"], timeout=1200)
    res = json.loads((llamacpp_run / "eval_t01" / "eval_results.json").read_text())["served"]
    s = res["sets"]["mtbench"]
    assert res["pass"] and s["rule"] == "greedy_draft" and s["engine"]["version"].startswith("llama.cpp"), s["gate"]
    assert s["tau_served"] > 1.15 and s["gate"]["distribution_p"] > 0.01  # drafts accepted: the test can tell


@pytest.mark.slow
@needs_llamacpp
def test_llamacpp_acceptance_per_position_beside_the_own_loop_passes_the_gate(llamacpp_run):
    """Every set served by llama-server: its per-position acceptance from its own counters beside the own loop's on
    the same prompts, speculative outputs equal to its plain decoding, and the gate passing on the float32 target
    (rates within the tolerance on the prompts whose decodes took the same tokens; near-ties named as such). Where
    every prompt took the same tokens (MT-Bench in docs/results/llamacpp.md) the float32 counters are equal, not
    only within the tolerance."""
    results = json.loads((llamacpp_run / "eval" / "eval_results.json").read_text())["served"]
    assert results["engine"] == "llamacpp" and results["pass"], [s["gate"]["line"] for s in results["sets"].values()]
    assert results["gguf"]["drafter"].endswith("-f32.gguf") and results["dtype"] == "float32"
    whole = []
    for label, s in results["sets"].items():
        assert s["spec_identical_to_plain"] == s["prompts"], label  # the drafter never changes llama.cpp's output
        assert not s["wrong"], (label, s["wrong"])
        assert len(s["a_k_served"]) == len(s["a_k_own"]) == 3
        assert s["counters_served"]["accepted"] > 0 and s["gate"]["prompts_compared"] >= s["prompts"] // 2
        gated_rates = gates.rates(s["counters_own"])
        assert gated_rates["tau"] > 1.2, label  # a drafter that is accepted: the gate can tell
        if len(s["same_path_prompts"]) == s["prompts"]:
            whole.append(label)
            assert s["counters_served"] == s["counters_own"], (label, s["counters_served"], s["counters_own"])
    assert whole, "no set whose decodes all took the same tokens: the counters' equality was not checked"


@pytest.mark.slow
@needs_llamacpp
def test_gate_catches_each_planted_mismatch_in_llamacpp(llamacpp_run, tmp_path):
    """The run's export with a tap shifted, the wrong MASK token or a wrong embedding scale, converted and served
    by llama-server on prompts the own loop decodes with the export as trained: the gate fails and names the key;
    the export as trained passes. Served without the drafter (a drafter that did not load), the greedy and the
    sampled gate both fail, saying the engine drafted nothing."""
    from dflash_pipeline.eval import served
    from dflash_pipeline.eval.decode import speculative
    from dflash_pipeline.models.target_sources import target_folder

    cfg, target, export, drafter, prompts = served_run(llamacpp_run)
    B, new = drafter.config.block_size, 32
    own = gates.own_counts([speculative(target, drafter, p, new).accepted for p in prompts], B - 1, budget=new)
    assert own["accepted"] > 0
    own_contract = contract.drafter_contract(drafter)
    folder = target_folder(cfg.target, cfg.cache_dir)
    gguf = tmp_path / "gguf"
    target_gguf = llamacpp_engine.to_gguf(cfg.cache_dir, folder, gguf)
    planted = {"none": None, "taps": "dflash_config.target_layer_ids", "mask": "dflash_config.mask_token_id",
               "scale": "input_embedding_scale"}
    caught = {}
    for mismatch, key in planted.items():
        out = export if key is None else plant(export, tmp_path / mismatch, mismatch)
        drafter_gguf = llamacpp_engine.to_gguf(cfg.cache_dir, out, gguf, target_dir=folder)
        with llamacpp_engine.LlamaServer(cfg.cache_dir, target_gguf, drafter_gguf, block_size=B, ctx=512,
                                         log_file=tmp_path / f"llamacpp-{mismatch}.log") as server:
            counts = gates.summed(server.generate(prompts, new, sorted(target.eos_ids))["spec"], B - 1)
        verdict = gates.gate(own, counts, "float32 in llama.cpp", 0.02, True,
                             contract.export_contract(out, "llamacpp"), own_contract)
        caught[mismatch] = (verdict["pass"], verdict["likely_keys"], counts["accepted_per_pos"])
    assert caught.pop("none")[0], "the export as trained must serve at parity"
    for mismatch, (passed, keys, per_pos) in caught.items():
        assert not passed and keys == [planted[mismatch]], (mismatch, per_pos, own)
    T, seeds, eos = 0.1, [0, 1], sorted(target.eos_ids)
    with llamacpp_engine.LlamaServer(cfg.cache_dir, target_gguf, block_size=B, ctx=512,
                                     log_file=tmp_path / "llamacpp-unloaded.log") as plain:
        counts = gates.summed(plain.generate(prompts, new, eos)["spec"], B - 1)
        sampled = []  # as EnginePair.run_sampled records them: per seed, every prompt
        for seed in seeds:
            for p in prompts:
                res = plain.generate([p], new, eos, temperature=T, seeds=[seed])
                sampled.append({**res["spec"][0], "output": res["outputs"][0], "seed": seed})
        engine = {"version": plain.version, "checks": plain.checks, "repaired": plain.repaired}
    greedy = gates.gate(own, counts, "float32 in llama.cpp", 0.02, True, own_contract, own_contract)
    own_t = served.own_sampled(target, drafter, prompts, B, new, T, seeds, "greedy_draft", budget=new)
    verdict = gates.sampled_gate(own_t, sampled, B - 1, 0.01, "greedy_draft", T,
                                 served.distribution(target, prompts, sampled, T), engine, seeds=len(seeds))
    for v in (greedy, verdict):
        assert not v["pass"] and "the engine drafted nothing" in v["line"] and "is the drafter loaded?" in v["line"], \
            v["line"]


@pytest.mark.slow
@needs_llamacpp
def test_gemma4_target_and_its_drafter_in_llamacpp(tmp_path):
    """The tiny Gemma 4 target (per-layer embeddings, KV sharing, soft-capped logits), converted and served by
    llama.cpp, decodes as the target itself does (but for near-ties); its drafter's export carries the embedding
    scale it trains with (sqrt(hidden) = 8), which llama.cpp's GGUF holds, and speculation leaves the outputs as
    plain decoding makes them."""
    import sys

    from conftest import ROOT, chat_prompt_ids
    from dflash_pipeline.eval.exactness import IDENTICAL, NEAR_TIE, ExactnessJudge
    from dflash_pipeline.models.drafter import DFlashDrafter
    from dflash_pipeline.models.target import load_target
    from dflash_pipeline.train.drafter import drafter_config

    sys.path.insert(0, str(ROOT / "scripts"))
    import tiny_target

    folder = tiny_target.build("gemma4", tmp_path / "gemma4", tiny_target.smollm2_tokenizer(), std=0.2)
    cfg = make_config("target=hf", f"target.path={folder}", "drafter.conv_kernel_size=0")
    target = load_target(cfg.target, cfg.cache_dir)
    m = target.model
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config(cfg, target, [1, 3]), m.get_input_embeddings(), m.get_output_embeddings())
    drafter.save_pretrained(str(tmp_path / "export"))
    assert json.loads((tmp_path / "export" / "config.json").read_text())["dflash_config"]["input_embedding_scale"] == 8
    gguf_dir = tmp_path / "gguf"
    target_gguf = llamacpp_engine.to_gguf(cfg.cache_dir, folder, gguf_dir)
    drafter_gguf = llamacpp_engine.to_gguf(cfg.cache_dir, tmp_path / "export", gguf_dir, target_dir=folder)
    sys.path.insert(0, llamacpp_engine.paths(cfg.cache_dir)["gguf_py"])
    import gguf

    field = gguf.GGUFReader(drafter_gguf).fields["dflash.embedding_scale"]
    assert float(field.parts[field.data[0]][0]) == 8.0
    prompts = chat_prompt_ids(target.tokenizer, ["Write a haiku about the sea.", "What is 12 times 7?",
                                                 "Name three rivers in Europe."])
    new, eos = 24, sorted(target.eos_ids)
    judge = ExactnessJudge(m, cfg.eval.near_tie_tolerance).near_ties_allowed()
    with llamacpp_engine.LlamaServer(cfg.cache_dir, target_gguf, ctx=512, block_size=4) as plain, \
            llamacpp_engine.LlamaServer(cfg.cache_dir, target_gguf, drafter_gguf, ctx=512, block_size=4) as spec:
        outs = [server.generate(prompts, new, eos)["outputs"] for server in (plain, spec)]
    assert outs[0] == outs[1]
    for p, out in zip(prompts, outs[0]):
        ref = m.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, eos_token_id=eos,
                         pad_token_id=target.tokenizer.pad_token_id)[0, len(p):].tolist()
        assert judge.classify(p, ref, out).kind in (IDENTICAL, NEAR_TIE), (ref, out)

"""Target families through everything that touches the target: the teacher's continuous batch and capture, the exact
decoding loop with each rollback, tree verification, the drafter's shape. Tiny random targets built from transformers'
own configs (scripts/tiny_target.py: linear-attention and Mamba hybrids, MLA, per-layer Gemma 4, sliding windows,
attention sinks, soft-capping, an image-text wrapper), every output checked against the target's own `generate`."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from dflash_pipeline.eval.decode import autoregressive, speculative
from dflash_pipeline.eval.tree import DDTreeMethod, DraftTree, check_target, verify_tree
from dflash_pipeline.models import cache as target_cache
from dflash_pipeline.models.drafter import DFlashDrafter
from dflash_pipeline.models.generation import capture, generate_capturing
from dflash_pipeline.models.errors import TargetError
from dflash_pipeline.models.families import final_norm, tapped
from dflash_pipeline.models.target import load_target
from dflash_pipeline.train.drafter import drafter_config

from conftest import ROOT, Oracle, chat_prompt_ids, make_config

sys.path.insert(0, str(ROOT / "scripts"))
import tiny_target  # noqa: E402

FAMILIES = list(tiny_target.FAMILIES)
RECURRENT = {"qwen3_next", "qwen3_5", "qwen3_5_vl", "nemotron_h", "falcon_h1", "granite4_hybrid", "lfm2"}
TEXTS = ["Hi", "What is 2+2?",
         "Write a long poem about the sea and the sky and the birds that fly in between them all day long, please."]


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    made: dict[str, Path] = {}

    def folder(family: str) -> Path:
        if family not in made:
            made[family] = tiny_target.build(family, root / family, tiny_target.smollm2_tokenizer())
        return made[family]

    return folder


def family_target(family_dirs, family: str):
    cfg = make_config("target=hf", f"target.path={family_dirs(family)}")
    return cfg, load_target(cfg.target, cfg.cache_dir)


def reference(target, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by the target's own transformers `generate`: the ground truth of every check here."""
    out = target.model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                                eos_token_id=sorted(target.eos_ids), pad_token_id=target.tokenizer.pad_token_id)
    return out[0, len(prompt):].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_family_teacher_and_exact_loop(family_dirs, family):
    """Continuous batching (rows admitted and finishing at different steps), the autoregressive loop and speculative
    decoding with rollbacks of every length all equal the target's own greedy `generate`; trees too where the family
    can serve them (sliding windows, sinks and soft-capping included)."""
    torch.manual_seed(0)
    _, target = family_target(family_dirs, family)
    prompts = chat_prompt_ids(target.tokenizer, TEXTS)
    assert len(prompts[-1]) > 16  # longer than the sliding windows of the configs
    n = 24
    refs = [reference(target, p, n) for p in prompts]
    replies, captured = generate_capturing(target.model, prompts, [1, 3], max_new_tokens=n, eos_ids=target.eos_ids,
                                           pad_id=target.tokenizer.pad_token_id, batch_size=2)
    assert replies == refs
    # the features kept as generation computed them equal one prefill over prompt + reply (the separate capture)
    again = capture(target.model, [p + r for p, r in zip(prompts, refs)], [1, 3], pad_id=target.tokenizer.pad_token_id)
    for c, a in zip(captured, again):
        torch.testing.assert_close(c["features"], a["features"], atol=2e-4, rtol=2e-4)
    assert autoregressive(target, prompts[-1], n)[0] == refs[-1]
    recurrent = target_cache.is_recurrent(target.model)
    assert recurrent == (family in RECURRENT)
    for rollback in target_cache.ROLLBACKS if recurrent else ("record",):
        for p, ref in zip(prompts, refs):
            oracle = Oracle(ref, 4, target.config.vocab_size, corrupt=0.3)
            res = speculative(target, oracle, p, n, rollback=rollback)
            assert res.tokens == ref, (family, rollback)
        assert 0 < sum(res.accepted) < sum(res.verified)  # rounds that accepted some drafts and rejected others
    if not recurrent:
        for p, ref in zip(prompts, refs):
            res = speculative(target, Oracle(ref, 4, target.config.vocab_size, 0.3, tree=True), p, n)
            assert res.tokens == ref, family
            assert sum(res.accepted) > 0


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "gpt_oss", "gemma4"])
def test_tree_verify_equals_the_chain_forward_under_sliding_windows(family_dirs, family):
    """Each accepted node's logits under the tree mask equal a chain forward over its path, on a context longer than
    the window: the sliding layers get the window applied to the tree (the cause of the inexact trees before)."""
    _, target = family_target(family_dirs, family)
    model = target.model
    prompt = chat_prompt_ids(target.tokenizer, TEXTS[-1:])[0]
    L = len(prompt)
    cont = reference(target, prompt, 4)
    cache = target_cache.new_cache(model)
    model(input_ids=torch.tensor([prompt[:-1]]), cache=cache, use_cache=True)
    tree = DraftTree(torch.tensor([cont[0], 5, cont[1], 9]), torch.tensor([-1, -1, 0, 0]), torch.tensor([1, 1, 2, 2]))
    verdict = verify_tree(model, cache, L - 1, prompt[-1], tree, [1])
    chain = model(input_ids=torch.tensor([prompt + cont[:2]])).logits[0, L - 1:]
    torch.testing.assert_close(verdict.logits[[0, 1, 3]], chain, atol=1e-4, rtol=1e-4)


def test_trees_are_refused_at_once_on_recurrent_targets(family_dirs):
    """A tree method on a recurrent target stops before any decoding with one line; cutting a cache holding a
    linear-attention layer to a tree path raises instead of keeping the rejected nodes in its state."""
    cfg, target = family_target(family_dirs, "qwen3_next")
    drafter = DFlashDrafter(drafter_config(cfg, target, [1, 3]), target.model.get_input_embeddings(),
                            target.model.get_output_embeddings()).eval()
    method = DDTreeMethod(drafter, 4)
    with pytest.raises(ValueError, match="recurrent target Qwen3NextForCausalLM"):
        check_target(method, target.model)
    with pytest.raises(ValueError, match="per branch"):
        speculative(target, method, [1, 2, 3], 8)
    cache = target_cache.new_cache(target.model)
    target.model(input_ids=torch.tensor([[1, 2, 3, 4]]), cache=cache, use_cache=True)
    with pytest.raises(target_cache.CacheError, match="LinearAttention"):
        target_cache.keep_path(cache, 2, torch.tensor([0]))
    with pytest.raises(target_cache.CacheError, match="Rollback"):
        target_cache.crop(cache, 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_drafter_shape_taps_and_final_norm_per_family(family_dirs, family):
    """The drafter's shape comes from the text decoder's config (per-layer values from a full-attention layer; an
    image-text wrapper's language model), the captured features are the tapped decoder layers' outputs, and the
    family's final norm (found by its name) turns the last layer's output into the rows the LM head reads."""
    cfg, target = family_target(family_dirs, family)
    conf = drafter_config(cfg, target, [1, 3])
    assert conf.target_hidden_size == target.hidden_size == 64
    assert conf.num_target_layers == target.num_layers == 6
    assert conf.vocab_size == len(target.tokenizer)
    if family == "gemma4":
        assert conf.head_dim == 64  # the full-attention layers' (the sliding ones have 32)
    seq = chat_prompt_ids(target.tokenizer, TEXTS[:1])[0]
    got = capture(target.model, [seq], [1, 3], pad_id=target.tokenizer.pad_token_id, final=True,
                  prenorm_final=True)[0]
    hs = target.model(input_ids=torch.tensor([seq]), output_hidden_states=True).hidden_states
    torch.testing.assert_close(got["features"], tapped(hs, [1, 3])[0])
    torch.testing.assert_close(got["features"][:, 64:], hs[4][0])  # layer 3 = hidden_states[4]
    torch.testing.assert_close(final_norm(target.model)(got["prenorm_final_hidden"]), got["final_hidden"])


def test_a_target_folder_missing_weights_is_refused(family_dirs, tmp_path):
    """A folder whose checkpoint lacks the causal LM's weights (here the LM head) would load with random ones: one
    line naming them instead."""
    import json
    import shutil

    src = family_dirs("qwen3_5_vl")
    bad = tmp_path / "untied"
    shutil.copytree(src, bad)
    config = json.loads((bad / "config.json").read_text())
    config["text_config"]["tie_word_embeddings"] = config["tie_word_embeddings"] = False
    (bad / "config.json").write_text(json.dumps(config))
    cfg = make_config("target=hf", f"target.path={bad}")
    with pytest.raises(TargetError, match="lacks weights"):
        load_target(cfg.target, cfg.cache_dir)


THINKING_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'user' -%}<|im_start|>user\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' -%}<|im_start|>assistant\n"
    "{%- set c = m.content -%}"
    "{%- if '</think>' in c and not loop.last -%}{%- set c = c.split('</think>')[-1] -%}{%- endif -%}"
    "{%- if enable_thinking is defined and not enable_thinking and '<think>' not in c -%}<think></think>{%- endif -%}"
    "{{ c }}<|im_end|>\n{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and not enable_thinking -%}<think></think>{%- endif -%}{%- endif -%}")


@pytest.mark.parametrize("thinking", [True, False])
def test_thinking_template_arguments_reach_the_teacher_and_earlier_reasoning_is_kept(thinking, tmp_path):
    """target.chat_template_kwargs renders every prompt (thinking off: each assistant turn opens with an empty
    think block); a template that strips earlier turns' reasoning does not strip it from the teacher's sequences:
    turn 2 is trained on turn 1's reply as the target wrote it, reasoning included, which is what it saw."""
    from dflash_pipeline.data.teacher import chat_segments, chat_with_replies
    from dflash_pipeline.models.target_sources import load_tokenizer

    cfg = make_config(f"+target.chat_template_kwargs={{enable_thinking: {str(thinking).lower()}}}")
    tok = load_tokenizer(cfg.target, cfg.cache_dir)
    tok.chat_template = THINKING_TEMPLATE
    assert tok.template_kwargs == {"enable_thinking": thinking}
    reply = "<think>carry the one</think>It is 4."
    msgs = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": reply},
            {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": "6."}]
    segments = [tok.decode(s) for s in chat_segments(tok, msgs, max_turns=2)]
    opening = "<|im_start|>assistant" + ("" if thinking else "<think></think>")
    assert all(s.endswith(opening) for s in segments)
    ids, mask = chat_with_replies(tok, msgs, 2, 64)
    text = tok.decode(ids)
    assert "carry the one" in text  # earlier reasoning kept as written...
    served = tok.apply_chat_template(msgs[:3], tokenize=False, add_generation_prompt=True, **tok.template_kwargs)
    assert "carry the one" not in served  # ...where the template itself would strip it
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    assert trained == reply + "6."  # the trained span: the replies only


# One eval set, one turn, no dtype baselines and one cost pass: what is family-specific in a run is the target's
# forward, cache and shapes, which one set decodes through; the other sets, MT-Bench's second turn and the timing
# baselines are the same code on every family (tests/test_pipeline.py runs them in experiment=tiny).
FAMILY_RUN = ["eval.datasets=[mtbench]", "eval.turns=1", "eval.baseline_dtypes=[]", "eval.cost_repeats=1",
              "logger=none"]
# The families vLLM's CPU build serves as DFlash targets (docs/targets.md): gemma4's every-stage run is also served
# (a DFlash drafter then, since vLLM's CPU build serves DFlashDraftModel, not DFlash2); qwen3 and qwen3_moe serve a
# drafter alone (every stage is shown on the six families below).
SERVED = ["qwen3", "qwen3_moe", "gemma4"]
EVERY_STAGE = ["qwen3_5_vl", "nemotron_h", "deepseek_v3", "gemma4", "gpt_oss", "gemma2"]
SERVE = ["drafter.conv_kernel_size=0", "eval.served.engine=vllm"]


def family_run(family_dirs, family: str, run: Path, *extra: str) -> dict:
    """`dflash-pipeline experiment=tiny target=hf target.path=<folder> ...` in this process; its eval results."""
    import json

    from dflash_pipeline.cli.entrypoints import run_stages

    cfg = make_config("target=hf", f"target.path={family_dirs(family)}", *FAMILY_RUN, *extra)
    out = run_stages(cfg, run, ["teacher", "components", "eval"])
    return json.loads((out["eval"] / "eval_results.json").read_text())


def assert_served_at_parity(results: dict, family: str) -> None:
    """The served eval ran and the parity gate passed: served outputs exact, the same drafts accepted and rejected
    as in the own loop."""
    served = results["served"]
    assert served["pass"] and served["dtype"] == "float32"
    for label, r in served["sets"].items():
        assert r["gate"]["pass"] and not r["wrong"], (family, label)
        assert r["counters_served"] == r["counters_own"], (family, label)


@pytest.mark.slow
@pytest.mark.parametrize("family", EVERY_STAGE)
def test_every_stage_on_the_family(family_dirs, family, tmp_path):
    """The smoke test of every stage, component and decoding method (experiment=tiny) on the family: every output
    exact; tree methods named as not run on recurrent targets; the export's taps, mask id and vocabulary those of the
    text decoder. On a family vLLM serves, the served eval and its parity gate too."""
    import json

    from test_served import vllm_missing

    served = family in SERVED
    if served and vllm_missing():
        pytest.skip(vllm_missing())
    run = tmp_path / "run"
    results = family_run(family_dirs, family, run, *(SERVE if served else []))
    for method, per in results["methods"].items():
        for ds, r in per.items():
            assert r["exact"] is True and r["mismatches"] == [], (family, method, ds)
    trees = {m for m in results["methods"] | results["not_run"] if "tree" in m}
    assert trees  # ddtree_* and weaver_tree_*: run, or named as not run
    if family in RECURRENT:
        assert set(results["not_run"]) == trees and all("per branch" in why for why in results["not_run"].values())
    else:
        assert not results["not_run"]
    export = json.loads((run / "train" / "export" / "config.json").read_text())
    manifest = json.loads((run / "teacher" / "manifest.json").read_text())
    assert export["dflash_config"]["target_layer_ids"] == manifest["layer_ids"] == [1, 3]
    assert export["num_target_layers"] == 6 and export["target_hidden_size"] == 64
    assert export["vocab_size"] == 49152 and 0 <= export["dflash_config"]["mask_token_id"] < 49152
    assert export["architectures"] == ["DFlashDraftModel" if served else "DFlash2DraftModel"]
    if served:
        assert_served_at_parity(results, family)


def test_rollback_is_a_decode_setting():
    """target.rollback changes how the eval decodes a recurrent target, not the teacher data or the weights: it
    re-runs the eval only; an unknown strategy is refused."""
    from dflash_pipeline.eval.stage import eval_hash
    from dflash_pipeline.runtime.stages import config_hash

    base, replay = make_config(), make_config("target.rollback=replay")
    assert config_hash(base, "teacher") == config_hash(replay, "teacher")
    assert config_hash(base, "train") == config_hash(replay, "train")
    assert eval_hash(base) != eval_hash(replay)
    with pytest.raises(target_cache.CacheError, match="unknown rollback"):
        target_cache.Rollback(torch.nn.Linear(1, 1), "snapshot")


def test_a_dead_engine_names_its_root_cause(tmp_path):
    """vLLM reports a failed worker as a generic EngineDeadError after the real exception: the error names the first
    exception of this run's part of the log (earlier runs' lines are skipped)."""
    from dflash_pipeline.models.vllm_engine import root_cause

    log = tmp_path / "engine.log"
    log.write_text("ERROR old run: ValueError: something from before\n")
    start = log.stat().st_size
    with open(log, "a") as f:
        f.write("INFO loading\n(Worker) ERROR [x.py:1] AssertionError: CPU GDN attention requires BF16.\n"
                "(EngineCore) ERROR RuntimeError: Worker failed with error 'CPU GDN ...'\n"
                "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n")
    assert root_cause(log, start) == "AssertionError: CPU GDN attention requires BF16."
    assert root_cause(log) == "ValueError: something from before"


@pytest.mark.parametrize("family", ["gemma2", "gemma4", "granite4_hybrid", "falcon_h1"])
def test_stored_logprobs_are_the_targets_own_distribution(family_dirs, family):
    """The teacher's top-k log-probs come from the logits the target's forward returns, output transforms included
    (soft-capping, logit scaling, LM-head multipliers): the distribution a KL loss and sampled acceptance rely on."""
    from dflash_pipeline.models.generation import topk_logprobs

    _, target = family_target(family_dirs, family)
    seq = chat_prompt_ids(target.tokenizer, TEXTS[:1])[0]
    out = target.model(input_ids=torch.tensor([seq]), output_hidden_states=True)
    stored = topk_logprobs(target.model, out.hidden_states[-1][0], 4)
    expect = torch.log_softmax(out.logits[0, :-1].float(), -1).topk(4, -1)
    torch.testing.assert_close(stored["topk_logprobs"][1:], expect.values, atol=1e-4, rtol=1e-4)
    assert torch.equal(stored["topk_ids"][1:], expect.indices)


def test_a_family_whose_cache_is_not_handled_is_refused_at_load(tmp_path):
    """DeepSeek-V3.2's indexer cache is a layer kind models/cache.py does not handle: loading it as a target stops
    with one line naming the architecture and the layer, before any stage runs."""
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    config = DeepseekV32Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, vocab_size=49152,
                               intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
                               num_experts_per_tok=2, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
                               qk_nope_head_dim=16, v_head_dim=16, n_group=1, topk_group=1, first_k_dense_replace=1,
                               tie_word_embeddings=True)
    DeepseekV32ForCausalLM(config).save_pretrained(tmp_path / "v32")
    tiny_target.AutoTokenizer.from_pretrained(tiny_target.smollm2_tokenizer()).save_pretrained(tmp_path / "v32")
    cfg = make_config("target=hf", f"target.path={tmp_path / 'v32'}")
    with pytest.raises(TargetError, match="DeepseekV32ForCausalLM: its cache layers DynamicIndexedLayer are not handled"):
        load_target(cfg.target, cfg.cache_dir)


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in SERVED if f not in EVERY_STAGE])
def test_served_eval_and_gate_on_the_family(family_dirs, family, tmp_path):
    """Where vLLM's CPU build serves a family as the drafter's target, the served eval runs on it and the parity gate
    passes (gemma4: test_every_stage_on_the_family)."""
    from test_served import vllm_missing

    if vllm_missing():
        pytest.skip(vllm_missing())
    results = family_run(family_dirs, family, tmp_path / "run", "eval.methods=[chain]", "pipeline.components=[]",
                         *SERVE)
    assert_served_at_parity(results, family)


def test_tap_spacing_on_shallow_targets_picks_distinct_layers():
    """The DFlash spacing needs L >= taps + 3; a shallower target gets its taps spread over every layer instead of a
    repeated layer (which the teacher refuses)."""
    from dflash_pipeline.models.families import default_layer_ids, resolve_layer_ids

    assert default_layer_ids(4, 2) == resolve_layer_ids(None, 2, 4) == [0, 3]
    assert default_layer_ids(3, 3) == [0, 1, 2] and default_layer_ids(2, 2) == [0, 1]
    assert default_layer_ids(30, 5) == [1, 8, 14, 20, 27]  # deep enough: the DFlash spacing, unchanged


def test_trees_are_refused_on_layer_types_without_a_tree_mask(family_dirs):
    """A layer type tree_masks builds no mask for (chunked attention, as in Llama 4) stops a tree method before any
    decoding instead of verifying the tree under the wrong mask."""
    cfg, target = family_target(family_dirs, "qwen3")
    drafter = DFlashDrafter(drafter_config(cfg, target, [1, 3]), target.model.get_input_embeddings(),
                            target.model.get_output_embeddings()).eval()
    check_target(DDTreeMethod(drafter, 4), target.model)  # full attention only: fine
    target.model.config.layer_types = ["full_attention", "chunked_attention"] * 3
    with pytest.raises(ValueError, match="has chunked_attention layers: use a chain method"):
        check_target(DDTreeMethod(drafter, 4), target.model)

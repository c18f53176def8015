"""Exactness at every precision: identical, near-tie or wrong against the autoregressive reference
(eval/exactness.py), and the target's dtype as a per-machine choice (models/precision.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_pipeline.eval import decode
from dflash_pipeline.eval.decode import autoregressive
from dflash_pipeline.eval.exactness import IDENTICAL, NEAR_TIE, WRONG, ExactnessError, ExactnessJudge, \
    Verdict, first_mismatch, rounds_before
from dflash_pipeline.eval.online import baseline_models, run_online
from dflash_pipeline.models.precision import machine, resolve_dtype
from dflash_pipeline.models.target import load_target

from conftest import chat_prompt_ids, make_config


@pytest.fixture(scope="module")
def bf16_target():
    cfg = make_config("target.dtype=bfloat16")
    return load_target(cfg.target, cfg.cache_dir)


@pytest.fixture(scope="module")
def prompt(bf16_target):
    return chat_prompt_ids(bf16_target.tokenizer, ["Name three colours of the rainbow."])[0]


def float32_logprobs(model, prefix: list[int]) -> torch.Tensor:
    """The target's log-probs after `prefix`, computed on a float32 copy."""
    import copy

    with torch.no_grad():
        logits = copy.deepcopy(model).float()(input_ids=torch.tensor([prefix])).logits[0, -1]
    return torch.log_softmax(logits, -1)


def test_first_mismatch_and_rounds_before():
    assert first_mismatch([1, 2, 3], [1, 2, 3]) is None
    assert first_mismatch([1, 2, 3], [1, 5, 3]) == 1
    assert first_mismatch([1, 2, 3], [1, 2]) == 2
    # output 0 is the prefill's token; rounds commit 3, 1, 2 tokens: positions 1-3, 4, 5-6
    assert rounds_before([2, 0, 1], None) == [2, 0, 1]
    assert rounds_before([2, 0, 1], 5) == [2, 0]  # the round that committed position 5 is not verified
    assert rounds_before([2, 0, 1], 4) == [2]
    assert rounds_before([2, 0, 1], 1) == []


def test_a_forced_near_tie_is_classified_with_its_gap(bf16_target, prompt):
    """A divergence to the float32 runner-up is a near-tie exactly when its gap is inside the tolerance."""
    reference, _ = autoregressive(bf16_target, prompt, 12)
    pos = 5
    logp = float32_logprobs(bf16_target.model, prompt + reference[:pos])
    first, second = logp.topk(2).indices.tolist()
    other_tok = second if reference[pos] == first else first
    gap = abs(float(logp[reference[pos]] - logp[other_tok]))
    other = reference[:pos] + [other_tok] + reference[pos + 1:]
    near = ExactnessJudge(bf16_target.model, tolerance=gap + 0.01).classify(prompt, reference, other)
    assert near.kind == NEAR_TIE and near.position == pos
    assert near.detail["logprob_gap"] == pytest.approx(gap, abs=1e-5)
    assert near.detail["reference_token"] == reference[pos] and near.detail["other_token"] == other_tok
    strict = ExactnessJudge(bf16_target.model, tolerance=gap / 2)
    assert strict.classify(prompt, reference, other).kind == WRONG
    with pytest.raises(ExactnessError, match=r"at output position 5 .* near-tie tolerance"):
        strict.check("p0", prompt, reference, other, "speculative decoding")
    assert strict.classify(prompt, reference, list(reference)).kind == IDENTICAL
    assert strict.classify(prompt, reference, reference[:-1]).kind == WRONG  # a length difference is never a tie


def test_float32_keeps_the_strict_check(target, prompt):
    """In float32 any divergence is wrong, however close the two tokens are."""
    reference, _ = autoregressive(target, prompt, 8)
    other = reference[:3] + [(reference[3] + 1) % 100] + reference[4:]
    verdict = ExactnessJudge(target.model, tolerance=1e9).classify(prompt, reference, other)
    assert verdict.kind == WRONG and "logprob_gap" not in verdict.detail


def test_a_planted_wrong_acceptance_fails_in_bf16(bf16_target, prompt, monkeypatch):
    """A verifier that accepts a token the target does not pick (argmax + 1 forced) is an error in bf16 too: the
    float32 gap between the two is far beyond any near-tie."""
    from dflash_pipeline.models.drafter import DFlashDrafter, DFlashDrafterConfig

    c = bf16_target.model.config
    conf = DFlashDrafterConfig(
        hidden_size=c.hidden_size, intermediate_size=2 * c.hidden_size, num_hidden_layers=1,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=c.max_position_embeddings, vocab_size=c.vocab_size, block_size=4,
        target_hidden_size=c.hidden_size, target_layer_ids=[1, 3], num_target_layers=c.num_hidden_layers,
        mask_token_id=16)
    torch.manual_seed(0)
    model = bf16_target.model
    drafter = DFlashDrafter(conf, model.get_input_embeddings(), model.get_output_embeddings()).to(torch.bfloat16)
    method = decode.ChainMethod(drafter.eval())
    batch = [{"id": "p0", "prompt_ids": prompt}]
    judge = ExactnessJudge(bf16_target.model, 0.5)
    honest = run_online(bf16_target, method, batch, label="t", block_size=4, max_new_tokens=12, judge=judge,
                        baselines=baseline_models(bf16_target, ["float32", "bfloat16"], judge)).figures
    assert honest["exact"] is True and honest["target_dtype"] == "bfloat16"
    ms = honest["ms_per_token_ar_by_dtype"]  # the baseline: the faster of float32 and bf16 plain decoding
    assert set(ms) == {"float32", "bfloat16"} and honest["fastest_ar_dtype"] == min(ms, key=ms.get)
    assert honest["speedup_vs_fastest_ar"] == pytest.approx(min(ms.values()) / honest["ms_per_token_spec"])
    assert honest["outputs_compared"] == 3 and honest["near_tie_outputs"] == len(honest["near_ties"])
    real = decode.target_forward

    def corrupt(model, ids, positions, cache, layer_ids, last_only=False):
        step = real(model, ids, positions, cache, layer_ids, last_only)
        if last_only:
            return step
        logits = step.logits.clone()
        logits[torch.arange(len(logits)), (logits.argmax(-1) + 1) % logits.shape[-1]] = 1e4
        return step._replace(logits=logits)

    monkeypatch.setattr(decode, "target_forward", corrupt)
    with pytest.raises(ExactnessError, match=r"prompt p0: speculative decoding differs .* log-prob gap"):
        run_online(bf16_target, method, batch, label="t", block_size=4, max_new_tokens=12)


def test_acceptance_counts_every_round_and_the_rounds_before_a_near_tie_beside(target, prompt):
    """After a near-tie divergence the speculative run stays exact against its own verification: the headline
    acceptance counts every round it made, and the rounds before the divergence are reported beside it."""
    from dflash_pipeline.models.drafter import DFlashDrafter

    drafter = DFlashDrafter.from_pretrained(str(Path(__file__).parent / "fixtures" / "tiny_drafter"),
                                            target.model.get_input_embeddings(), target.model.get_output_embeddings())
    method = decode.ChainMethod(drafter.eval())
    batch = [{"id": "p0", "prompt_ids": prompt}]
    exact = run_online(target, method, batch, label="t", block_size=drafter.config.block_size, max_new_tokens=24)
    every = exact.spec_rounds[0]
    assert exact.figures["identical"] and len(every) > 4
    assert exact.figures["rounds"] == exact.figures["rounds_verified_prefix"] == len(every)
    tau = (sum(every) + len(every)) / len(every)
    assert exact.figures["tau_online"] == exact.figures["tau_online_verified_prefix"] == pytest.approx(tau)

    class ForcedNearTie:  # the first speculative run parts from the reference at output position 7
        def check(self, prompt_id, prompt_ids, reference, other, what, strict=True):
            if what == "speculative decoding":
                return Verdict(NEAR_TIE, 7, {"logprob_gap": 0.01})
            return Verdict(IDENTICAL)

    tied = run_online(target, method, batch, label="t", block_size=drafter.config.block_size, max_new_tokens=24,
                      judge=ForcedNearTie())
    every, before = tied.spec_rounds[0], rounds_before(tied.spec_rounds[0], 7)
    assert tied.figures["near_tie_outputs"] == 1 and tied.figures["exact"] and not tied.figures["identical"]
    assert tied.figures["rounds"] == len(every) > tied.figures["rounds_verified_prefix"] == len(before) > 0
    assert tied.figures["tau_online"] == pytest.approx((sum(every) + len(every)) / len(every))
    assert tied.figures["tau_online_verified_prefix"] == pytest.approx((sum(before) + len(before)) / len(before))


def test_dtype_choice_is_recorded_and_auto_is_measured():
    assert resolve_dtype("bfloat16") == ("bfloat16", {"requested": "bfloat16"})
    name, why = resolve_dtype("auto", "cpu")
    assert why["requested"] == "auto" and why["bf16_over_float32_matmul"] > 0
    assert name == ("bfloat16" if why["bf16_over_float32_matmul"] <= why["threshold"] else "float32")
    info = machine()
    assert info["cpu"] and isinstance(info["cpu_flags"], list) and info["torch_cpu_capability"]
    cfg = make_config("target.dtype=auto")
    t = load_target(cfg.target, cfg.cache_dir)
    assert t.dtype == name and t.numerics["dtype"] == name and t.numerics["machine"] == info


@pytest.mark.slow
def test_tiny_pipeline_in_bf16_reports_numerics_and_near_ties(tmp_path):
    """teacher -> drafter -> eval with a bf16 target: exact up to near-ties, counts and the numerics recorded, the
    speedup also against the fastest plain decoding of either dtype."""
    import json

    from dflash_pipeline.cli.entrypoints import run_stages

    cfg = make_config("target.dtype=bfloat16", "pipeline.components=[]", "eval.methods=[chain,ddtree]",
                      "eval.tree_budgets=[4]", "eval.datasets=[mtbench]", "eval.turns=1")
    out = run_stages(cfg, tmp_path, ["teacher", "train", "eval"])
    assert json.loads((out["teacher"] / "manifest.json").read_text())["target"]["dtype"] == "bfloat16"
    results = json.loads((out["eval"] / "eval_results.json").read_text())
    num = results["numerics"]
    assert num["dtype"] == num["teacher_dtype"] == "bfloat16" and num["same_as_teacher"]
    assert num["near_tie_tolerance"] == 0.5 and num["machine"]["cpu"]
    for method in ("chain", "ddtree_4"):
        r = results["methods"][method]["mtbench"]
        assert r["exact"] is True and r["target_dtype"] == "bfloat16" and r["outputs_compared"] == 3
        assert r["near_tie_outputs"] == len(r["near_ties"]) and all(n["logprob_gap"] < 0.5 for n in r["near_ties"])
        assert set(r["ms_per_token_ar_by_dtype"]) == {"float32", "bfloat16"}
    assert "Target numerics: bfloat16" in (out["eval"] / "results.md").read_text()

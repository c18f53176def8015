"""Decoding policies (eval/policies.py): exact against greedy decoding, reproducible Boltzmann draws, ACT at
threshold 0 is the plain drafter, MOBS without transitions is the per-position argmax, the adaptive policy stops
drafting when drafting does not pay, calibration stays on its grid and away from the eval prompts, and bad settings
fail with one line."""
from __future__ import annotations

import itertools

import pytest
import torch
from omegaconf import OmegaConf

from dflash_pipeline.conf.schema import ConfigError, PolicyConfig, check_config
from dflash_pipeline.eval.decode import autoregressive, speculative
from dflash_pipeline.eval.protocol import NOT_VERIFIED, ChainMethod
from dflash_pipeline.eval.policies import (ActMethod, AdaptiveMethod, BoltzmannMethod, EvalContext, MiddleOutMethod,
                                           best_length, boltzmann_scores, gated_length, measure_costs, middle_out)
from dflash_pipeline.models.drafter import DFlashDrafter
from dflash_pipeline.models.selector import PairSelector
from dflash_pipeline.train.drafter import drafter_config
from tests.conftest import chat_prompt_ids, make_config

TEXTS = ["Write a haiku about the sea.", "What is 12 times 7?"]


@pytest.fixture(scope="module")
def prompt_ids(target):
    return chat_prompt_ids(target.tokenizer, TEXTS)


@pytest.fixture(scope="module")
def drafter(target):
    """An untrained drafter on the tiny target (block 4)."""
    torch.manual_seed(0)
    m = target.model
    return DFlashDrafter(drafter_config(make_config(), target, [1, 3]), m.get_input_embeddings(),
                         m.get_output_embeddings()).eval()


def policy(**overrides):
    return OmegaConf.merge(OmegaConf.structured(PolicyConfig), overrides)


def random_selector(drafter, top_k=4, seed=0) -> PairSelector:
    """A selector with strong random pair scores: its paths leave the argmax often."""
    torch.manual_seed(seed)
    c = drafter.config
    sel = PairSelector(c.vocab_size, c.hidden_size, rank=8, top_k=top_k)
    with torch.no_grad():
        sel.successor_codebook.normal_(0, 3.0)
    return sel.eval()


def context(drafter):
    B = drafter.config.block_size
    return EvalContext([1.0 + 0.1 * n for n in range(B)], 0.2, 1e-3, B, [])


def methods(drafter):
    sel = random_selector(drafter)
    return [
        BoltzmannMethod(drafter, policy(temperature=2.0)),  # hot: draws leave the argmax
        ActMethod(drafter, policy(threshold=0.5)),
        AdaptiveMethod(drafter, policy()),
        MiddleOutMethod(drafter, sel, policy(refine=1)),
        MiddleOutMethod(drafter, sel, policy(temperature=2.0), boltzmann=True),
    ]


@pytest.mark.slow
def test_every_policy_is_exact_against_greedy_decoding(target, drafter, prompt_ids):
    ctx = context(drafter)
    for method in methods(drafter):
        method.prepare(ctx)
        for ids in prompt_ids:
            ar, _ = autoregressive(target, ids, 24)
            res = speculative(target, method, ids, 24)
            assert res.tokens == ar, method.name
            assert all(0 <= n <= v <= drafter.config.block_size - 1 for n, v in zip(res.accepted, res.verified))


def test_boltzmann_draws_are_reproducible_and_follow_the_context():
    torch.manual_seed(1)
    U = torch.randn(5, 3, 8).sort(-1, descending=True).values
    cand = torch.randint(0, 1000, (5, 3, 8))
    ctx = torch.randint(0, 1000, (5, 8))
    first = boltzmann_scores(U, cand, ctx, 0.35)
    torch.manual_seed(2)  # no RNG state is involved
    assert torch.equal(first, boltzmann_scores(U, cand, ctx, 0.35))
    other = ctx.clone()
    other[:, 0] += 1  # a different (older) context token: different draws
    assert not torch.allclose(boltzmann_scores(U, cand, other, 0.35), first)
    # the Gumbel values are Gumbel(0, 1): mean ~ 0.577 over many draws
    big = torch.zeros(4000, 1, 2)
    g = boltzmann_scores(big, torch.arange(8000).view(4000, 1, 2), torch.arange(4000)[:, None], 1.0)
    assert abs(float(g.mean()) - 0.5772) < 0.05


def test_boltzmann_is_cold_where_the_drafter_is_sure():
    """T_i = max(T exp(-m), 0.02 T): a large margin makes the argmax win whatever the noise."""
    U = torch.tensor([[[30.0, 0.0, -1.0]]])
    cand = torch.tensor([[[5, 6, 7]]])
    for seed_ctx in range(50):
        s = boltzmann_scores(U, cand, torch.tensor([[seed_ctx]]), 0.35)
        assert int(s.argmax(-1)) == 0


def test_act_at_threshold_zero_is_the_plain_drafter_round_for_round(target, drafter, prompt_ids):
    chain, act = ChainMethod(drafter), ActMethod(drafter, policy(threshold=0.0))
    for ids in prompt_ids:
        a, b = speculative(target, chain, ids, 24), speculative(target, act, ids, 24)
        assert a.tokens == b.tokens and a.accepted == b.accepted and a.verified == b.verified


def test_act_verifies_the_leading_sure_positions():
    U = torch.tensor([[[3.0, 1.0], [2.0, 1.8], [5.0, 0.0]]])  # margins 2.0, 0.2, 5.0
    assert gated_length(U, 0.0).tolist() == [3]
    assert gated_length(U, 1.0).tolist() == [1]  # stops at the first unsure position
    assert gated_length(U, 2.5).tolist() == [0]
    with pytest.raises(ValueError, match="threshold must be >= 0"):
        gated_length(U, -1.0)


def test_mobs_without_transitions_is_the_argmax_and_costs_pk(drafter):
    c = drafter.config
    sel = PairSelector(c.vocab_size, c.hidden_size, rank=8, top_k=4)  # zero successor codebook: no pair term
    N, P, K = 6, 4, 4
    U = torch.randn(N, P, K).sort(-1, descending=True).values
    cand = torch.randint(0, c.vocab_size, (N, P, K))
    ids, scorings = middle_out(sel, cand, U, torch.randn(N, P, c.hidden_size), torch.zeros(N, dtype=torch.long))
    assert torch.equal(ids, cand[..., 0]) and scorings == P * K


def test_mobs_fills_from_a_centre_pick():
    """With a pair term that only rewards one (predecessor, successor) pair, the walk from the centre follows it
    both ways: right through S(prev, b), left through T(a, next)."""
    V, P, K = 10, 3, 3
    sel = PairSelector(V, 4, rank=V, top_k=K)
    # transition(a, b) = <A[a] * W h, B[b]> = B[b, a] with A = I and W h = 1: +5 for the pairs a -> b of `follows`
    follows = [(0, 4), (4, 7), (1, 7), (7, 2)]
    with torch.no_grad():
        sel.predecessor_codebook.copy_(torch.eye(V))
        sel.successor_codebook.zero_()
        for a, b in follows:
            sel.successor_codebook[b, a] = 5.0
        sel.hidden_projection.weight.zero_()
        sel.hidden_projection.weight[:, 0] = 1.0
    hidden = torch.zeros(1, P, 4)
    hidden[..., 0] = 1.0
    cand = torch.tensor([[[1, 4, 3], [5, 6, 7], [8, 2, 1]]])  # argmax path 1, 5, 8; the pairs lead 0 -> 4 -> 7 -> 2
    U = torch.tensor([[[1.0, 0.9, 0.0], [1.0, 0.9, 0.8], [1.0, 0.9, 0.0]]])
    ids, _ = middle_out(sel, cand, U, hidden, torch.tensor([0]))
    # centre (position 2 of 3) from its left neighbour's argmax 1: 7; right: 7 -> 2; left: 4 (0 -> 4 and 4 -> 7 beat
    # the argmax 1, which only has 1 -> 7)
    assert ids.tolist() == [[4, 7, 2]]


def test_adaptive_stops_drafting_when_it_does_not_pay(target, drafter, prompt_ids):
    """A drafter that never matches, and verification that costs more than it can return: after its prior fades,
    the policy runs plain target steps and only probes every probe_every rounds; outputs stay exact."""
    B = drafter.config.block_size
    ctx = EvalContext([1.0 + 0.5 * n for n in range(B)], 0.3, 1e-3, B, [])
    method = AdaptiveMethod(drafter, policy(probe_every=4))
    method.prepare(ctx)
    method.prior = [0.0] * (B - 1)
    for ids in prompt_ids:
        res = speculative(target, method, ids, 32)
        assert res.tokens == autoregressive(target, ids, 32)[0]
        assert sum(res.drafted) <= len(res.drafted) / 4 + 1
        assert all(v == 0 for v, d in zip(res.verified, res.drafted) if not d)
    fixed = AdaptiveMethod(drafter, policy(adaptive=False))  # the switch: always the full block
    fixed.prepare(ctx)
    res = speculative(target, fixed, prompt_ids[0], 16)
    assert all(res.drafted) and set(res.verified) == {B - 1}


def test_best_length_trades_acceptance_against_cost():
    ctx = EvalContext([1.0, 1.1, 1.2, 1.3], 0.2, 1e-3, 4, [])
    assert best_length([0.0, 0.0, 0.0], ctx)[0] == 0  # nothing accepted: no draft
    assert best_length([1.0, 1.0, 1.0], ctx)[0] == 3  # everything accepted: the whole block
    v, ratio = best_length([0.9, 0.1, 0.1], ctx)
    assert v == 1 and ratio == pytest.approx(1.9 / 1.3)
    for acc in itertools.product([0.0, 0.3, 0.9], repeat=3):  # the choice is the brute-force best
        v, ratio = best_length(list(acc), ctx)
        options = [1.0] + [(1 + sum(torch.tensor(acc[:k]).cumprod(0).tolist())) / (ctx.verify_cost[k] + 0.2)
                           for k in range(1, 4)]
        assert ratio == pytest.approx(max(options))


def test_measured_cost_curve_has_one_entry_per_length(target, drafter, prompt_ids):
    costs = measure_costs(target, drafter, prompt_ids[0], drafter.config.block_size, repeats=2)
    assert len(costs["verify_cost"]) == drafter.config.block_size and costs["verify_cost"][0] == 1.0
    assert costs["draft_cost"] > 0 and costs["step_ms"] > 0 and costs["ar_step_cost"] > 0
    assert costs["context_tokens"] == len(prompt_ids[0])


def test_calibration_picks_from_the_grid(target, drafter, tiny_teacher):
    from dflash_pipeline.data.shards import TeacherDataset
    from dflash_pipeline.models.generation import recapture

    items = [TeacherDataset(tiny_teacher)[i] for i in range(3)]
    recapture(target.model, items, list(drafter.config.target_layer_ids), pad_id=target.tokenizer.pad_token_id)
    ctx = EvalContext([1.0, 1.05, 1.1, 1.15], 0.2, 1e-3, drafter.config.block_size, items)
    b = BoltzmannMethod(drafter, policy(temperatures=[0.05, 3.0]))
    chosen = b.prepare(ctx)
    assert chosen["calibrated"] and chosen["temperature"] in (0.05, 3.0) and set(chosen["grid_tau_offline"]) == \
        {"0.05", "3.0"}
    act = ActMethod(drafter, policy(thresholds=[0.0, 100.0]))
    chosen = act.prepare(ctx)
    assert chosen["threshold"] in (0.0, 100.0) and set(chosen["grid_predicted_speedup"]) == {"0.0", "100.0"}
    assert ActMethod(drafter, policy(threshold=1.0)).prepare(ctx) == {"threshold": 1.0, "calibrated": False}


def test_act_paths_mark_the_unverified_tail():
    class D:  # only what ActMethod.path touches
        config = type("C", (), {"target_layer_ids": [1], "block_size": 4})()

    act = ActMethod(D(), policy(threshold=1.0))
    U = torch.tensor([[[3.0, 1.0], [2.0, 1.8], [5.0, 0.0]]])
    ids = torch.tensor([[[7, 8], [9, 10], [11, 12]]])
    drafts, _ = act.path(ids, U, None, torch.tensor([0]))
    assert drafts.tolist() == [[7, NOT_VERIFIED, NOT_VERIFIED]]


@pytest.mark.parametrize("override, message", [
    ("eval.policy.temperature=-0.1", "eval.policy.temperature=-0.1 is out of range: must be > 0"),
    ("eval.policy.thresholds=[0,-1]", "eval.policy.thresholds=[0.0, -1.0] is out of range: must be >= 0"),
    ("eval.policy.probe_every=0", "eval.policy.probe_every=0 is out of range: must be >= 1"),
])
def test_invalid_policy_settings_fail_with_one_line(override, message):
    with pytest.raises(ConfigError) as err:
        check_config(make_config(override))
    assert message in str(err.value) and "\n" not in str(err.value)

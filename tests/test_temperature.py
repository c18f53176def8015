"""Acceptance at temperature > 0 (eval/significance.py, eval/decode.py acceptance rules): the statistics the
served gate uses, on made-up decodes with known answers and on exact samplers of a small target."""
from __future__ import annotations

import random

import pytest
import torch

from dflash_pipeline.eval import significance
from dflash_pipeline.eval.decode import autoregressive, speculative

from tests.conftest import sampling_case


def decodes(rates: list[float], n: int, rounds: int, seed: int, cluster_sd: float = 0.0) -> list[dict]:
    """n made-up decodes of `rounds` rounds each, accepting at position k with probability rates[k] (times a
    per-decode factor of sd `cluster_sd`: decodes that accept more or less throughout)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        factor = max(0.0, rng.gauss(1.0, cluster_sd))
        per_pos = [0] * len(rates)
        for _ in range(rounds):
            for k, r in enumerate(rates):
                if rng.random() >= min(1.0, r * factor):
                    break
                per_pos[k] += 1
        out.append({"drafts": rounds, "accepted_per_pos": per_pos})
    return out


def test_equal_rates_pass_and_a_planted_position_is_named():
    own = decodes([0.4, 0.5, 0.5], 24, 40, seed=1)
    same = decodes([0.4, 0.5, 0.5], 24, 40, seed=2)
    assert significance.compare_positions(own, same, 3, 0.01)["differ"] == []
    planted = decodes([0.4, 0.15, 0.5], 24, 40, seed=3)  # position 2 accepts less
    test = significance.compare_positions(own, planted, 3, 0.01)
    assert test["differ"] == [2], test["tests"]


def test_clustered_decodes_widen_the_interval_beyond_the_binomial():
    """Rounds of one decode share a context: a decode-level spread makes rates vary more than independent rounds
    would, and the gate must not call that a difference."""
    flat = decodes([0.4], 24, 40, seed=4)
    clustered = decodes([0.4], 24, 40, seed=4, cluster_sd=0.6)
    se = lambda ds: significance.ratio(*significance._per_decode(ds, 0))[1]  # noqa: E731
    assert se(clustered) > 1.5 * se(flat)
    # two clustered samples of the same process: equal within noise at the family level
    misses = sum(bool(significance.compare_positions(decodes([0.4, 0.5], 24, 40, seed=10 + i, cluster_sd=0.6),
                                                     decodes([0.4, 0.5], 24, 40, seed=50 + i, cluster_sd=0.6),
                                                     2, 0.01)["differ"]) for i in range(20))
    assert misses <= 2


def test_intervals_hold_at_zero_and_report_no_trials():
    t = significance.rate_table([{"drafts": 50, "accepted_per_pos": [0, 0]}] * 3, 2)
    assert t["a_k"][0]["rate"] == 0.0 and 0.0 < t["a_k"][0]["high"] < 0.05  # Wilson: 0 of 150 is not [0, 0]
    assert t["a_k"][1]["rate"] is None  # position 2 never reached: no rate


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["sampled", "greedy_draft"])
def test_pit_is_uniform_for_exact_samplers_and_catches_a_biased_one(rule):
    """Speculative samples under either rule pass the distribution check against the target at their temperature;
    the same samples judged at another temperature (a sampler biased toward likely tokens) fail it."""
    V, T = 6, 1.0
    tgt, drafter, prompt, _, _ = sampling_case(V, T)
    gen, pit_gen = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)
    samples = [speculative(tgt, drafter, prompt, 4, 3, temperature=T, generator=gen, acceptance=rule).tokens
               for _ in range(300)]
    u = [x for s in samples for x in significance.pit_values(tgt.model, prompt, s, T, pit_gen)]
    assert significance.uniformity(u)["p"] > 1e-3
    hot = [x for s in samples for x in significance.pit_values(tgt.model, prompt, s, 2.0, pit_gen)]
    assert significance.uniformity(hot)["p"] < 1e-4
    ar = [autoregressive(tgt, prompt, 4, T, gen)[0] for _ in range(300)]
    assert significance.uniformity([x for s in ar for x in significance.pit_values(tgt.model, prompt, s, T,
                                                                                    pit_gen)])["p"] > 1e-3


def test_greedy_draft_rule_drafts_the_argmax(monkeypatch):
    """Under greedy_draft the method is asked for greedy drafts (temperature 0) even when sampling; under sampled
    it is asked at the sampling temperature. An unknown rule is refused in one line."""
    V, T = 6, 1.0
    tgt, drafter, prompt, _, _ = sampling_case(V, T)
    from dflash_pipeline.eval.protocol import ChainMethod

    seen = []
    original = ChainMethod.propose

    def spy(self, state, block_size, temperature=0.0, generator=None):
        seen.append(temperature)
        return original(self, state, block_size, temperature, generator)

    monkeypatch.setattr(ChainMethod, "propose", spy)
    speculative(tgt, drafter, prompt, 6, 3, temperature=T, generator=torch.Generator().manual_seed(0),
                acceptance="greedy_draft")
    assert seen and set(seen) == {0.0}
    seen.clear()
    speculative(tgt, drafter, prompt, 6, 3, temperature=T, generator=torch.Generator().manual_seed(0))
    assert seen and set(seen) == {T}
    with pytest.raises(ValueError, match="unknown acceptance rule 'typo'"):
        speculative(tgt, drafter, prompt, 6, 3, temperature=T, acceptance="typo")

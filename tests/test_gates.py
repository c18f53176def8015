"""The gates without an engine (eval/gates.py, eval/significance.py): a gate that received nothing to compare, an
engine that drafted nothing, a statistic without variance or without enough samples must each fail in one line,
never pass."""
from __future__ import annotations

import pytest

from dflash_pipeline.eval import gates, significance

# -- the own loop's counts -------------------------------------------------------------------------------------------
def test_own_counts_follow_the_engine_s_draft_budget():
    """Without a budget every round drafts the whole block; with one (llama.cpp: max_new_tokens) a round drafts at
    most (tokens still to generate) - 1, counted up to the first round the budget cuts short."""
    assert gates.own_counts([[3, 1, 3, 0]], 3) == {"drafts": 4, "accepted": 7, "accepted_per_pos": [3, 2, 2]}
    # budget 8: the prefill gives token 1; round 1 may draft min(3, 8 - 1 - 1) = 3 and accepts 3 (5 tokens);
    # round 2 may draft 8 - 5 - 1 = 2 and accepts 1 (7 tokens); round 3 may draft 0: not run
    assert gates.own_counts([[3, 1, 3, 0]], 3, budget=8) == {"drafts": 2, "accepted": 4, "accepted_per_pos": [2, 1, 1]}
    # budget 6: round 1 accepts 2 (4 tokens); round 2 may draft 1, the own loop accepted 3: counted as 1, then stop
    assert gates.own_counts([[2, 3, 1], [0]], 3, budget=6) == {"drafts": 3, "accepted": 3,
                                                                "accepted_per_pos": [2, 1, 0]}


# -- the statistics --------------------------------------------------------------------------------------------------
def decodes(per_pos: list[int], drafts: int = 10, n: int = 20) -> list[dict]:
    return [{"drafts": drafts, "accepted": sum(per_pos), "accepted_per_pos": list(per_pos)} for _ in range(n)]


def test_an_engine_without_drafts_differs_at_position_1():
    """Zero served drafts leave no position to test: that is a difference, not a pass."""
    test = significance.compare_positions(decodes([6, 3, 1]), decodes([0, 0, 0], drafts=0), 3, 0.01)
    assert test["differ"] == [1] and test["empty"] == ["served"]
    both = significance.compare_positions(decodes([0, 0, 0], drafts=0), decodes([0, 0, 0], drafts=0), 3, 0.01)
    assert both["empty"] == ["own", "served"]


def test_both_sides_accepting_everything_is_no_difference():
    """All drafts accepted on both sides: no variance at all, and no difference (z 0), never a division by zero."""
    test = significance.compare_positions(decodes([10, 10, 10]), decodes([10, 10, 10]), 3, 0.01)
    assert test["differ"] == [] and [t["z"] for t in test["tests"]] == [0.0, 0.0, 0.0]
    assert all(t["p"] == 1.0 for t in test["tests"])


ENGINE = {"version": "x", "checks": {}, "repaired": []}


def test_the_sampled_gate_fails_too_few_samples_naming_the_seeds():
    """Under 50 PIT values the distribution check cannot run: the gate fails, saying how many seeds would do."""
    few = {"n": 30, "needed": 50, "chi2": None, "p": None, "counts": [3] * 10}
    served = [{**d, "seed": seed} for seed in (0, 1, 2, None, None, None) for d in decodes([6, 3, 1], n=2)]
    v = gates.sampled_gate(decodes([6, 3, 1]), served, 3, 0.01, "greedy_draft", 0.7, few, ENGINE)  # 3 seeds
    assert not v["pass"] and "\n" not in v["line"]
    assert "too few samples for the distribution check: 30 PIT values from 3 seeds" in v["line"]
    assert "raise eval.served.seeds to 5" in v["line"]  # 10 a seed, 50 needed


def test_the_sampled_gate_fails_an_engine_that_drafted_nothing():
    """An engine serving without its drafter samples the target exactly (its distribution passes) and drafts
    nothing: the gate fails, naming that."""
    v = gates.sampled_gate(decodes([6, 3, 1]), decodes([0, 0, 0], drafts=0), 3, 0.01, "greedy_draft", 0.7,
                           {"n": 500, "p": 0.4}, ENGINE)
    assert not v["pass"] and "the engine drafted nothing" in v["line"] and "is the drafter loaded?" in v["line"]
    own_none = gates.sampled_gate(decodes([0, 0, 0], drafts=0), decodes([0, 0, 0], drafts=0), 3, 0.01,
                                  "greedy_draft", 0.7, {"n": 500, "p": 0.4}, ENGINE)
    assert not own_none["pass"] and "nothing to compare" in own_none["line"]


# -- the greedy gate -------------------------------------------------------------------------------------------------
OWN = {"drafts": 100, "accepted": 40, "accepted_per_pos": [30, 8, 2]}
NONE = {"drafts": 0, "accepted": 0, "accepted_per_pos": [0, 0, 0]}


@pytest.mark.parametrize("dtype", ["float32", "float32 in llama.cpp", "bfloat16"])
def test_the_greedy_gate_fails_an_engine_that_drafted_nothing(dtype):
    """Zero served drafts fail whatever the rule, named as such (float32's unequal counters alone blamed the taps)."""
    v = gates.gate(OWN, NONE, dtype, 0.02, True, {}, {})
    assert not v["pass"] and "\n" not in v["line"]
    assert v["line"].startswith("PARITY FAILED: the engine drafted nothing (0 drafts where the own loop drafted 100): "
                                "is the drafter loaded?")


@pytest.mark.parametrize("dtype", ["float32", "float32 in llama.cpp", "bfloat16"])
def test_a_gate_that_received_nothing_to_compare_fails(dtype):
    """No own rounds and no served drafts are equal counters and equal rates: still no pass."""
    v = gates.gate(NONE, NONE, dtype, 0.02, True, {}, {})
    assert not v["pass"] and "nothing to compare: the own loop ran no speculative round" in v["line"]


def test_an_engine_that_accepts_nothing_fails_within_the_tolerance():
    """Own loop 1 accepted of 100, the engine none: within 0.02 per position, yet no rounding explains accepting
    nothing; the line names it and the symptom, not a rerun in float32."""
    own = {"drafts": 100, "accepted": 1, "accepted_per_pos": [1, 0, 0]}
    served = {"drafts": 100, "accepted": 0, "accepted_per_pos": [0, 0, 0]}
    v = gates.gate(own, served, "float32 in llama.cpp", 0.02, True, {}, {})
    assert not v["pass"] and "the engine accepted none of its 100 drafts where the own loop accepted 1 of 100" in \
        v["line"]
    assert "dflash_config.target_layer_ids" in v["line"] and "rerun in float32" not in v["line"]


def test_no_failure_in_float32_advises_float32():
    """llama.cpp's float32 gate is the tolerance one; its failure points at a key, never at a rerun in float32."""
    far = {"drafts": 100, "accepted": 30, "accepted_per_pos": [22, 6, 2]}
    for dtype in ("float32", "float32 in llama.cpp"):
        line = gates.gate(OWN, far, dtype, 0.02, True, {}, {})["line"]
        assert line.startswith("PARITY FAILED") and "float32" not in line.split("likely contract key:")[1], line
    assert "rerun in float32" in gates.gate(OWN, far, "bfloat16", 0.02, True, {}, {})["line"]

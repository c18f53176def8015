"""The online metrics are pure functions of the passes (eval/online.py): checked here on made-up passes whose
figures are known by hand, without a model."""
from __future__ import annotations

import pytest

from dflash_pipeline.eval.decode import SpecResult
from dflash_pipeline.eval.online import Passes, acceptance_metrics, online_metrics, timing_metrics

B = 4  # block size: 3 drafts per round


def spec(accepted, tokens, total_s, prefill_s=0.0, draft_s=0.01, verify_s=0.03):
    n = len(accepted)
    return SpecResult(tokens=list(range(tokens)), accepted=list(accepted), verified=[B - 1] * n, drafted=[True] * n,
                      draft_s=[draft_s] * n, select_s=[0.0] * n, scorings=[0] * n, verify_s=[verify_s] * n,
                      prefill_s=prefill_s, total_s=total_s, target_forwards=n + 1)


def ar(tokens, total_s, decode_s):
    return list(range(tokens)), {"total_s": total_s, "decode_s": decode_s}


def passes(repeat, accepted, spec_s, ar_s, upto=None, other=None):
    """One prompt's passes: 8 output tokens; the spec runs take spec_s seconds, the AR runs ar_s."""
    p = Passes({"id": "p", "prompt_ids": [1]}, repeat, [ar(8, ar_s, ar_s * 7 / 8)] * 2,
               [spec(accepted, 8, spec_s), spec(accepted, 8, spec_s)], other or {})
    p.verified_upto = upto
    return p


def test_acceptance_counts_the_first_run_of_the_first_repeat():
    # rounds accepting 3, 1, 0 drafts: a_1 = 2/3 (two of three rounds kept draft 1), a_2 = 1/2, a_3 = 1/1
    first = [passes(0, [3, 1, 0], 1.0, 2.0)]
    m = acceptance_metrics(first, B)
    assert m["rounds"] == 3 and m["accepted_hist"] == [1, 1, 0, 1]
    assert m["a_k_online"] == pytest.approx([2 / 3, 0.5, 1.0])
    assert m["tau_online"] == pytest.approx((4 + 3) / 3)
    assert m["target_forwards_per_token"] == pytest.approx(4 / 8)
    assert m["tau_online"] == m["tau_online_verified_prefix"]  # nothing diverged


def test_a_near_tie_bounds_the_verified_prefix_not_the_headline():
    # diverged at output position 5: the rounds that committed tokens before it are the verified prefix
    first = [passes(0, [3, 1, 0, 2], 1.0, 2.0, upto=5)]
    m = acceptance_metrics(first, B)
    assert m["rounds"] == 4 and m["rounds_verified_prefix"] < 4
    assert m["tau_online"] == pytest.approx((6 + 4) / 4)


def test_times_are_medians_over_every_timed_run_and_speedups_their_ratios():
    runs = [passes(0, [3, 1], 1.0, 2.0), passes(1, [3, 1], 1.0, 4.0), passes(2, [3, 1], 1.0, 3.0)]
    t = timing_metrics(runs, "float32")
    assert t["ms_per_token_ar"] == pytest.approx(1e3 * 3.0 / 8)  # median of 2, 2, 4, 4, 3, 3 s over 8 tokens
    assert t["ms_per_token_spec"] == pytest.approx(1e3 * 1.0 / 8)
    assert t["speedup"] == pytest.approx(3.0) and t["timed_runs"] == 12
    assert t["draft_fraction"] == pytest.approx(0.25) and t["fastest_ar_dtype"] == "float32"


def test_the_fastest_dtype_is_the_baseline_a_user_compares_with():
    other = {"bfloat16": [(0.125, 0.1), (0.125, 0.1)]}  # 125 ms per token: faster than float32's 250
    t = timing_metrics([passes(0, [3], 1.0, 2.0, other=other)], "float32")
    assert t["fastest_ar_dtype"] == "bfloat16"
    assert t["speedup_vs_fastest_ar"] == pytest.approx(125 / 125)
    assert t["ms_per_token_ar_by_dtype"] == pytest.approx({"float32": 250.0, "bfloat16": 125.0})


def test_the_predicted_speedup_reads_the_cost_curve():
    class Costs:  # every round costs 2 autoregressive steps
        def round_cost(self, verified, drafted):
            return 2.0

    m = online_metrics([passes(0, [3, 1], 1.0, 2.0)], B, "float32", Costs())
    assert m["round_cost_predicted"] == 2.0
    assert m["predicted_speedup"] == pytest.approx((4 + 2) / 4)  # 6 tokens over 4 steps
    assert "predicted_speedup" not in online_metrics([passes(0, [3, 1], 1.0, 2.0)], B, "float32", None)

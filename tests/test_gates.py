"""The gates without an engine (eval/gates.py, eval/significance.py) and llama-server's counters as
models/llamacpp_engine.py reads them, against a stand-in HTTP server: a gate that received nothing to compare, an
engine that drafted nothing, a statistic without variance or without enough samples, a counter that is missing or
late must each fail in one line, never pass."""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflash_pipeline.eval import gates, significance
from dflash_pipeline.models import llamacpp_engine

# llama-server's /metrics (build 11434, `--metrics`) after 130 rounds of a block-4 drafter: its counters as HELP /
# TYPE / value lines, the per-position counter labelled by position (0-based), gauges between
METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 1710
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed.
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 192
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total 136
# HELP llamacpp:spec_decode_num_draft_tokens_total Speculative: Total draft tokens generated
# TYPE llamacpp:spec_decode_num_draft_tokens_total counter
llamacpp:spec_decode_num_draft_tokens_total 390
# HELP llamacpp:spec_decode_num_accepted_tokens_total Speculative: Total draft tokens accepted by the target model
# TYPE llamacpp:spec_decode_num_accepted_tokens_total counter
llamacpp:spec_decode_num_accepted_tokens_total 52
# HELP llamacpp:spec_decode_num_drafts_total Speculative: Total speculative decoding verification steps
# TYPE llamacpp:spec_decode_num_drafts_total counter
llamacpp:spec_decode_num_drafts_total 130
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 851.064
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 0
# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position
# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 22
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 16
llamacpp:spec_decode_num_accepted_tokens_per_pos_total{position="2"} 14
"""
PLAIN = "\n".join(line for line in METRICS.splitlines() if "spec_decode" not in line) + "\n"


class StandIn:
    """A local HTTP server answering as llama-server does: GET /metrics with `metrics(posted)` (posted: the
    completions served so far), POST /completion with `reply`."""

    def __init__(self, metrics, reply: dict):
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, body: bytes, kind: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):  # noqa: N802
                self._send(metrics(stand_in.posted).encode(), "text/plain; version=0.0.4")

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers["Content-Length"]))
                stand_in.posted += 1
                self._send(json.dumps(reply).encode(), "application/json")

            def log_message(self, *args):
                pass

        self.posted = 0
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def server(self, drafter: bool = True, block_size: int = 4) -> llamacpp_engine.LlamaServer:
        """A LlamaServer on this port, constructed without a process (nothing to start: __init__ is skipped)."""
        s = llamacpp_engine.LlamaServer.__new__(llamacpp_engine.LlamaServer)
        s.port, s.drafts_per_round, s.log_file, s._ready = self.http.server_address[1], block_size - 1, None, True
        s.drafter, s.counter_timeout = drafter, 0.3
        return s

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def stand_in():
    made = []

    def make(metrics, reply=None):
        made.append(StandIn(metrics, reply or {"tokens": [5, 6, 7], "timings": {}}))
        return made[-1]

    yield make
    for s in made:
        s.close()


# -- llama-server's /metrics -----------------------------------------------------------------------------------------
def test_llama_server_metrics_parse_into_the_counters(stand_in):
    """The recorded text gives the counters the gate reads: drafts (rounds), draft tokens, accepted, per position."""
    counts = stand_in(lambda _: METRICS).server().counters()
    assert counts == {"drafts": 130, "draft_tokens": 390, "accepted": 52, "accepted_per_pos": [22, 16, 14]}
    assert stand_in(lambda _: PLAIN).server(drafter=False).counters() == {
        "drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": [0, 0, 0]}  # no drafter: nothing drafted


def test_a_speculative_counter_missing_with_a_drafter_is_an_error_naming_it(stand_in):
    """A counter renamed by another build must not read as 0 (an engine that drafts nothing, or accepts nothing at a
    position): with a drafter loaded the reading fails naming the missing metrics."""
    renamed = METRICS.replace("spec_decode_num_drafts_total", "spec_decode_num_draft_steps_total")
    with pytest.raises(llamacpp_engine.LlamaCppError, match=r"lacks llamacpp:spec_decode_num_drafts_total with a "
                                                            r"drafter loaded"):
        stand_in(lambda _: renamed).server().counters()
    no_per_pos = "\n".join(line for line in METRICS.splitlines() if "per_pos" not in line)
    with pytest.raises(llamacpp_engine.LlamaCppError, match="lacks llamacpp:spec_decode_num_accepted_tokens_per_pos"):
        stand_in(lambda _: no_per_pos).server().counters()
    with pytest.raises(llamacpp_engine.LlamaCppError, match="spec_decode_num_draft_tokens_total"):
        stand_in(lambda _: PLAIN).server().counters()  # a drafter that did not load its counters


def test_a_request_s_counters_are_its_own_or_an_error(stand_in):
    """A request's counters are the difference of the scrapes around it, once /metrics has counted its reply's
    draft tokens; counters that do not arrive within the wait are an error (they would be booked to the next
    request), not a silent delta."""
    after = METRICS.replace("draft_tokens_total 390", "draft_tokens_total 396").replace(
        "drafts_total 130", "drafts_total 132").replace("accepted_tokens_total 52", "accepted_tokens_total 55").replace(
        'position="0"} 22', 'position="0"} 24').replace('position="1"} 16', 'position="1"} 17')
    reply = {"tokens": [5, 6, 7, 8, 9], "timings": {"draft_n": 6, "draft_n_accepted": 3}}
    counted = stand_in(lambda posted: after if posted else METRICS, reply).server()
    res = counted.generate([[1, 2, 3]], 5, [])
    assert res["outputs"] == [[5, 6, 7, 8, 9]]
    assert res["spec"] == [{"drafts": 2, "draft_tokens": 6, "accepted": 3, "accepted_per_pos": [2, 1, 0]}]
    late = stand_in(lambda _: METRICS, reply).server()  # the slot's counters never reach /metrics
    with pytest.raises(llamacpp_engine.LlamaCppError, match=r"counted 0 of a request's 6 draft tokens within 0.3 s .*"
                                                            r"next request"):
        late.generate([[1, 2, 3]], 5, [])


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

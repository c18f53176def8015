"""Evaluation: speculative decoding is exact (greedy) and distribution-preserving (sampling), the metrics match
hand-computed values, and the eval stage writes what it promises."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache

from dflash_pipeline.conf.schema import ConfigError
from dflash_pipeline.eval.stage import eval_hash
from dflash_pipeline.eval import decode
from dflash_pipeline.eval.decode import autoregressive, speculative
from dflash_pipeline.models.cache import crop as crop_cache
from dflash_pipeline.eval.metrics import accepted_length_stats, bootstrap_tau, conditional_acceptance, offline_metrics, \
    recall_at_k, simulated_tau
from dflash_pipeline.eval.exactness import ExactnessError
from dflash_pipeline.eval.costs import decode_context
from dflash_pipeline.eval.online import run_online
from dflash_pipeline.eval.stage import EvalError, run_eval
from dflash_pipeline.models.drafter import DFlashDrafter
from dflash_pipeline.models.generation import generate
from tests.conftest import Oracle, chi_square_p, make_config, sampling_case
from dflash_pipeline.train.drafter import drafter_config

TEXTS = ["Write a haiku about the sea.", "What is 12 times 7?", "List three prime numbers."]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Batch-1 decoding of tiny models is dominated by thread sync on a busy 2-core machine: use one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prompts(target):
    tok = target.tokenizer
    return [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=False)
            for t in TEXTS]


@pytest.fixture(scope="module")
def prompt_ids(target, prompts):
    return [target.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]


@pytest.fixture(scope="module")
def random_drafter(target):
    """An untrained drafter on the tiny target (block 4, taps [1, 3]): low acceptance."""
    torch.manual_seed(0)
    conf = drafter_config(make_config(), target, [1, 3])
    m = target.model
    return DFlashDrafter(conf, m.get_input_embeddings(), m.get_output_embeddings()).eval()


# -- greedy exactness --------------------------------------------------------------------------------------------
def test_autoregressive_equals_batched_generate(target, prompt_ids):
    tokens, t = autoregressive(target, prompt_ids[0], 12)
    ref = generate(target.model, [prompt_ids[0]], max_new_tokens=12, eos_ids=target.eos_ids,
                   pad_id=target.tokenizer.pad_token_id)[0]
    assert tokens == ref
    assert t["target_forwards"] == len(tokens) and t["total_s"] >= t["decode_s"] > 0


def test_crop_cache_keeps_length(target, prompt_ids):
    cache = DynamicCache()
    with torch.no_grad():
        target.model(input_ids=torch.tensor([prompt_ids[0]]), cache=cache, use_cache=True)
    n = len(prompt_ids[0])
    crop_cache(cache, n - 3)
    assert cache.get_seq_length() == n - 3
    crop_cache(cache, n)  # never grows
    assert cache.get_seq_length() == n - 3


@pytest.mark.parametrize("block", [2, 3, 4])
def test_speculative_equals_greedy_random_drafter(target, prompt_ids, random_drafter, block):
    for ids in prompt_ids:
        ar, _ = autoregressive(target, ids, 20)
        res = speculative(target, random_drafter, ids, 20, block)
        assert res.tokens == ar
        assert len(res.accepted) == len(res.draft_s) == len(res.verify_s) == res.target_forwards - 1
        assert all(0 <= n <= block - 1 for n in res.accepted)


def test_block_larger_than_trained_is_refused(target, prompt_ids, random_drafter):
    with pytest.raises(ValueError, match="block size 5"):
        speculative(target, random_drafter, prompt_ids[0], 8, 5)


def test_oracle_accepts_every_draft(target, prompt_ids):
    B, max_new = 4, 16
    cont, _ = autoregressive(target, prompt_ids[0], max_new + B)
    assert len(cont) == max_new + B, "the tiny target stopped early; pick another prompt"
    oracle = Oracle(cont, B, target.model.config.vocab_size)
    res = speculative(target, oracle, prompt_ids[0], max_new, B)
    assert res.tokens == cont[:max_new]
    rounds = -(-(max_new - 1) // B)  # the prefill gives 1 token, each round B
    assert res.accepted == [B - 1] * rounds
    assert res.tau == B
    assert res.target_forwards == 1 + rounds
    stats = accepted_length_stats(res.accepted, B)
    assert stats["a_k"] == [1.0] * (B - 1) and stats["tau"] == B


def test_partially_wrong_oracle_rolls_back_exactly(target, prompt_ids):
    """Corrupted drafts are rejected exactly where they start, and the cropped cache keeps the output exact."""
    B, max_new = 4, 24
    for seed, ids in enumerate(prompt_ids):
        cont, _ = autoregressive(target, ids, max_new + B)
        oracle = Oracle(cont, B, target.model.config.vocab_size, corrupt=0.3, seed=seed)
        res = speculative(target, oracle, ids, max_new, B)
        assert res.tokens == cont[:max_new]
        assert res.accepted == oracle.expected
        assert 0 < sum(res.accepted) < (B - 1) * len(res.accepted)


def test_eos_inside_accepted_drafts_ends_output(target, prompt_ids):
    cont, _ = autoregressive(target, prompt_ids[1], 24)
    stop = cont[6]  # pretend this token is an EOS: it sits inside an accepted block of the oracle
    early = SimpleNamespace(model=target.model, eos_ids={stop})
    ar, _ = autoregressive(early, prompt_ids[1], 24)
    assert ar == cont[: cont.index(stop) + 1]
    res = speculative(early, Oracle(cont, 4, target.model.config.vocab_size), prompt_ids[1], 24, 4)
    assert res.tokens == ar


# -- loud mismatch ----------------------------------------------------------------------------------------------
def test_mismatch_is_detected_loudly(target, prompt_ids, random_drafter, monkeypatch):
    """A verifier that picks a wrong token (argmax + 1) makes the stage raise, naming the prompt and position."""
    real = decode.target_forward

    def corrupt(model, ids, positions, cache, layer_ids, last_only=False):
        step = real(model, ids, positions, cache, layer_ids, last_only)
        if last_only:  # the prefill
            return step
        logits = step.logits.clone()  # a verify forward
        logits[torch.arange(len(logits)), (logits.argmax(-1) + 1) % logits.shape[-1]] = 1e4
        return step._replace(logits=logits)

    monkeypatch.setattr(decode, "target_forward", corrupt)
    batch = [{"id": "p0", "prompt_ids": prompt_ids[0]}]
    method = decode.ChainMethod(random_drafter)
    with pytest.raises(ExactnessError, match=r"prompt p0: speculative decoding differs .* output position \d+"):
        run_online(target, method, batch, label="t", block_size=4, max_new_tokens=12)
    res = run_online(target, method, batch, label="t", block_size=4, max_new_tokens=12, strict=False)
    assert res.figures["exact"] is False
    assert {m["run"] for m in res.figures["mismatches"]} == {"speculative decoding", "a repeated speculative run"}


@pytest.mark.parametrize("rule", ["sampled", "greedy_draft"])
def test_run_online_sampling(target, prompt_ids, random_drafter, rule):
    """The eval's online passes at temperature > 0 under either acceptance rule (eval.acceptance_rule): seeded,
    so a rerun gives the same outputs and rounds."""
    batch = [{"id": f"p{i}", "prompt_ids": ids} for i, ids in enumerate(prompt_ids[:2])]
    method = decode.ChainMethod(random_drafter)
    go = lambda: run_online(target, method, batch, label="s", block_size=3, max_new_tokens=8,  # noqa: E731
                            temperature=0.8, seed=1, acceptance=rule)
    res = go()
    assert res.figures["exact"] is None and res.figures["mismatches"] == []
    assert len(res.figures["a_k_online"]) == 2 and sum(res.figures["accepted_hist"]) == res.figures["rounds"] > 0
    again = go()
    assert again.ar_outputs == res.ar_outputs and again.figures["accepted_hist"] == res.figures["accepted_hist"]


# -- sampling preserves the target's distribution --------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("rule", ["sampled", "greedy_draft"])
def test_speculative_sampling_matches_target_distribution(rule):
    """The joint of the first 3 sampled tokens (vocab 6, 216 cells) against its exact value from the target,
    chi-square (cells with expectation < 5 pooled), under both acceptance rules (drafts sampled and kept with
    min(1, p/q); drafts greedy and kept with p(x), what vLLM does). A sampler that draws from p instead of the
    residual norm(max(0, p - q)) after a rejection fails this test (p < 1e-3 at these sizes)."""
    V, T, N = 6, 1.0, 2000
    tgt, drafter, prompt, p1, joint = sampling_case(V, T)

    for block in (2, 3):  # block 2: the bonus token enters the first 3; block 3: two chained acceptances
        gen = torch.Generator().manual_seed(block)
        counts = torch.zeros(V ** 3, dtype=torch.float64)
        accepted = []
        for _ in range(N):
            res = speculative(tgt, drafter, prompt, 3, block, temperature=T, generator=gen, acceptance=rule)
            a, b, c = res.tokens
            counts[(a * V + b) * V + c] += 1
            accepted += res.accepted
        hist = torch.bincount(torch.tensor(accepted), minlength=block).tolist()
        assert min(hist) > 0.1 * len(accepted), f"both rejections and acceptances must occur: {hist}"
        p_value = chi_square_p(counts, joint * N)
        assert p_value > 1e-3, f"block {block}: p = {p_value:.2g}"

    # the autoregressive sampler draws the first token from p1 too (same temperature handling)
    gen = torch.Generator().manual_seed(7)
    first = torch.bincount(torch.tensor([autoregressive(tgt, prompt, 1, T, gen)[0][0] for _ in range(500)]),
                           minlength=V).double()
    assert 0.5 * (first / 500 - p1).abs().sum() < 0.1


# -- metrics on hand-made cases ---------------------------------------------------------------------------------
def test_offline_metrics_hand_made():
    correct = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    valid = torch.ones(4, 3, dtype=torch.bool)
    a, counts = conditional_acceptance(correct, valid)
    assert a == pytest.approx([3 / 4, 2 / 3, 1 / 2]) and counts == [4, 3, 2]
    assert simulated_tau(a) == pytest.approx(1 + 0.75 + 0.5 + 0.25)
    valid[3, 2] = False  # no label: row 3 does not reach position 3
    a, counts = conditional_acceptance(correct, valid)
    assert a == pytest.approx([3 / 4, 2 / 3, 0.0]) and counts == [4, 3, 1]

    labels = torch.tensor([[5, 6], [5, 6], [7, 8]])
    top = torch.tensor([[[5, 1], [9, 6]],  # pos 1 top-1 right; pos 2 only in top-2
                        [[1, 5], [6, 2]],  # pos 1 only in top-2 -> pos 2 not reached
                        [[7, 2], [8, 3]]])  # both top-1 right
    rec = recall_at_k(top, labels, torch.ones(3, 2, dtype=torch.bool), [1, 2])
    assert rec[1] == pytest.approx([2 / 3, 1 / 2]) and rec[2] == pytest.approx([1.0, 1.0])

    stats = accepted_length_stats([0, 3, 1, 3], block_size=4)
    assert stats["accepted_hist"] == [1, 1, 0, 2]
    assert stats["tau"] == pytest.approx((0 + 3 + 1 + 3 + 4) / 4)
    assert stats["a_k"] == pytest.approx([3 / 4, 2 / 3, 1.0])


def test_bootstrap_interval_of_tau_over_prompts():
    """The interval holds the pooled tau, spans the prompts' own taus at most, narrows as prompts agree, and is a
    point for one prompt."""
    spread = [[0, 0, 0], [2, 2], [1, 0, 3, 1]]
    lo, hi = bootstrap_tau(spread)
    tau = (sum(map(sum, spread)) + 9) / 9
    assert 1.0 <= lo < tau < hi <= 3.0
    same = bootstrap_tau([[1, 0, 2]] * 3)
    assert same[0] == pytest.approx(same[1]) == pytest.approx(2.0)
    many = bootstrap_tau(spread * 10)
    assert many[1] - many[0] < hi - lo
    assert bootstrap_tau([[3, 1]]) == [3.0, 3.0]


def test_bootstrap_interval_covers_the_true_tau_on_synthetic_prompts():
    """Prompts whose rounds accept Binomial(3, p) drafts with p drawn per prompt (rounds of a prompt are alike): the
    95% interval over 20 prompts covers the true tau 1 + 3 E[p] in about 95% of 100 synthetic evals."""
    gen = torch.Generator().manual_seed(0)
    covered = 0
    for trial in range(100):
        p = torch.rand(20, generator=gen) * 0.6  # E[p] = 0.3: true tau 1.9
        prompts = [torch.binomial(torch.full((12,), 3.0), torch.full((12,), float(q)), generator=gen).long().tolist()
                   for q in p]
        lo, hi = bootstrap_tau(prompts, samples=500, seed=trial)
        covered += lo <= 1.9 <= hi
    assert 85 <= covered <= 100


def test_offline_metrics_on_known_predictions(random_drafter):
    """An untrained drafter predicts its MASK input token at every block position (docs/methods.md,
    'The MASK token'), so a reply made of MASK tokens is drafted perfectly, and one foreign token fails exactly the
    blocks that reach it. Prompt positions 0-4, reply 5-14; anchors 4..13; a label past position 14 is invalid."""
    mask, B = random_drafter.config.mask_token_id, 4
    width = len(random_drafter.config.target_layer_ids) * random_drafter.config.target_hidden_size
    torch.manual_seed(0)
    ids = torch.tensor([100, 101, 102, 103, 104] + [mask] * 10)
    item = {"input_ids": ids, "loss_mask": torch.arange(15) >= 5, "features": torch.randn(15, width)}
    m = offline_metrics(random_drafter, [item], B, [1, 4])
    assert m["a_k"] == [1.0, 1.0, 1.0] and m["blocks_at_k"] == [10, 9, 8] and m["tau_offline"] == 4.0
    assert m["blocks"] == 10 and m["recall"] == {"1": [1.0] * 3, "4": [1.0] * 3}

    ids[9] = 7  # missed by the anchor at 8 (k=1), at 7 (k=2), at 6 (k=3)
    m = offline_metrics(random_drafter, [item], B, [1, 4])
    assert m["blocks_at_k"] == [10, 8, 6]
    assert m["a_k"] == pytest.approx([9 / 10, 7 / 8, 5 / 6])
    assert m["tau_offline"] == pytest.approx(1 + 0.9 + 0.9 * 7 / 8 + 0.9 * 7 / 8 * 5 / 6)
    assert m["recall"]["1"] == pytest.approx(m["a_k"])


# -- the stage ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_eval(tmp_path_factory, tiny_teacher):
    """teacher (shared fixture) -> 4 training steps -> eval of the chain, with the tiny experiment's eval settings
    (the components' methods: tests/test_pipeline.py)."""
    from dflash_pipeline.train.loop import run_train

    root = tmp_path_factory.mktemp("eval_run")
    cfg = make_config(f"trainer.data_dir={tiny_teacher}", "eval.methods=[chain]")
    run_train(cfg, root / "train")
    out = run_eval(cfg, root / "eval")
    return cfg, out


@pytest.mark.slow
def test_eval_results_schema(tiny_eval):
    cfg, out = tiny_eval
    results = json.loads((out / "eval_results.json").read_text())
    B = results["block_size"]
    assert B == cfg.drafter.block_size and results["config_hash"] == eval_hash(cfg)
    assert (out / "results.md").is_file() and (out / "acceptance.png").stat().st_size > 0
    assert (out / "metrics.jsonl").is_file()
    held = results["offline"]["teacher_heldout"]
    assert held is not None and held["sequences"] == cfg.trainer.heldout_samples
    assert len(held["a_k"]) == B - 1 and all(len(v) == B - 1 for v in held["recall"].values())
    assert set(results["methods"]) == {"chain"}
    per = results["methods"]["chain"]
    assert list(per) == ["mtbench", "mtbench_turn2", "humaneval", "heldout"]  # both MT-Bench turns
    assert results["prompts"]["mtbench_turn2"] == {"offline": 2, "online": 1}
    for ds, r in per.items():
        for key in ("a_k_online", "a_k_offline"):
            assert len(r[key]) == B - 1, (ds, key)
        assert all(len(v) == B - 1 for v in r["recall"].values())
        assert len(r["accepted_hist"]) == B and sum(r["accepted_hist"]) == r["rounds"]
        assert r["prompts"] == cfg.eval.online_prompts and r["offline_prompts"] == cfg.eval.num_prompts
        assert 0 < r["output_tokens"] <= cfg.eval.online_prompts * cfg.eval.max_new_tokens
        lo, hi = r["tau_offline_ci95"]
        assert lo <= r["tau_offline"] <= hi
        assert r["exact"] is True and r["mismatches"] == []
        assert 1.0 <= r["tau_online"] <= B and 1.0 <= r["tau_offline"] <= B
        assert r["speedup"] > 0 and r["tokens_per_s_ar"] > 0 and r["tokens_per_s_spec"] > 0
        assert r["target_forwards_per_token"] <= 1.0 + 1e-9
        assert r["timed_runs"] == 4 * cfg.eval.online_prompts * cfg.eval.timing_repeats
    md = (out / "results.md").read_text()
    assert "| chain | mtbench |" in md and "tau online" in md


def test_eval_bad_input_fails_early(tmp_path):
    with pytest.raises(EvalError, match="unknown eval dataset 'nope'"):
        run_eval(make_config("eval.datasets=[nope]"), tmp_path / "eval")
    with pytest.raises(ConfigError, match=r"unknown eval.methods \['tree'\]; available: .*chain"):
        run_eval(make_config("eval.methods=[tree]"), tmp_path / "eval")
    with pytest.raises(EvalError, match="no exported drafter"):
        run_eval(make_config(), tmp_path / "eval")


@pytest.mark.slow
def test_eval_skips_when_done(tiny_eval):
    cfg, out = tiny_eval
    before = (out / "eval_results.json").stat().st_mtime_ns
    run_eval(cfg, out)
    assert (out / "eval_results.json").stat().st_mtime_ns == before


def test_cost_curve_context_is_the_median_decode_context():
    """A set's verify-cost curve is measured where its decodes run: median prompt length + half the reply, capped
    at the room the target's context leaves."""
    prompts = [{"prompt_ids": list(range(1, n + 1))} for n in (10, 40, 300)]
    assert len(decode_context(prompts, max_new_tokens=96, room=10_000)) == 40 + 48
    assert len(decode_context(prompts, max_new_tokens=96, room=50)) == 50
    assert decode_context(prompts, 96, 10_000)[:12] == list(range(1, 11)) + [1, 2]  # the first prompt, repeated


def test_speculative_refuses_a_method_that_cannot_run_at_this_temperature(target, prompt_ids, random_drafter):
    """From the library too, a greedy-only method at temperature > 0 raises instead of silently decoding
    differently (a tree walking the argmax, a policy falling back to the chain sampler)."""
    class GreedyOnly(decode.ChainMethod):
        name, greedy_only = "greedy_only", True

    method = GreedyOnly(random_drafter)
    with pytest.raises(ValueError, match="greedy_only decodes greedily only"):
        speculative(target, method, prompt_ids[0], 8, 4, temperature=0.7)
    assert speculative(target, method, prompt_ids[0], 8, 4).tokens == autoregressive(target, prompt_ids[0], 8)[0]

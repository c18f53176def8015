"""The online passes of the eval stage: every method's speculative decode beside the target's plain decode of the
same prompts, timed by an A-B-B-A protocol and checked for exactness, and the online metrics computed from them.

Timing protocol: one warm-up pair per eval set, then per prompt A B B A (AR, spec, spec, AR) x timing_repeats (plain
decoding in each other dtype of eval.baseline_dtypes after the first AR and after the second spec); times are medians
of per-run seconds per output token. Acceptance statistics come from the first speculative run of each prompt.
Greedy: every speculative output must equal the autoregressive one token for token (eval/exactness.py).
The metrics are pure functions of the passes (online_metrics), tested on made-up passes.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from dflash_pipeline.data.splits import step_seed
from dflash_pipeline.eval.decode import SpecResult, autoregressive, speculative
from dflash_pipeline.eval.exactness import DEFAULT_TOLERANCE, NEAR_TIE, WRONG, ExactnessJudge, rounds_before
from dflash_pipeline.eval.metrics import accepted_length_stats, bootstrap_tau, median
from dflash_pipeline.eval.policies import EvalContext
from dflash_pipeline.models.target import Target, torch_dtype
from dflash_pipeline.runtime.progress import Progress

log = logging.getLogger(__name__)


@dataclass
class Passes:
    """The timed decodes of one prompt in one repeat, in the order they ran: AR, [other dtypes], spec, spec,
    [other dtypes], AR."""

    prompt: dict
    repeat: int
    ar: list[tuple[list[int], dict]]  # the two autoregressive runs: (tokens, timings)
    spec: list[SpecResult]  # the two speculative runs
    other: dict[str, list[tuple[float, float]]]  # per other dtype: (s per token, s per step) of its two runs
    verified_upto: int | None = None  # greedy: where the first speculative run diverged at a near-tie


def timed_passes(target: Target, method, prompts: list[dict], *, label: str, block_size: int, max_new_tokens: int,
                 temperature: float, seed: int, repeats: int, baselines: dict[str, torch.nn.Module],
                 acceptance: str = "sampled"):
    """Yields the Passes of every prompt and repeat (A F B B F A), after one warm-up of each kind on prompt 0."""
    device = next(target.model.parameters()).device
    others = {d: SimpleNamespace(model=m, eos_ids=target.eos_ids) for d, m in baselines.items()}
    bar = Progress(f"eval {label} {method.name}", len(prompts), "prompt")
    part = 1 / (4 * repeats)  # a prompt is done after repeats x (AR, spec, spec, AR)

    def gen(*parts):
        if temperature <= 0:
            return None
        return torch.Generator(device=device).manual_seed(step_seed(seed, label, *parts) % (2 ** 63))

    def ar(i, run):
        out = autoregressive(target, prompts[i]["prompt_ids"], max_new_tokens, temperature, gen(i, "ar", run))
        bar.update(0 if run == "warmup" else part)
        return out

    def spec(i, run):
        out = speculative(target, method, prompts[i]["prompt_ids"], max_new_tokens, block_size, temperature,
                          gen(i, "spec", run), acceptance=acceptance)
        bar.update(0 if run == "warmup" else part)
        return out

    def ar_in(dtype: str, i: int) -> tuple[float, float]:
        """(s per token, s per decode step) of plain decoding of prompt i by the target in another dtype."""
        tokens, t = autoregressive(others[dtype], prompts[i]["prompt_ids"], max_new_tokens, temperature,
                                   gen(i, "ar", dtype))
        return t["total_s"] / len(tokens), t["decode_s"] / max(1, len(tokens) - 1)

    ar(0, "warmup"), spec(0, "warmup")
    for d in others:
        ar_in(d, 0)
    for i, p in enumerate(prompts):
        for r in range(repeats):
            a1 = ar(i, 2 * r)
            other = {d: [ar_in(d, i)] for d in others}
            s1, s2 = spec(i, 2 * r), spec(i, 2 * r + 1)
            for d in others:
                other[d].append(ar_in(d, i))
            a2 = ar(i, 2 * r + 1)
            yield Passes(p, r, [a1, a2], [s1, s2], other)
    bar.close()


def check_passes(judge: ExactnessJudge, passes: Passes, strict: bool, near_ties: list, mismatches: list) -> None:
    """Greedy: the second AR run and both speculative runs against the first AR run (eval/exactness.py), each
    divergence recorded in near_ties or mismatches (raised when strict); a near-tie of the first speculative run in
    the first repeat bounds the rounds its acceptance counts."""
    p, reference = passes.prompt, passes.ar[0][0]
    for what, other in (("the second autoregressive run", passes.ar[1][0]),
                        ("speculative decoding", passes.spec[0].tokens),
                        ("a repeated speculative run", passes.spec[1].tokens)):
        v = judge.check(p["id"], p["prompt_ids"], reference, other, what, strict)
        if v.kind in (NEAR_TIE, WRONG):
            (near_ties if v.kind == NEAR_TIE else mismatches).append(
                {"prompt": p["id"], "position": v.position, "run": what, "repeat": passes.repeat, **v.detail})
        if passes.repeat == 0 and other is passes.spec[0].tokens and v.kind == NEAR_TIE:
            passes.verified_upto = v.position


@dataclass
class OnlineRun:
    """One method's online passes on one eval set: the figures (as eval_results.json holds them), and per prompt the
    first passes the served gate compares with an engine's."""

    figures: dict
    ar_outputs: list[list[int]]  # the first autoregressive reply: the exactness reference
    spec_rounds: list[list[int]]  # the first speculative run's accepted drafts per round (every round)
    spec_outputs: list[list[int]]  # that run's output


def run_online(target: Target, method, prompts: list[dict], *, label: str, block_size: int, max_new_tokens: int,
               temperature: float = 0.0, seed: int = 0, repeats: int = 1, strict: bool = True,
               costs: EvalContext | None = None, judge: ExactnessJudge | None = None,
               baselines: dict[str, torch.nn.Module] | None = None, acceptance: str = "sampled") -> OnlineRun:
    """Speculative vs autoregressive decoding of `prompts` (A B B A per prompt per repeat, after one warm-up).

    Returns the online metrics of the eval set and the first passes of each prompt (OnlineRun).
    With `costs` (the measured verify-cost curve), also the speedup that curve predicts for the rounds run.
    Greedy outputs are classified by `judge` (eval/exactness.py; default: one for the target's dtype with the
    default tolerance); acceptance counts every round, and beside it (`*_verified_prefix`) the rounds before a
    near-tie divergence. baselines: the target in
    other dtypes ({dtype: model}, eval.baseline_dtypes), whose plain decoding is timed in the same passes
    (A F B B F A); speedups against the fastest autoregressive decoding of any dtype are reported beside.
    """
    judge = judge or ExactnessJudge(target.model, DEFAULT_TOLERANCE)
    runs, near_ties, mismatches = [], [], []
    for passes in timed_passes(target, method, prompts, label=label, block_size=block_size,
                               max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, repeats=repeats,
                               baselines=baselines or {}, acceptance=acceptance):
        if temperature <= 0:
            check_passes(judge, passes, strict, near_ties, mismatches)
        runs.append(passes)
    res = online_metrics(runs, block_size, target.dtype, costs)
    res.update({"exact": (not mismatches) if temperature <= 0 else None,  # None: not defined when sampling
                "mismatches": mismatches,  # wrong outputs (recorded with eval.strict_exact=false; raised otherwise)
                # reduced precision: outputs that diverged at a near-tie (eval/exactness.py), and counts per kind
                "near_ties": near_ties,
                "outputs_compared": 3 * len(runs) if temperature <= 0 else 0,
                "near_tie_outputs": len(near_ties),
                "identical": (not mismatches and not near_ties) if temperature <= 0 else None})
    log.info("%s %s: tau_online %.3f a_k %s speedup %.2fx (AR %.1f tok/s, spec %.1f tok/s), exact %s", method.name,
             label, res["tau_online"], [round(x, 3) for x in res["a_k_online"]], res["speedup"],
             res["tokens_per_s_ar"], res["tokens_per_s_spec"], res["exact"])
    first = [r for r in runs if r.repeat == 0]
    return OnlineRun(res, [r.ar[0][0] for r in first], [r.spec[0].accepted for r in first],
                     [r.spec[0].tokens for r in first])


def online_metrics(runs: list[Passes], block_size: int, target_dtype: str, costs: EvalContext | None) -> dict:
    """The online metrics of an eval set from its passes: acceptance over the first speculative run of the first
    repeat of each prompt (every round; and up to a near-tie divergence), times as medians over every timed run;
    with `costs` (the measured verify-cost curve), the speedup that curve predicts for the rounds run."""
    first = [r for r in runs if r.repeat == 0]
    res = {**acceptance_metrics(first, block_size), **timing_metrics(runs, target_dtype)}
    timed_accepted = [n for r in first for n in r.spec[0].accepted]
    if costs is not None and timed_accepted:  # tokens over the rounds' cost in AR steps, from the curve
        verified = [n for r in first for n in r.spec[0].verified]
        drafted = [d for r in first for d in r.spec[0].drafted]
        spent = sum(costs.round_cost(v, d) for v, d in zip(verified, drafted))
        res["round_cost_predicted"] = spent / len(timed_accepted)
        res["predicted_speedup"] = (sum(timed_accepted) + len(timed_accepted)) / spent
        res["measured_over_predicted"] = res["speedup_decode"] / res["predicted_speedup"]
    return res


def acceptance_metrics(first: list[Passes], block_size: int) -> dict:
    """Acceptance of the first speculative run of each prompt. Every round a speculative run made is exact against
    its own verification, also after a near-tie divergence from the autoregressive reference (reduced precision): the
    headline counts them all. Beside it, the rounds before that divergence, whose tokens are the reference's
    (`*_verified_prefix`; equal when nothing diverged)."""
    every_round = [r.spec[0].accepted for r in first]
    per_prompt = [rounds_before(r.spec[0].accepted, r.verified_upto) for r in first]
    stats = accepted_length_stats([n for kept in every_round for n in kept], block_size)
    prefix = accepted_length_stats([n for kept in per_prompt for n in kept], block_size)
    verified = [n for r in first for n in r.spec[0].verified]
    drafted = [d for r in first for d in r.spec[0].drafted]
    out_tokens = sum(len(r.spec[0].tokens) for r in first)
    forwards = sum(r.spec[0].target_forwards for r in first)
    return {
        "prompts": len(first),
        "output_tokens": out_tokens,
        "rounds": stats["rounds"],
        "a_k_online": stats["a_k"],
        "accepted_hist": stats["accepted_hist"],  # rounds that accepted 0 .. B-1 drafts
        "tau_online": stats["tau"],
        "tau_online_ci95": bootstrap_tau(every_round),  # bootstrap over prompts
        "rounds_verified_prefix": prefix["rounds"],
        "a_k_online_verified_prefix": prefix["a_k"],
        "tau_online_verified_prefix": prefix["tau"],
        "tau_online_verified_prefix_ci95": bootstrap_tau(per_prompt),
        "target_forwards_per_token": forwards / out_tokens if out_tokens else 0.0,
        "verified_per_round": sum(verified) / len(verified) if verified else 0.0,  # drafts verified
        "drafted_fraction": sum(drafted) / len(drafted) if drafted else 0.0,  # rounds that ran the drafter
    }


def timing_metrics(runs: list[Passes], target_dtype: str) -> dict:
    """Times of every timed run as medians: per output token, per decoding step, per round's draft / verify /
    selection, and the speedups against plain decoding in the target's dtype and in the fastest dtype timed."""
    ars = [(tokens, t) for r in runs for tokens, t in r.ar]
    specs = [s for r in runs for s in r.spec]
    ar_s_per_tok = [t["total_s"] / len(tokens) for tokens, t in ars]
    ar_decode = [t["decode_s"] / max(1, len(tokens) - 1) for tokens, t in ars]
    spec_s_per_tok = [s.total_s / len(s.tokens) for s in specs]
    spec_decode = [(s.total_s - s.prefill_s) / max(1, len(s.tokens) - 1) for s in specs]
    draft_s = [x for s in specs for x in s.draft_s]
    verify_s = [x for s in specs for x in s.verify_s]
    select_s = [x for s in specs for x in s.select_s]
    scorings = [x for s in specs for x in s.scorings]
    ms_ar, ms_spec = 1e3 * median(ar_s_per_tok), 1e3 * median(spec_s_per_tok)
    total_draft, total_verify = sum(draft_s), sum(verify_s)
    spec_step, ar_step_ms = median(spec_decode), 1e3 * median(ar_decode)
    res = {
        "draft_ms_per_round": 1e3 * median(draft_s),
        "verify_ms_per_round": 1e3 * median(verify_s),
        "prefill_ms": 1e3 * median([s.prefill_s for s in specs]),
        "draft_fraction": total_draft / (total_draft + total_verify) if draft_s else 0.0,
        "select_ms_per_round": 1e3 * median(select_s),  # choosing among the candidates, part of draft ms
        "select_fraction": sum(select_s) / (total_draft + total_verify) if draft_s else 0.0,
        "scorings_per_round": sum(scorings) / len(scorings) if scorings else 0.0,
        "ms_per_token_ar": ms_ar,
        "ms_per_token_spec": ms_spec,
        "tokens_per_s_ar": 1e3 / ms_ar if ms_ar else 0.0,
        "tokens_per_s_spec": 1e3 / ms_spec if ms_spec else 0.0,
        "speedup": ms_ar / ms_spec if ms_spec else 0.0,
        "speedup_decode": median(ar_decode) / spec_step if spec_decode and spec_step else 0.0,
        "target_dtype": target_dtype,
        "timed_runs": len(ar_s_per_tok) + len(spec_s_per_tok),
    }
    # the baseline a user compares with: the fastest plain decoding on the machine, in any dtype timed
    per_dtype = {target_dtype: (ms_ar, median(ar_decode))}
    for d in (runs[0].other if runs else {}):
        timed = [x for r in runs for x in r.other[d]]
        per_dtype[d] = (1e3 * median([t for t, _ in timed]), median([x for _, x in timed]))
    fastest = min(per_dtype, key=lambda d: per_dtype[d][0])
    res["ms_per_token_ar_by_dtype"] = {d: ms for d, (ms, _) in per_dtype.items()}
    res["fastest_ar_dtype"] = fastest
    res["speedup_vs_fastest_ar"] = per_dtype[fastest][0] / ms_spec if ms_spec else 0.0
    res["speedup_decode_vs_fastest_ar"] = per_dtype[fastest][1] / spec_step if spec_step else 0.0
    res["ar_step_ms"] = ar_step_ms  # a decoding step of the autoregressive runs
    if draft_s and ar_step_ms:  # what a round cost inside these decodes, in those steps
        res["round_cost_in_decode"] = 1e3 * (total_draft + total_verify) / len(draft_s) / ar_step_ms
    return res


def baseline_models(target: Target, dtypes: list[str], judge: ExactnessJudge) -> dict:
    """The target in each of `dtypes` other than its own (the float32 one shared with the exactness judge): plain
    decoding in the dtype that is fastest on this machine is the baseline a user compares with (on a CPU without
    native bf16, bf16 decodes faster one token at a time but verifies blocks slower; docs/results/precision.md)."""
    out = {}
    for d in dict.fromkeys(dtypes):
        if d != target.dtype:
            out[d] = judge.float32_model() if d == "float32" else copy.deepcopy(target.model).to(torch_dtype(d))
    return out

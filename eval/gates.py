"""The parity gates between an engine and the own loop, apart from any engine: the engine's counters recomputed from
the own loop's rounds, the greedy gate (counters equal in float32 on torch's kernels, rates within a tolerance in
reduced precision and on llama.cpp's kernels, every served output exact but for near-ties) and the sampled gate at
temperature > 0 (per-position acceptance equal within noise, the served samples distributed as the target's). Both
fail when there is nothing to compare (no own rounds, no served drafts). A failed gate is one line naming the likely
cause."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from dflash_pipeline.eval import significance
from dflash_pipeline.eval.engine_contract import WHAT, likely_keys
from dflash_pipeline.eval.exactness import IDENTICAL, NEAR_TIE, ExactnessJudge

log = logging.getLogger(__name__)


# -- counts ------------------------------------------------------------------------------------------------------
def own_counts(rounds: list[list[int]], drafts_per_round: int, budget: int | None = None) -> dict:
    """vLLM's counters recomputed from the own loop's rounds (accepted drafts per round, per prompt): drafts, and
    per draft position k the rounds that accepted at least k drafts.

    budget (llama.cpp): the engine drafts at most (tokens still to generate) - 1 in a round, where the own loop
    drafts a whole block and cuts the output; the own rounds are counted as such an engine would run them, up to the
    first round the budget cuts short (after it the paths' rounds no longer line up: the last one or two of a
    prompt)."""
    flat = []
    for prompt in rounds:
        produced = 1  # the first token comes from the prefill, in both
        for n in prompt:
            most = drafts_per_round if budget is None else min(drafts_per_round, budget - produced - 1)
            if most <= 0:
                break
            flat.append(min(n, most))
            produced += n + 1
            if n > most:
                break
    return {"drafts": len(flat), "accepted": sum(flat),
            "accepted_per_pos": [sum(n > k for n in flat) for k in range(drafts_per_round)]}


def summed(counters: list[dict], drafts_per_round: int) -> dict:
    per_pos = [0] * drafts_per_round
    for c in counters:
        per_pos = [a + b for a, b in zip(per_pos, c["accepted_per_pos"] + [0] * drafts_per_round)]
    return {"drafts": sum(c["drafts"] for c in counters), "accepted": sum(c["accepted"] for c in counters),
            "accepted_per_pos": per_pos}


def rates(counts: dict) -> dict:
    """a_k (conditional acceptance per position), the unconditional rate per position and tau from counters."""
    drafts, per_pos = counts["drafts"], counts["accepted_per_pos"]
    reached = [drafts] + per_pos[:-1]
    return {"a_k": [p / r if r else 0.0 for p, r in zip(per_pos, reached)],
            "rate_k": [p / drafts if drafts else 0.0 for p in per_pos],
            "tau": 1 + counts["accepted"] / drafts if drafts else 0.0}


# -- the gate ----------------------------------------------------------------------------------------------------
def nothing_to_compare(own_drafts: int, served_drafts: int, own_accepted: int | None = None,
                       served_accepted: int | None = None) -> str | None:
    """Why a gate has nothing to compare, or None: the own loop ran no round, the engine drafted nothing (a drafter
    that did not load, or counters under names the engine's reader does not know, read as none), or (greedy, with
    the accepted counts) the engine accepted nothing where the exact own loop accepted. Equal empty counters would
    otherwise pass, and a reduced-precision tolerance would pass an engine that accepts nothing beside an own loop
    that accepts little."""
    if not own_drafts:
        return ("nothing to compare: the own loop ran no speculative round on these prompts (0 drafts: no prompts, "
                "or eval.max_new_tokens too small for a round), and a gate that compares nothing does not pass")
    if not served_drafts:
        return (f"the engine drafted nothing (0 drafts where the own loop drafted {own_drafts}): is the drafter "
                "loaded? (the engine's log: its speculative config, and the speculative counters it reports)")
    if own_accepted and served_accepted == 0:
        return (f"the engine accepted none of its {served_drafts} drafts where the own loop accepted {own_accepted} "
                f"of {own_drafts}")
    return None


def gate(own: dict, served: dict, dtype: str, tolerance: float, outputs_ok: bool, served_contract: dict,
         own_contract: dict, engine_cause: str | None = None) -> dict:
    """The parity verdict of one eval set: {"pass": bool, "line": one line, "likely_keys": [...]}.

    float32 (on torch's kernels: dtype "float32"): the counters equal (drafts and accepted per position) and every
    served output is exact. Otherwise (reduced precision, or float32 on another engine's kernels, e.g. "float32 in
    llama.cpp"): every |rate_k served - rate_k own| <= tolerance (the unconditional acceptance per position), tau
    within tolerance relative, and no output wrong beyond near-ties. Either way it fails when there is nothing to
    compare (nothing_to_compare). engine_cause: what a failure is named as when the engine itself is known to decode
    the target differently (no drafter key is then blamed)."""
    ro, rs = rates(own), rates(served)
    if dtype == "float32":
        ok = own["drafts"] == served["drafts"] and own["accepted_per_pos"] == served["accepted_per_pos"]
        rule = "counters equal (float32)"
        apart = [k for k, (a, b) in enumerate(zip(own["accepted_per_pos"], served["accepted_per_pos"])) if a != b]
    else:
        diffs = [abs(a - b) for a, b in zip(ro["rate_k"], rs["rate_k"])]
        ok = max(diffs, default=0.0) <= tolerance and abs(rs["tau"] - ro["tau"]) <= tolerance * ro["tau"]
        rule = f"per-position rates within {tolerance} ({dtype})"
        apart = [k for k, d in enumerate(diffs) if d > tolerance]
    empty = nothing_to_compare(own["drafts"], served["drafts"], own["accepted"], served["accepted"])
    ok = ok and outputs_ok and empty is None
    keys = likely_keys(served_contract, own_contract) if ok or engine_cause is None else []
    if ok:
        line = f"parity: served acceptance equals the own loop's ({rule}; tau {rs['tau']:.3f})"
        if keys:
            line += f"; note: the export differs from the drafter in {', '.join(keys)}"
    elif empty is not None and not (own["drafts"] and served["drafts"]):  # a side without drafts: no rates to read
        line = (f"PARITY FAILED: {empty}" + ("" if outputs_ok else "; served outputs are not exact")
                + (f"; the export also differs from the drafter in {', '.join(keys)}" if keys else "")
                + (f"; and {engine_cause}" if engine_cause else ""))
    else:
        first = ""
        if apart:  # where the two part first, and which side moved (float32: by the counts)
            k = apart[0]
            pair = ((served["accepted_per_pos"][k], own["accepted_per_pos"][k]) if dtype == "float32" else
                    (rs["rate_k"][k], ro["rate_k"][k]))
            side = "the engine accepts less" if pair[0] < pair[1] else "the engine accepts more"
            first = (f"; first apart at draft position {k + 1}: served rate {rs['rate_k'][k]:.3f} vs own "
                     f"{ro['rate_k'][k]:.3f} ({side})")
        where = ((f"{empty}: " if empty else "")
                 + f"served tau {rs['tau']:.3f} a_k {[round(x, 3) for x in rs['a_k']]} vs own loop tau "
                 f"{ro['tau']:.3f} a_k {[round(x, 3) for x in ro['a_k']]}{first}"
                 + ("" if outputs_ok else "; served outputs are not exact"))
        if keys:
            cause = "; ".join(f"{k} ({WHAT.get(k, 'a contract key')}): export {served_contract.get(k)!r}, "
                              f"own loop {own_contract.get(k)!r}" for k in keys)
        elif not dtype.startswith("float32") and empty is None:  # rounding cannot make an engine accept nothing
            cause = (f"none differs between the export and the drafter; in {dtype} the engines round differently: "
                     "rerun in float32 (target.dtype=float32), where a pass means numerics and a failure a contract "
                     "key the engine reads differently")
        else:  # float32, or nothing accepted: the same export read differently, the symptom says where to look first
            first = rs["rate_k"][0] if rs["rate_k"] else 0.0
            cause = ("dflash_config.target_layer_ids or dflash_config.mask_token_id (position 1 collapses: the "
                     "engine reads the context features or the mask slot differently)"
                     if first < 0.5 * (ro["rate_k"][0] if ro["rate_k"] else 0.0) else
                     "rope_theta / rope_scaling or the causal flag (later positions part first)")
        line = (f"PARITY FAILED: {where}; cause: {engine_cause}" if engine_cause else
                f"PARITY FAILED: {where}; likely contract key: {cause}")
    return {"pass": ok, "rule": rule, "line": line, "likely_keys": keys}


@dataclass
class OwnSet:
    """One method's first runs on one eval set's online prompts, as the served eval compares them."""

    prompts: list[dict]
    ar: list[list[int]]  # the first autoregressive reply per prompt: the exactness reference
    rounds: list[list[int]]  # accepted drafts per round of the first speculative run
    spec: list[list[int]]  # that run's output
    a_k: list[float]  # the own loop's a_k online, as reported
    a_k_teacher_forced: list[float]
    ms_per_token_fastest_ar: float | None = None  # the own loop's fastest plain decoding, any dtype


@dataclass(frozen=True)
class Gate:
    """What the greedy parity gate judges with."""

    drafts_per_round: int
    dtype: str
    tolerance: float  # eval.served.tolerance: reduced precision's allowance per position
    judge: ExactnessJudge
    served_contract: dict  # export_contract of the export the engine loads
    own_contract: dict  # drafter_contract of the drafter the own loop runs
    engine: str = "vLLM"  # the serving engine, as the verdicts name it
    budget: int | None = None  # llama.cpp: max_new_tokens, whose remainder caps each round's drafts (own_counts)


def compare(served: dict, own: OwnSet, g: Gate) -> dict:
    """The served figures of one eval set beside the own loop's, with the exactness of every served output and
    the gate's verdict.

    Reduced precision: a decode that parted from the reference at a near-tie runs other tokens from there on, so
    its rounds are not comparable; the gate compares the prompts whose own and served speculative outputs both equal
    the own autoregressive reference (the same token paths: what still differs is the engines' rounding in the
    drafter and the verify), and the whole set's figures are reported beside (all prompts when none is left)."""
    prompts, own_ar, own_spec, own_rounds = own.prompts, own.ar, own.spec, own.rounds
    drafts_per_round, dtype, judge = g.drafts_per_round, g.dtype, g.judge
    near_ties, wrong = [], []
    for p, ref, plain, spec in zip(prompts, own_ar, served["outputs_plain"], served["outputs_spec"]):
        for what, other in ((f"{g.engine} plain", plain), (f"{g.engine} speculative", spec)):
            v = judge.classify(p["prompt_ids"], ref, other)
            if v.kind != IDENTICAL:
                (near_ties if v.kind == NEAR_TIE else wrong).append({"prompt": p["id"], "run": what,
                                                                     "position": v.position, **v.detail})
    spec_equals_plain = sum(a == b for a, b in zip(served["outputs_plain"], served["outputs_spec"]))
    same_path = [i for i, (ref, own, spec) in enumerate(zip(own_ar, own_spec, served["outputs_spec"]))
                 if ref == own == spec]
    gated = same_path if dtype != "float32" and same_path else list(range(len(prompts)))
    counts_served = summed(served["counters"], drafts_per_round)
    counts_own = own_counts(own_rounds, drafts_per_round, g.budget)
    outputs_ok = not wrong and (dtype != "float32" or not near_ties)
    plain_off = [w for w in wrong if w["run"] == f"{g.engine} plain"]
    engine_cause = None
    if plain_off:  # the engine decodes the target itself differently: no drafter key to blame
        engine_cause = (f"the engine's plain decoding (no drafter) already differs from the target's own on "
                        f"{len(plain_off)} of {len(prompts)} prompts, from output position "
                        f"{min(w['position'] for w in plain_off)}: the engine runs this target differently (its model "
                        "code or kernels), not a drafter contract key")
    verdict = gate(own_counts([own_rounds[i] for i in gated], drafts_per_round, g.budget),
                   summed([served["counters"][i] for i in gated], drafts_per_round), dtype, g.tolerance, outputs_ok,
                   g.served_contract, g.own_contract, engine_cause)
    verdict["prompts_compared"] = len(gated)
    if len(gated) < len(prompts):
        verdict["line"] += f" (on the {len(gated)} of {len(prompts)} prompts whose decodes took the same tokens)"
    rs, ro = rates(counts_served), rates(counts_own)
    res = {
        "prompts": len(prompts),
        "a_k_served": rs["a_k"], "a_k_own": ro["a_k"], "a_k_own_reported": own.a_k,
        "a_k_teacher_forced": own.a_k_teacher_forced,
        "tau_served": rs["tau"], "tau_own": ro["tau"],
        "counters_served": counts_served, "counters_own": counts_own,
        "counters_served_per_prompt": served["counters"], "same_path_prompts": same_path,
        "spec_identical_to_plain": spec_equals_plain, "outputs_compared": 2 * len(prompts),
        "near_ties": near_ties, "wrong": wrong,
        "gate": verdict,
        **{k: v for k, v in served.items() if not k.startswith(("outputs", "counters"))},
    }
    (log.info if verdict["pass"] else log.error)("%s", verdict["line"])
    return res


# -- at temperature > 0 ------------------------------------------------------------------------------------------------
ENGINE_BUGS = {  # models/vllm_worker.py's checks, as a verdict names them
    "rejection_temperature": "its CPU build's rejection sampler divides the target's logits by uninitialised "
                             "memory instead of the temperature (the per-draft expansion writes into a discarded "
                             "int64 copy): the target's probabilities at T > 0 are wrong, and with them acceptance and the "
                             "served samples",
}


def too_few_samples(distribution: dict, seeds: int) -> str | None:
    """Why the distribution check could not run, or None: fewer PIT values than its chi-square needs (skipped, it
    would pass a biased sampler unseen), with the eval.served.seeds that would give enough at this run's values per
    seed."""
    if distribution.get("p") is not None:
        return None
    n, needed = distribution.get("n", 0), distribution.get("needed", 50)
    if not n:
        return (f"no sampled tokens for the distribution check ({needed} PIT values needed): the served decodes "
                "returned no output")
    seeds = max(1, seeds)
    return (f"too few samples for the distribution check: {n} PIT values from {seeds} seeds ({n / seeds:.1f} a seed), "
            f"{needed} needed: raise eval.served.seeds to {math.ceil(needed * seeds / n)}")


def sampled_gate(own: list[dict], served: list[dict], positions: int, alpha: float, rule: str, temperature: float,
                 served_distribution: dict, engine: dict, other_rule: list[dict] | None = None,
                 seeds: int | None = None) -> dict:
    """The verdict at temperature > 0: per-position acceptance equal within noise (Holm at `alpha`) and the served
    samples distributed as the target's (PIT chi-square p > alpha); failed when either cannot be judged (no own
    rounds, no served drafts, too few PIT values). engine: {"version", "checks", "repaired"}; seeds: how many the
    served decodes ran (default: the distinct seeds of the seeded ones), for the seeds a short check needs."""
    test = significance.compare_positions(own, served, positions, alpha)
    dist_p = served_distribution.get("p")
    biased = dist_p is not None and dist_p <= alpha
    if seeds is None:
        seeds = len({d["seed"] for d in served if d.get("seed") is not None})
    short = too_few_samples(served_distribution, seeds)
    empty = nothing_to_compare(sum(d["drafts"] for d in own), sum(d["drafts"] for d in served))
    ok = not test["differ"] and not biased and short is None and empty is None
    ts, to = significance.rate_table(served, positions), significance.rate_table(own, positions)
    fmt = lambda t: f"{t['tau']:.3f}" + (f" [{t['tau_low']:.3f}, {t['tau_high']:.3f}]"  # noqa: E731
                                         if t["tau_low"] is not None else "")
    broken = [k for k, right in engine.get("checks", {}).items() if not right and k not in engine.get("repaired", [])]
    if ok:
        line = (f"parity at T={temperature}: served acceptance equals the own loop's {rule} rule within noise "
                f"(per-position tests, Holm alpha {alpha}; {len(served)} served and {len(own)} own decodes; tau "
                f"served {fmt(ts)}, own {fmt(to)}); served samples follow the target's distribution (PIT chi-square "
                f"p {dist_p:.3f})")
    else:
        accepted = sum(sum(d["accepted_per_pos"]) for d in served)
        acceptance = (empty if empty is not None else
                      f"positions {test['differ']} differ (served a_k "
                      f"{[round(a['rate'] or 0.0, 3) for a in ts['a_k'][:4]]} vs own {rule} "
                      f"{[round(a['rate'] or 0.0, 3) for a in to['a_k'][:4]]}; tau served {fmt(ts)}, own {fmt(to)}"
                      + (f"; the engine accepted none of its {ts['drafts']} drafts" if not accepted else "") + ")"
                      if test["differ"] else "acceptance within noise")
        line = (f"PARITY FAILED at T={temperature}: {acceptance}"
                + (f"; served samples are NOT distributed as the target's (PIT chi-square p {dist_p:.2g})"
                   if biased else "")
                + (f"; {short}" if short else ""))
        if empty is None and (test["differ"] or biased):  # else the line says what is missing or too short
            if broken:
                line += "; cause: the engine's bug, vLLM " + str(engine.get("version")) + ": " + "; ".join(
                    ENGINE_BUGS.get(k, k) for k in broken) + " (eval.served.repair=true serves it mended)"
            elif not test["differ"]:  # acceptance agrees, the samples do not: how the engine samples the target
                line += ("; likely cause: the engine samples the target from another distribution than "
                         "softmax(logits / T) (its sampler chain: truncation such as top-k / top-p / min-p, penalties)")
            elif other_rule is not None and not significance.compare_positions(other_rule, served, positions,
                                                                               alpha)["differ"]:
                line += ("; served matches the own loop's other acceptance rule: the engine's draft sampling is not "
                         "the one configured (eval.served.draft_sample_method)")
            else:
                line += ("; likely cause: a contract key the engine reads differently (check the greedy gate first: "
                         "eval.temperature=0)")
    return {"pass": ok, "line": line, "positions": test, "distribution_p": dist_p, "engine_bugs": broken}

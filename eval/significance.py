"""The statistics of acceptance at temperature > 0 (docs/metrics.md, 'Acceptance at temperature').

Sampled decodes accept at random, so served and own-loop counts can only agree within noise. The unit of sampling
is a decode (one prompt, one seed): rounds of one decode share a context and are not independent, so rates are
ratio estimates over decodes with a cluster-robust variance (floored at the binomial variance of the pooled rate,
which also covers a single batched run). Two questions, two tests:
  acceptance   per draft position k, the conditional rate a_k = (decodes' rounds that accepted >= k drafts) /
               (rounds that reached k), served against own loop: a two-sided test per position (the difference
               over its cluster-robust standard error, against Student's t with one less degree of freedom than
               the smaller side's decodes that reached k), Holm-corrected over the positions tested; a side
               with no drafts at all differs at position 1 (nothing to test is no pass);
  distribution whether sampled tokens follow the target's own distribution at this temperature: the randomised
               probability integral transform u = P(tokens likelier than x) + V * p(x), V ~ U(0, 1), is uniform on
               [0, 1) exactly when x ~ p; a chi-square over equal bins of u (at least 5 values a bin, else no
               test, which the gate fails). A lower-but-exact rule passes it, a biased sampler does not.
"""
from __future__ import annotations

import math

import torch
from scipy import stats


def _per_decode(decodes: list[dict], k: int) -> tuple[list[int], list[int]]:
    """Successes and trials of draft position k (0-based) per decode, from vLLM-style counters."""
    s = [d["accepted_per_pos"][k] if k < len(d["accepted_per_pos"]) else 0 for d in decodes]
    n = [d["drafts"] if k == 0 else (d["accepted_per_pos"][k - 1] if k - 1 < len(d["accepted_per_pos"]) else 0)
         for d in decodes]
    return s, n


def ratio(successes: list[int], trials: list[int], floor_rate: float | None = None) -> tuple[float, float]:
    """(rate, standard error) of sum(s) / sum(n) over clusters: the cluster-robust (linearised) variance, never
    below the binomial variance at `floor_rate` (default: the rate itself)."""
    S, N, m = sum(successes), sum(trials), len(trials)
    if N == 0:
        return 0.0, float("inf")
    r = S / N
    var = m / (m - 1) * sum((s - r * n) ** 2 for s, n in zip(successes, trials)) / N ** 2 if m > 1 else 0.0
    p = r if floor_rate is None else floor_rate
    return r, math.sqrt(max(var, p * (1 - p) / N))


def wilson(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson's score interval of a binomial proportion (sensible at 0 and at all successes)."""
    p, n = successes / trials, trials
    centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (
        1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def interval(successes: list[int], trials: list[int], z: float = 1.96) -> dict:
    """The rate over clusters with a 95% interval: the cluster-robust normal interval, widened to Wilson's where
    that is wider (few or no successes); rate None where no trial was made."""
    if not sum(trials):
        return {"rate": None, "low": None, "high": None, "trials": 0, "accepted": 0}
    r, se = ratio(successes, trials)
    lo, hi = wilson(sum(successes), sum(trials), z)
    return {"rate": r, "low": max(0.0, min(r - z * se, lo)), "high": min(1.0, max(r + z * se, hi)),
            "trials": sum(trials), "accepted": sum(successes)}


def rate_table(decodes: list[dict], positions: int, z: float = 1.96) -> dict:
    """Per position a_k and the unconditional rate with 95% intervals over decodes, tau with its interval."""
    a_k, rate_k = [], []
    drafts = [d["drafts"] for d in decodes]
    for k in range(positions):
        s, n = _per_decode(decodes, k)
        a_k.append(interval(s, n, z))
        rate_k.append(interval(s, drafts, z))
    acc = [sum(d["accepted_per_pos"]) for d in decodes]
    mean, se = ratio(acc, drafts, floor_rate=0.0) if sum(drafts) else (0.0, 0.0)
    spread = len(decodes) > 1  # tau's interval comes from the spread over decodes: none from one batch
    return {"decodes": len(decodes), "drafts": sum(drafts), "a_k": a_k, "rate_k": rate_k, "tau": 1 + mean,
            "tau_low": 1 + mean - z * se if spread else None, "tau_high": 1 + mean + z * se if spread else None}


def compare_positions(own: list[dict], served: list[dict], positions: int, alpha: float) -> dict:
    """Per position: served a_k against own a_k, two-sided t tests, Holm's step-down at family level `alpha`.

    Returns {"differ": [1-based positions that differ], "tests": [{position, own, served, z, p}], "empty": [the
    sides with no drafts]}; a position is tested when both sides reached it and either accepted there. A side
    without drafts makes position 1 differ: an engine that drafted nothing must not pass by leaving nothing to test
    (a later position one side never reached is judged by the position before it)."""
    tests = []
    empty = [side for side, ds in (("own", own), ("served", served)) if not sum(d["drafts"] for d in ds)]
    for k in range(positions):
        so, no = _per_decode(own, k)
        ss, ns = _per_decode(served, k)
        if not sum(no) or not sum(ns) or not (sum(so) + sum(ss)):
            continue
        pooled = (sum(so) + sum(ss)) / (sum(no) + sum(ns))
        ro, seo = ratio(so, no, pooled)
        rs, ses = ratio(ss, ns, pooled)
        se = math.sqrt(seo ** 2 + ses ** 2)
        # the binomial floor leaves no variance only at a pooled rate of 1: both sides accepted every draft that
        # reached k, no difference (z 0); a difference over no variance would be certain
        z = (rs - ro) / se if se > 0 else (0.0 if rs == ro else math.copysign(math.inf, rs - ro))
        # few decodes make the cluster-robust variance optimistic: Student's t on the smaller side's decodes - 1
        df = max(1, min(sum(n > 0 for n in no), sum(n > 0 for n in ns)) - 1)
        tests.append({"position": k + 1, "own": ro, "served": rs, "z": z, "df": df,
                      "p": float(2 * stats.t.sf(abs(z), df))})
    differ, m = [], len(tests)
    for i, t in enumerate(sorted(tests, key=lambda t: t["p"])):  # Holm: stop at the first that holds
        if t["p"] > alpha / (m - i):
            break
        differ.append(t["position"])
    if len(empty) == 1 and positions:  # one side drafted, the other not: they differ from the first position
        differ.append(1)
    return {"differ": sorted(set(differ)), "tests": tests, "alpha": alpha, "empty": empty}


@torch.no_grad()
def pit_values(model, prompt_ids: list[int], output_ids: list[int], temperature: float,
               generator: torch.Generator) -> list[float]:
    """The randomised PIT of each sampled output token under the target at `temperature`, teacher-forced on the
    sample's own prefix (tokens ordered likeliest first, ties by id)."""
    if not output_ids:
        return []
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids + output_ids], device=device)
    logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1: -1].float()
    p = torch.softmax(logits / temperature, dim=-1)  # (n, V)
    x = torch.tensor(output_ids, device=device)
    px = p.gather(1, x[:, None])[:, 0]
    ids_v = torch.arange(p.shape[1], device=device)
    likelier = ((p > px[:, None]) | ((p == px[:, None]) & (ids_v[None] < x[:, None]))) * p
    v = torch.rand(len(output_ids), generator=generator).to(device)
    return (likelier.sum(1) + v * px).clamp(0.0, 1.0 - 1e-12).tolist()


def uniformity(u: list[float], bins: int = 10) -> dict:
    """Chi-square of PIT values against the uniform over `bins` equal bins: {"n", "needed", "chi2", "p", "counts"};
    below `needed` (5 expected per bin) chi2 and p are None: too few values to test, which the gate fails."""
    counts = [0] * bins
    for x in u:
        counts[min(bins - 1, int(x * bins))] += 1
    needed = 5 * bins
    if len(u) < needed:
        return {"n": len(u), "needed": needed, "chi2": None, "p": None, "counts": counts}
    res = stats.chisquare(counts)
    return {"n": len(u), "needed": needed, "chi2": float(res.statistic), "p": float(res.pvalue), "counts": counts}

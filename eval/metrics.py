"""Acceptance metrics with the names and definitions of docs/metrics.md, 'Definitions'.

a_k       per-position conditional acceptance: P(draft k accepted | drafts 1..k-1 accepted), k = 1..B-1
tau       acceptance length: mean over verify rounds of (accepted + 1), the bonus token included
tau_offline  simulated from teacher-forced a_k: 1 + sum_k prod_{j<=k} a_j
recall@K  per position: the target token is in the drafter's top-K, given positions 1..k-1 were correct (top-1)
"""
from __future__ import annotations

import statistics
from typing import TYPE_CHECKING

import torch

from dflash_pipeline.eval.protocol import CONTEXT, NOT_VERIFIED, drafter_blocks

if TYPE_CHECKING:
    from dflash_pipeline.runtime.progress import Progress
    from dflash_pipeline.models.drafter import DFlashDrafter


def median(xs) -> float:
    """The median of timings, 0.0 for none (a set without rounds of a kind)."""
    return statistics.median(xs) if xs else 0.0


def conditional_acceptance(correct: torch.Tensor, valid: torch.Tensor) -> tuple[list[float], list[int]]:
    """a_k from per-block correctness.

    correct, valid: (N, B-1) bool; correct[n, k-1] = draft k of block n equals the target token, valid = that
    position has a label. Returns a_k and the number of blocks that reached position k (its denominator).
    """
    reached = torch.ones(correct.shape[0], dtype=torch.bool, device=correct.device)
    rates, counts = [], []
    for k in range(correct.shape[1]):
        at_k = reached & valid[:, k]
        n = int(at_k.sum())
        rates.append(float((correct[:, k] & at_k).sum()) / n if n else 0.0)
        counts.append(n)
        reached = at_k & correct[:, k]
    return rates, counts


def simulated_tau(a: list[float]) -> float:
    """1 + sum_k prod_{j<=k} a_j: the expected accepted length (plus bonus) if positions were independent rounds."""
    tau, prod = 1.0, 1.0
    for rate in a:
        prod *= rate
        tau += prod
    return tau


def recall_at_k(top: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, ks: list[int]) -> dict[int, list[float]]:
    """Conditional Recall@K per position. top (N, B-1, >=max(ks)): the drafter's candidates, best first (topk
    indices of the logits); labels/valid (N, B-1).

    The condition is that every earlier position's top-1 was right (the drafted path is still alive), so Recall@1
    equals a_k and Recall@K > 1 bounds what a selector choosing among the top-K could reach.
    """
    top1 = top[..., 0] == labels
    out: dict[int, list[float]] = {k: [] for k in ks}
    reached = torch.ones(labels.shape[0], dtype=torch.bool, device=labels.device)
    for pos in range(labels.shape[1]):
        at = reached & valid[:, pos]
        n = int(at.sum())
        for k in ks:
            hit = (top[:, pos, :k] == labels[:, pos, None]).any(-1) & at
            out[k].append(float(hit.sum()) / n if n else 0.0)
        reached = at & top1[:, pos]
    return out


def accepted_length_stats(accepted: list[int], block_size: int) -> dict:
    """Online metrics from the accepted draft count of each verify round."""
    rounds = len(accepted)
    hist = [0] * block_size
    for n in accepted:
        hist[n] += 1
    # a_k online: of the rounds that accepted >= k-1 drafts, the fraction that accepted >= k
    a = []
    for k in range(1, block_size):
        reached = sum(hist[k - 1:])
        a.append(sum(hist[k:]) / reached if reached else 0.0)
    return {"rounds": rounds, "tau": (sum(accepted) + rounds) / rounds if rounds else 0.0, "a_k": a,
            "accepted_hist": hist}


def bootstrap_tau(per_prompt: list[list[int]], samples: int = 2000, seed: int = 0) -> list[float]:
    """95% interval of tau over prompts: per_prompt[i] the accepted counts of prompt i's rounds; prompts are resampled
    with replacement (rounds of one prompt are correlated, prompts are the independent units) and tau recomputed as
    (accepted + rounds) / rounds over the resample. [tau, tau] with a single prompt."""
    sums = torch.tensor([[sum(a) + len(a), len(a)] for a in per_prompt if a], dtype=torch.float64)
    if len(sums) == 0:
        return [0.0, 0.0]
    gen = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, len(sums), (samples, len(sums)), generator=gen)
    total = sums[pick].sum(1)  # (samples, 2)
    taus = (total[:, 0] / total[:, 1]).sort().values
    return [float(taus[int(0.025 * (samples - 1))]), float(taus[int(0.975 * (samples - 1))])]


def bootstrap_simulated_tau(correct: torch.Tensor, valid: torch.Tensor, owner: torch.Tensor, num_items: int,
                            samples: int = 2000, seed: int = 0) -> list[float]:
    """95% interval of tau_offline over sequences: blocks (correct, valid (N, P)) belong to sequence owner[n]; the
    sequences are resampled with replacement and a_k (reached-and-correct over reached, summed over the resample)
    turned into the simulated tau. [tau, tau] with a single sequence."""
    reached = torch.ones(correct.shape[0], dtype=torch.bool, device=correct.device)
    hits = torch.zeros(num_items, correct.shape[1], dtype=torch.float64)
    seen = torch.zeros_like(hits)
    for k in range(correct.shape[1]):
        at_k = reached & valid[:, k]
        seen[:, k].index_add_(0, owner.cpu(), at_k.double().cpu())
        hits[:, k].index_add_(0, owner.cpu(), (correct[:, k] & at_k).double().cpu())
        reached = at_k & correct[:, k]
    gen = torch.Generator().manual_seed(seed)
    weights = torch.zeros(samples, num_items, dtype=torch.float64)
    weights.scatter_add_(1, torch.randint(num_items, (samples, num_items), generator=gen),
                         torch.ones(samples, num_items, dtype=torch.float64))
    a = (weights @ hits) / (weights @ seen).clamp(min=1)  # (samples, P)
    taus = (1 + a.cumprod(-1).sum(-1)).sort().values
    return [float(taus[int(0.025 * (samples - 1))]), float(taus[int(0.975 * (samples - 1))])]


def oracle_acceptance(top: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, ks: list[int]) -> dict[int, list[float]]:
    """a_k of an oracle that picks the right token whenever it is among the drafter's top-K: P(label in top-K at k |
    labels in top-K at every earlier position). Its simulated tau is the ceiling of any choice among the top-K."""
    out = {}
    for k in ks:
        hit = (top[..., :k] == labels[..., None]).any(-1)  # (N, P)
        out[k], _ = conditional_acceptance(hit, valid)
    return out


def _contexts(input_ids: torch.Tensor, anchor_pos: torch.Tensor) -> torch.Tensor:
    """(N, CONTEXT) the tokens ending at each anchor, -1 before the sequence start (what RoundState.context holds
    online)."""
    pos = anchor_pos[:, None] + torch.arange(1 - CONTEXT, 1, device=anchor_pos.device)
    return torch.where(pos >= 0, input_ids.long()[pos.clamp(min=0)], -1)


@torch.no_grad()
def offline_metrics(drafter: DFlashDrafter, items: list[dict], block_size: int, ks: list[int],
                    chunk: int = 64, progress: Progress | None = None, methods: dict | None = None,
                    subset: int | None = None) -> dict:
    """Teacher-forced a_k, Recall@K, oracle tau@K and tau_offline over every anchor of `items` (input_ids,
    loss_mask, features): the drafter's own argmax path, and under "methods" the path each eval method would propose
    from the same drafter outputs (`methods`: {name: method with top_k and path(), eval/protocol.py}), with the
    histogram of drafts it would verify per block (verified_hist[v]: blocks verifying v drafts).

    Blocks of `block_size` (<= the trained size). A label outside a draft vocabulary counts as a miss.
    progress: counts one per item. subset: also each path's tau_offline over the first `subset` items only
    (`tau_offline_subset`: the prompts the online loop decodes, for a gap measured on the same prompts).
    """
    methods = methods or {}
    to_column = drafter.target_to_column()
    columns = drafter.config.vocab_size if drafter.draft_to_target is None else len(drafter.draft_to_target)
    kmax = min(max([*ks, *(m.top_k for m in methods.values())]), columns)
    top, target_labels, valid, owner, paths, scorings = _teacher_forced_blocks(drafter, items, block_size, kmax,
                                                                               chunk, progress, methods)
    label = to_column[target_labels]
    a, counts = conditional_acceptance(top[..., 0] == label, valid)
    rec = recall_at_k(top, label, valid, [k for k in ks if k <= kmax])
    oracle_ks = sorted({*ks, *(m.top_k for m in methods.values())})
    oracle = oracle_acceptance(top, label, valid, [k for k in oracle_ks if k <= kmax])
    first = owner < (len(items) if subset is None else subset)
    per_method = {name: _path_metrics(chosen, target_labels, valid, owner, len(items), first,
                                      scorings[name] / max(1, top.shape[0]))
                  for name, chosen in paths.items()}
    return {"a_k": a, "blocks_at_k": counts, "tau_offline": simulated_tau(a),
            "tau_offline_ci95": bootstrap_simulated_tau(top[..., 0] == label, valid, owner, len(items)),
            "recall": {str(k): v for k, v in rec.items()},
            "oracle_tau": {str(k): simulated_tau(v) for k, v in oracle.items()},
            "methods": per_method, "blocks": int(top.shape[0]), "sequences": len(items)}


def _teacher_forced_blocks(drafter: DFlashDrafter, items: list[dict], block_size: int, kmax: int, chunk: int,
                           progress: Progress | None, methods: dict) -> tuple:
    """One drafter forward per chunk of blocks over every anchor of `items`, kept as what the metrics read: the
    top-kmax draft columns (N, B-1, kmax), the target labels and their validity (N, B-1), the item owning each block
    (N,), each method's chosen path (N, B-1) and its scorings summed over blocks. The methods choose from the same
    outputs as the argmax path, so their figures differ by the choice alone."""
    device = drafter.norm.weight.device
    tops, labels, valids, owners = [], [], [], []
    paths: dict[str, list[torch.Tensor]] = {name: [] for name in methods}
    scorings: dict[str, int] = {name: 0 for name in methods}
    for it in items:
        h, b, keep = drafter_blocks(drafter, [it], block_size)  # h (N, B, H)
        context = _contexts(it["input_ids"].to(device), b["anchor_pos"][keep])
        for part, ids, ctx in zip(h.split(chunk), b["block_ids"][keep][:, 0].split(chunk), context.split(chunk)):
            logits = drafter.logits(part[:, 1:]).float()  # (n, B-1, V or Vd)
            top = logits.topk(kmax, dim=-1)
            tops.append(top.indices)
            for name, m in methods.items():
                chosen, work = m.path(drafter.to_target_ids(top.indices[..., :m.top_k]), top.values[..., :m.top_k],
                                      part, ids, ctx)
                paths[name].append(chosen)
                scorings[name] += work * len(ids)
        labels.append(b["labels"][keep])
        valids.append(b["label_valid"][keep])
        owners.append(torch.full((int(keep.sum()),), len(owners), dtype=torch.long))
        if progress is not None:
            progress.update()
    return (torch.cat(tops), torch.cat(labels), torch.cat(valids), torch.cat(owners).to(device),
            {name: torch.cat(chunks) for name, chunks in paths.items()}, scorings)


def _path_metrics(chosen: torch.Tensor, target_labels: torch.Tensor, valid: torch.Tensor, owner: torch.Tensor,
                  num_items: int, first: torch.Tensor, scorings_per_block: float) -> dict:
    """One method's teacher-forced figures from its chosen path (N, B-1; NOT_VERIFIED past its verify length): a_k;
    tau_offline, its 95% interval over sequences and its value on the `first` items alone; and the histogram of the
    drafts it would verify per block."""
    m_a, _ = conditional_acceptance(chosen == target_labels, valid)
    verified = (chosen != NOT_VERIFIED).long().cumprod(-1).sum(-1)  # drafts before the first NOT_VERIFIED
    return {"a_k": m_a, "tau_offline": simulated_tau(m_a),
            "tau_offline_ci95": bootstrap_simulated_tau(chosen == target_labels, valid, owner, num_items),
            "tau_offline_subset": simulated_tau(conditional_acceptance(
                (chosen == target_labels)[first], valid[first])[0]),
            "scorings_per_block": scorings_per_block,
            "verified_hist": torch.bincount(verified, minlength=chosen.shape[1] + 1).tolist()}

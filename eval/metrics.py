"""Acceptance metrics with the names and definitions of docs/metrics.md, 'Definitions'.

a_k       per-position conditional acceptance: P(draft k accepted | drafts 1..k-1 accepted), k = 1..B-1
tau       acceptance length: mean over verify rounds of (accepted + 1), the bonus token included
tau_offline  simulated from teacher-forced a_k: 1 + sum_k prod_{j<=k} a_j
recall@K  per position: the target token is in the drafter's top-K, given positions 1..k-1 were correct (top-1)
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dflash_pipeline.data.blocks import pack_blocks

if TYPE_CHECKING:
    from dflash_pipeline.conf.progress import Progress
    from dflash_pipeline.models.drafter import DFlashDrafter


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


@torch.no_grad()
def offline_metrics(drafter: DFlashDrafter, items: list[dict], block_size: int, ks: list[int],
                    chunk: int = 64, progress: Progress | None = None) -> dict:
    """Teacher-forced a_k, Recall@K and tau_offline over every anchor of `items` (input_ids, loss_mask, features).

    Blocks of `block_size` (<= the trained size). A label outside a draft vocabulary counts as a miss.
    progress: counts one per item.
    """
    device = drafter.norm.weight.device
    to_column = drafter.target_to_column()
    columns = drafter.config.vocab_size if drafter.draft_to_target is None else len(drafter.draft_to_target)
    kmax = min(max(ks), columns)
    tops, labels, valids = [], [], []
    for it in items:
        b = pack_blocks([it], block_size=block_size, mask_token_id=drafter.config.mask_token_id,
                        anchors_per_sequence=None)
        b = {k: v.to(device) for k, v in b.items()}
        hidden = drafter.forward_packed(b["features"], b["block_ids"], b["anchor_pos"], b["context_valid"],
                                        b["anchor_valid"])  # (1, Nb, B, H)
        keep = b["anchor_valid"]
        h = hidden[keep][:, 1:]  # (N, B-1, H)
        tops += [drafter.logits(part).topk(kmax, dim=-1).indices for part in h.split(chunk)]  # (n, B-1, kmax)
        labels.append(to_column[b["labels"][keep]])
        valids.append(b["label_valid"][keep])
        if progress is not None:
            progress.update()
    top, label, valid = torch.cat(tops), torch.cat(labels), torch.cat(valids)
    a, counts = conditional_acceptance(top[..., 0] == label, valid)
    rec = recall_at_k(top, label, valid, [k for k in ks if k <= kmax])
    return {"a_k": a, "blocks_at_k": counts, "tau_offline": simulated_tau(a),
            "recall": {str(k): v for k, v in rec.items()}, "blocks": int(top.shape[0]), "sequences": len(items)}

"""Packed multi-anchor blocks: what one drafter forward sees for a group of teacher sequences.

For every sequence, anchors are drawn from positions a whose next token is a reply token (loss_mask[a+1]); block
position k (1..B-1) of the anchor at a predicts the token at a + k (docs/methods.md, 'Packed training'). Labels
past the end of the sequence or on non-reply tokens are invalid. The block input is [token at a, MASK x (B-1)].
"""
from __future__ import annotations

import torch


def anchor_candidates(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions a with loss_mask[a + 1] set: the first drafted token is a reply token."""
    return (loss_mask[1:].nonzero().squeeze(-1)).long()


def pack_blocks(items: list[dict], *, block_size: int, mask_token_id: int, anchors_per_sequence: int | None,
                generators: list[torch.Generator] | None = None) -> dict[str, torch.Tensor]:
    """Pad and pack sequences into one drafter batch.

    items: teacher samples (input_ids (T,), loss_mask (T,), features (T, n*H)[, topk_ids/topk_logprobs (T, k)]).
    anchors_per_sequence: sample this many anchors without replacement (all candidates when None or when fewer),
    with the sequence's own generator (so a sequence's anchors do not depend on its batch-mates).
    Returns features (Bc, Tmax, n*H), context_valid (Bc, Tmax), block_ids (Bc, Nb, B), anchor_pos (Bc, Nb),
    anchor_valid (Bc, Nb), labels (Bc, Nb, B-1) target ids, label_valid (Bc, Nb, B-1), for top-k data
    topk_ids/topk_logprobs (Bc, Nb, B-1, k) aligned with the labels, and for items with the target's final hidden
    states (`final_hidden` (T, H)) verifier_hidden (Bc, Nb, H): the row before each anchor, which predicted it.
    """
    B = block_size
    chosen = []
    for s, it in enumerate(items):
        cand = anchor_candidates(it["loss_mask"])
        if anchors_per_sequence is not None and len(cand) > anchors_per_sequence:
            gen = generators[s] if generators else None
            cand = cand[torch.randperm(len(cand), generator=gen)[:anchors_per_sequence]].sort().values
        chosen.append(cand)
    Bc, T, Nb = len(items), max(len(it["input_ids"]) for it in items), max(1, max(len(c) for c in chosen))
    width = items[0]["features"].shape[-1]
    out = {
        "features": torch.zeros(Bc, T, width, dtype=items[0]["features"].dtype),
        "context_valid": torch.zeros(Bc, T, dtype=torch.bool),
        "block_ids": torch.full((Bc, Nb, B), mask_token_id, dtype=torch.long),
        "anchor_pos": torch.zeros(Bc, Nb, dtype=torch.long),
        "anchor_valid": torch.zeros(Bc, Nb, dtype=torch.bool),
        "labels": torch.zeros(Bc, Nb, B - 1, dtype=torch.long),
        "label_valid": torch.zeros(Bc, Nb, B - 1, dtype=torch.bool),
    }
    topk = "topk_ids" in items[0]
    if topk:
        k = items[0]["topk_ids"].shape[-1]
        out["topk_ids"] = torch.zeros(Bc, Nb, B - 1, k, dtype=torch.long)
        out["topk_logprobs"] = torch.zeros(Bc, Nb, B - 1, k)
    if "final_hidden" in items[0]:
        out["verifier_hidden"] = torch.zeros(Bc, Nb, items[0]["final_hidden"].shape[-1])
    offsets = torch.arange(1, B)
    for b, (it, anchors) in enumerate(zip(items, chosen)):
        n, na = len(it["input_ids"]), len(anchors)
        ids, mask = it["input_ids"].long(), it["loss_mask"].bool()
        out["features"][b, :n] = it["features"]
        out["context_valid"][b, :n] = True
        out["anchor_pos"][b, :na] = anchors
        out["anchor_valid"][b, :na] = True
        out["block_ids"][b, :na, 0] = ids[anchors]
        pos = anchors[:, None] + offsets  # (na, B-1) positions of the labels
        inside = pos < n
        pos = pos.clamp(max=n - 1)
        out["labels"][b, :na] = it["targets"].long()[pos] if "targets" in it else ids[pos]
        out["label_valid"][b, :na] = inside & mask[pos]
        if topk:
            out["topk_ids"][b, :na] = it["topk_ids"][pos].long()
            out["topk_logprobs"][b, :na] = it["topk_logprobs"][pos].float()
        if "verifier_hidden" in out:
            out["verifier_hidden"][b, :na] = it["final_hidden"][(anchors - 1).clamp(min=0)].float()
    return out

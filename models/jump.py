"""DFlash5 jump heads: a few cheap low-rank heads that pin tokens at sparse block positions, and the decoding that
fills the gaps between the pinned tokens.

The drafter predicts every block position independently (marginals), so a chain of argmaxes can switch between two
plausible continuations halfway through a block. A jump head at offset o re-ranks the drafter's top-K candidates at
o from the drafter's own hidden state one position earlier (h_{o-1}, which has attended to the whole block), and
only where it is confident (margin gate) its choice becomes a fixed token. Gaps between fixed tokens are then filled
either with the drafter's per-position argmax or, given a transition scorer such as the pair selector, with a small
Viterbi that must connect the left and the right fixed token. No extra model forward: everything reads hidden
states and logits the drafter already produced; the added cost is J*K codebook dot products of rank r.

Shapes: N rows (blocks), B block size (position 0 is the anchor, 1..B-1 are drafted), P = B - 1 drafted positions,
H drafter hidden, J offsets, K candidates per position, r rank, V target vocabulary, k teacher top-k.
Candidates are always target token ids (map draft-vocabulary columns with `DFlashDrafter.to_target_ids`).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn

# The jump heads' tensors in a component export are named under this prefix (docs/export.md).
JUMP_PREFIX = "jump_heads."

# transition(hidden (M, H), prev_ids (M, Kp), cand_ids (M, Ks)) -> (M, Kp, Ks): the pair score of predecessor
# prev_ids[m, a] followed by candidate cand_ids[m, b], read from the drafter hidden state at the candidate's position.
# It is added to the candidate's drafter logit U (so it must not include U itself).
Transition = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def default_offsets(block_size: int, every: int = 4) -> list[int]:
    """Block positions every, 2*every, ... below block_size (4, 8, 12 for B = 16). Position 0 is the anchor, known
    before drafting, so it is never an offset and the count starts from it: offset o sits o tokens after the anchor."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    offsets = list(range(every, block_size, every))
    if not offsets:
        raise ValueError(f"block_size {block_size} has no drafted position at a multiple of {every}")
    return offsets


def check_offsets(offsets: list[int], block_size: int) -> list[int]:
    """The offsets as ints, or ValueError unless they are strictly increasing drafted positions 1 .. B-1."""
    offsets = [int(o) for o in offsets]
    if not offsets or any(b <= a for a, b in zip(offsets, offsets[1:])) or not 1 <= offsets[0] \
            or offsets[-1] >= block_size:
        raise ValueError(f"offsets {offsets} must be strictly increasing block positions in 1 .. {block_size - 1}")
    return offsets


class JumpHeads(nn.Module):
    """One low-rank head per offset o_j: q_j = tanh(W h_{o_j - 1} + e_j), residual(c) = <q_j, C[c]> / sqrt(r).

    state_dict (stable names, what a checkpoint stores):
      projection.weight      [r, H]  W, shared by all offsets (no bias: e_j plays that role per offset)
      offset_embedding.weight [J, r] e_j, row j for offsets[j]
      codebook               [V, r]  C over the target vocabulary
    The codebook starts at zero, so every residual is zero and the heads start as the plain drafter (the anchor
    choice is the drafter's argmax); W and e get gradients once C has moved. e starts small so q_j is driven by
    the hidden state; W keeps nn.Linear's default init (about unit-variance W h for RMS-normed hidden states).
    """

    def __init__(self, vocab_size: int, hidden_size: int, block_size: int, offsets: list[int], rank: int = 64):
        super().__init__()
        offsets = check_offsets(offsets, block_size)
        self.vocab_size, self.hidden_size, self.block_size, self.rank = vocab_size, hidden_size, block_size, rank
        self.offsets = offsets
        self.register_buffer("offset_positions", torch.tensor(offsets), persistent=False)  # (J,) for indexing
        self.projection = nn.Linear(hidden_size, rank, bias=False)
        self.offset_embedding = nn.Embedding(len(offsets), rank)
        self.codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        nn.init.normal_(self.offset_embedding.weight, std=0.02)

    @property
    def num_offsets(self) -> int:
        return len(self.offsets)

    def hidden_before(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full block hidden (N, B, H) -> (N, J, H) at block positions o_j - 1: the head for o_j reads the state
        just before it (the drafter's own state at o_j already produced U there)."""
        if hidden.shape[-2] != self.block_size:
            raise ValueError(f"hidden has {hidden.shape[-2]} block positions, the heads were built for "
                             f"block_size {self.block_size}")
        return hidden[:, self.offset_positions - 1]

    def residuals(self, hidden_prev: torch.Tensor, cand_ids: torch.Tensor) -> torch.Tensor:
        """hidden_prev (N, J, H) at o_j - 1; cand_ids (N, J, K) target ids at o_j -> residuals (N, J, K) float32."""
        q = torch.tanh(self.projection(hidden_prev.to(self.projection.weight.dtype))
                       + self.offset_embedding.weight)  # (N, J, r)
        codes = self.codebook[cand_ids]  # (N, J, K, r)
        return (codes @ q.unsqueeze(-1)).squeeze(-1).float() / math.sqrt(self.rank)

    def scores(self, hidden: torch.Tensor, cand_ids: torch.Tensor, U: torch.Tensor,
               weight: float = 1.0) -> torch.Tensor:
        """Anchor scores at the offsets: U + w * (residual - max residual over the K candidates), (N, J, K) float32.

        hidden (N, B, H) full block; cand_ids, U (N, J, K) at the offsets. Subtracting the max leaves argmax,
        margin and softmax unchanged; it keeps the scores at or below the drafter's logits, on U's scale."""
        res = self.residuals(self.hidden_before(hidden), cand_ids)
        return U.float() + weight * (res - res.amax(-1, keepdim=True))


def choose_anchors(heads: JumpHeads, hidden: torch.Tensor, cand_ids: torch.Tensor, U: torch.Tensor,
                   margin: float, weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per offset, the candidate with the best jump score and whether it is fixed.

    cand_ids, U (N, P, K) over all drafted positions; hidden (N, B, H). Returns choice (N, J), an index into the K
    candidates at o_j, and keep (N, J) bool: top-1 minus top-2 score >= margin (margin=-inf fixes every offset,
    +inf none; with K = 1 the margin is +inf, a lone candidate is certain)."""
    at = heads.offset_positions - 1  # array index of block position o_j
    score = heads.scores(hidden, cand_ids[:, at], U[:, at], weight)  # (N, J, K)
    top = score.topk(min(2, score.shape[-1]), dim=-1)
    gap = (top.values[..., 0] - top.values[..., 1] if score.shape[-1] > 1
           else torch.full_like(top.values[..., 0], math.inf))
    return top.indices[..., 0], gap >= margin


@torch.no_grad()
def guided_path(cand_ids: torch.Tensor, U: torch.Tensor, hidden: torch.Tensor, anchor_ids: torch.Tensor,
                heads: JumpHeads, margin: float, weight: float = 1.0,
                transition: Transition | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft path per block: fix the confident jump anchors, then fill the gaps between fixed tokens.

    cand_ids (N, P, K) target ids and U (N, P, K) drafter logits of the top-K at block positions 1..P; hidden (N, B, H)
    the drafter's full block hidden (B = P + 1); anchor_ids (N,) the committed token at position 0.

    Gap fill:
    - transition=None: each free position takes the argmax of U (the chain path on marginals).
    - with a transition scorer: the path maximises sum of U + transition over every free position, where the
      transition into a position is scored from its predecessor (the anchor before position 1) and the transition
      from the last free position INTO the next fixed token is included, so each gap is a Viterbi pinned at both
      ends. Fixed tokens split the block into independent gaps, so one constrained Viterbi over the block is the
      same as one Viterbi per gap.

    Returns ids (N, P) target ids and work (N,) long: candidate scorings this round, J*K for the heads plus K per
    free position (greedy) or, with a transition, Kp*Ks per scored transition (1 state at a fixed token or the
    anchor, K elsewhere; transitions between two fixed tokens are not scored).
    """
    N, P, K = cand_ids.shape
    if hidden.shape[1] != P + 1:
        raise ValueError(f"hidden must be the full block (N, {P + 1}, H), got {tuple(hidden.shape)}")
    choice, keep = choose_anchors(heads, hidden, cand_ids, U, margin, weight)  # (N, J)
    at = heads.offset_positions - 1
    fixed = torch.zeros(N, P, dtype=torch.bool, device=cand_ids.device)
    fixed[:, at] = keep
    fixed_ids = torch.zeros(N, P, dtype=torch.long, device=cand_ids.device)
    fixed_ids[:, at] = cand_ids[:, at].gather(-1, choice.unsqueeze(-1)).squeeze(-1)
    ids, work = fill_gaps(cand_ids, U, hidden, anchor_ids, fixed, fixed_ids, transition)
    return ids, work + heads.num_offsets * K


@torch.no_grad()
def fill_gaps(cand_ids: torch.Tensor, U: torch.Tensor, hidden: torch.Tensor, anchor_ids: torch.Tensor,
              fixed: torch.Tensor, fixed_ids: torch.Tensor,
              transition: Transition | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The gap fill of `guided_path` around tokens fixed by anyone (the fused heads, the separate head of
    models/jump_head.py): fixed (N, P) bool, fixed_ids (N, P) target ids, read where fixed; other arguments as
    guided_path. Fixed positions keep their token; the others take the argmax of U (transition=None) or the pinned
    Viterbi. A fixed token outside the position's top-K takes the place of its last candidate: a fixed position
    has one state, so its other candidates are never used, and its U is the same on every path.

    Returns ids (N, P) target ids and work (N,) long: the gap fill's candidate scorings only (K per free position,
    or the scored transitions; see guided_path)."""
    N, P, K = cand_ids.shape
    if hidden.shape[1] != P + 1:
        raise ValueError(f"hidden must be the full block (N, {P + 1}, H), got {tuple(hidden.shape)}")
    fixed = fixed.bool()
    if transition is None:
        free = cand_ids.gather(-1, U.argmax(-1, keepdim=True)).squeeze(-1)
        return torch.where(fixed, fixed_ids, free), K * (~fixed).sum(-1)
    match = fixed.unsqueeze(-1) & (cand_ids == fixed_ids.unsqueeze(-1))  # (N, P, K)
    outside = fixed & ~match.any(-1)
    if outside.any():
        cand_ids = cand_ids.clone()
        cand_ids[..., -1] = torch.where(outside, fixed_ids, cand_ids[..., -1])
        match[..., -1] |= outside
    fixed_idx = match.int().argmax(-1)  # the first matching candidate
    idx, work = _pinned_viterbi(cand_ids, U.float(), hidden, anchor_ids, fixed, fixed_idx, transition)
    return cand_ids.gather(-1, idx.unsqueeze(-1)).squeeze(-1), work


def _pinned_viterbi(cand_ids, U, hidden, anchor_ids, fixed, fixed_idx, transition):
    """Viterbi over the K x K candidate lattice with the fixed positions pinned to one state. Lattice layer 0 is
    the anchor (state 0 only). Only the transitions a gap needs are scored, in three batched calls by shape:
    fixed -> free (1 x K), free -> free (K x K), free -> fixed (K x 1). Returns idx (N, P) into K, work (N,)."""
    N, P, K = cand_ids.shape
    device = cand_ids.device
    prev_fixed = torch.cat([torch.ones_like(fixed[:, :1]), fixed[:, :-1]], dim=1)  # (N, P); the anchor is fixed
    prev_idx = torch.cat([torch.zeros_like(fixed_idx[:, :1]), fixed_idx[:, :-1]], dim=1)
    prev_ids = torch.cat([anchor_ids[:, None, None].expand(N, 1, K), cand_ids[:, :-1]], dim=1)  # (N, P, K)
    h = hidden[:, 1:]  # (N, P, H) at the successor's block position
    T = torch.full((N, P, K, K), -math.inf, device=device)  # T[n, p, a, b]: transition a (at p - 1) -> b (at p)
    work = torch.zeros(N, dtype=torch.long, device=device)

    n, p = (prev_fixed & ~fixed).nonzero(as_tuple=True)
    if len(n):
        a = prev_idx[n, p]
        s = transition(h[n, p], prev_ids[n, p].gather(-1, a[:, None]), cand_ids[n, p])  # (M, 1, K)
        T[n, p, a] = s[:, 0].float()
        work.index_add_(0, n, torch.full_like(n, K))
    n, p = (~prev_fixed & ~fixed).nonzero(as_tuple=True)
    if len(n):
        T[n, p] = transition(h[n, p], prev_ids[n, p], cand_ids[n, p]).float()  # (M, K, K)
        work.index_add_(0, n, torch.full_like(n, K * K))
    n, p = (~prev_fixed & fixed).nonzero(as_tuple=True)
    if len(n):
        b = fixed_idx[n, p]
        s = transition(h[n, p], prev_ids[n, p], cand_ids[n, p].gather(-1, b[:, None]))  # (M, K, 1)
        T[n, p, :, b] = s[..., 0].float()
        work.index_add_(0, n, torch.full_like(n, K))
    n, p = (prev_fixed & fixed).nonzero(as_tuple=True)
    T[n, p, prev_idx[n, p], fixed_idx[n, p]] = 0.0  # constant along the path: not scored

    delta = torch.full((N, K), -math.inf, device=device)
    delta[:, 0] = 0.0
    back = []
    for i in range(P):
        best, arg = (delta[:, :, None] + T[:, i] + U[:, i, None, :]).max(dim=1)  # (N, K)
        back.append(arg)
        delta = best
    idx = torch.empty(N, P, dtype=torch.long, device=device)
    idx[:, -1] = delta.argmax(-1)
    for i in range(P - 1, 0, -1):
        idx[:, i - 1] = back[i].gather(1, idx[:, i:i + 1]).squeeze(1)
    return idx, work


def jump_loss(heads: JumpHeads, hidden: torch.Tensor, cand_ids: torch.Tensor, U: torch.Tensor, labels: torch.Tensor,
              valid: torch.Tensor, teacher_logprobs: torch.Tensor | None = None,
              teacher_ids: torch.Tensor | None = None, kl_weight: float = 0.0, weight: float = 1.0,
              position_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Training loss of the heads on a frozen drafter: CE of the teacher token among the K candidates at each offset.

    hidden (N, B, H) full block hidden (detached); cand_ids, U (N, J, K) target ids / drafter logits at the offsets;
    labels (N, J) teacher target ids at the offsets; valid (N, J) bool; position_weights (N, J) optional factor
    (e.g. the drafter's decay weights). Scores are U + weight * residual, as at decode time.

    Offsets whose label is not among the K candidates are skipped (the heads can only re-rank) and counted.
    kl_weight mixes per scored offset (1 - kl_weight) * CE + kl_weight * KL(teacher || heads), the teacher being
    its top-k log-probs (N, J, k) at ids (N, J, k) restricted to the candidates and renormalised; an offset where
    the teacher's top-k misses every candidate keeps plain CE.

    Returns the loss SUM over scored offsets (normalise outside, as the training loop sees fit) and detached
    counts: scored, skipped (recall = scored / (scored + skipped)), correct (argmax of the jump score = label),
    correct_marginal (argmax of U = label, the drafter alone).
    """
    if not 0.0 <= kl_weight <= 1.0:
        raise ValueError(f"kl_weight must lie in [0, 1], got {kl_weight}")
    if kl_weight > 0 and (teacher_logprobs is None or teacher_ids is None):
        raise ValueError("kl_weight > 0 needs teacher_logprobs and teacher_ids")
    score = heads.scores(hidden, cand_ids, U, weight)  # (N, J, K)
    match = cand_ids == labels.unsqueeze(-1)  # (N, J, K)
    in_top = match.any(-1)
    valid = valid.bool()
    scored, skipped = valid & in_top, valid & ~in_top
    target = match.int().argmax(-1, keepdim=True)  # (N, J, 1) first matching candidate
    logp = score.log_softmax(-1)
    loss = -logp.gather(-1, target).squeeze(-1)  # (N, J)

    if kl_weight > 0:
        same = cand_ids.unsqueeze(-1) == teacher_ids.unsqueeze(-2)  # (N, J, K, k)
        teacher = torch.where(same, teacher_logprobs.float().unsqueeze(-2), -math.inf).amax(-1)  # (N, J, K)
        has_mass = torch.isfinite(teacher).any(-1)
        p = torch.where(has_mass.unsqueeze(-1), teacher, 0.0).softmax(-1)  # 0 off the teacher's top-k
        kl = torch.where(p > 0, p * (p.log() - logp), 0.0).sum(-1)  # 0 * -inf stays 0 (masked candidates)
        loss = torch.where(has_mass, (1 - kl_weight) * loss + kl_weight * kl, loss)

    if position_weights is not None:
        loss = loss * position_weights
    loss_sum = torch.where(scored, loss, 0.0).sum()
    with torch.no_grad():
        stats = {
            "scored": scored.sum(),
            "skipped": skipped.sum(),
            "correct": (scored & (score.argmax(-1, keepdim=True) == target).squeeze(-1)).sum(),
            "correct_marginal": (scored & (U.argmax(-1, keepdim=True) == target).squeeze(-1)).sum(),
        }
    return loss_sum, stats

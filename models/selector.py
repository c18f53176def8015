"""DFlash2 pair-codebook selector: picks one of the drafter's top-K candidates per position, looking at the token
picked just before it.

The block drafter scores each position of a block on its own (marginals). Where the continuation forks, its
per-position argmax can join the first half of one branch to the second half of another. The selector rescores the
K best candidates of each position with a term that depends on the previous token, so a path can stay on one branch:

    S_t(a, b) = U_t(b) + < A[a] * W h_t , B[b] >

U_t(b) is the drafter's logit of candidate b at drafted position t, h_t its post-final-norm hidden state there, a the
token picked at t-1 (the anchor for the first drafted position). A (predecessor) and B (successor) are (V, r)
codebooks over the TARGET vocabulary, also when the drafter has a reduced draft vocabulary; W (r, H) projects h_t.

Decoding: `greedy_walk` (left to right, argmax), `viterbi` (best whole path), `sample_walk` (T > 0; also returns the
distributions the tokens were drawn from, which speculative sampling needs). Training: `selector_loss` (teacher
forcing; the drafter is frozen).

Shapes: N blocks, P drafted positions per block (block size - 1), K candidates per position, M predecessors,
H drafter hidden size, r rank, V target vocabulary size.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn


# The DFlash2 checkpoint's selector tensors are named under this prefix (docs/export.md).
SELECTOR_PREFIX = "candidate_selector."
# A DFlash2 drafter exported without a trained selector carries one that scores nothing (zero codebooks): the
# engine's walk over its top-2 then picks each position's argmax, the chain.
PASS_THROUGH = {"selector_rank": 1, "selector_top_k": 2}


def pass_through_tensors(vocab_size: int, hidden_size: int) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of the selector that scores nothing (PASS_THROUGH)."""
    r = PASS_THROUGH["selector_rank"]
    return {SELECTOR_PREFIX + "hidden_projection.weight": torch.zeros(r, hidden_size),
            SELECTOR_PREFIX + "predecessor_codebook": torch.zeros(vocab_size, r),
            SELECTOR_PREFIX + "successor_codebook": torch.zeros(vocab_size, r)}


class PairSelector(nn.Module):
    """The selector's weights: state_dict keys `hidden_projection.weight` (r, H), `predecessor_codebook` (V, r) and
    `successor_codebook` (V, r), the DFlash2 checkpoint names without their `candidate_selector.` prefix.

    Init: the successor codebook starts at zero, so the transition term is exactly 0 and a new selector decodes
    exactly as the marginal drafter (argmax of U); training can only move it away from there. The predecessor
    codebook (normal, std 1, as nn.Embedding) and the projection (nn.Linear's default) start random, so the first
    gradient reaches the zero codebook (with two of the three factors at zero, none would move).
    """

    def __init__(self, vocab_size: int, hidden_size: int, rank: int = 256, top_k: int = 16):
        super().__init__()
        self.vocab_size, self.hidden_size, self.rank, self.top_k = vocab_size, hidden_size, rank, top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.reset_parameters()

    def reset_parameters(self):
        self.hidden_projection.reset_parameters()
        nn.init.normal_(self.predecessor_codebook)
        nn.init.zeros_(self.successor_codebook)

    def config_dict(self) -> dict:
        """The `dflash_config` keys of a DFlash2 export."""
        return {"selector_rank": self.rank, "selector_top_k": self.top_k}

    # ---- scores ----

    def transition(self, hidden: torch.Tensor, prev_ids: torch.Tensor, cand_ids: torch.Tensor) -> torch.Tensor:
        """The pair term <A[a] * W h, B[b]> for every predecessor a and candidate b of one position, in one batched
        product: hidden (..., H); prev_ids (..., M), cand_ids (..., K) target ids -> (..., M, K).

        M = K (the previous position's candidates) scores all K x K pairs (Viterbi); M = 1 one walk step or a
        teacher-forced training position."""
        proj = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))  # (..., r)
        query = self.predecessor_codebook[prev_ids] * proj.unsqueeze(-2)  # (..., M, r)
        keys = self.successor_codebook[cand_ids]  # (..., K, r)
        return query @ keys.transpose(-1, -2)

    def scores(self, U: torch.Tensor, hidden: torch.Tensor, prev_ids: torch.Tensor,
               cand_ids: torch.Tensor) -> torch.Tensor:
        """S(a, b) = U(b) + transition(a, b): U (..., K) the drafter's logits of the candidates, other arguments as
        `transition` -> (..., M, K) in float32."""
        return U.float().unsqueeze(-2) + self.transition(hidden, prev_ids, cand_ids).float()

    # ---- decoding: inputs cand_ids (N, P, K) target ids, U (N, P, K), hidden (N, P, H), anchor_ids (N,) ----

    def _walk(self, cand_ids, U, hidden, anchor_ids, temperature: float, generator):
        """Left to right, each position conditioned on the token picked before it. Returns ids (N, P) and, when
        sampling, the candidate probabilities (N, P, K) the picks were drawn from."""
        prev, picks, probs = anchor_ids, [], []
        for t in range(cand_ids.shape[1]):
            s = self.scores(U[:, t], hidden[:, t], prev[:, None], cand_ids[:, t])[:, 0]  # (N, K)
            if temperature <= 0:
                idx = s.argmax(-1)
            else:
                probs.append(torch.softmax(s / temperature, dim=-1))
                idx = torch.multinomial(probs[-1], 1, generator=generator)[:, 0]
            prev = cand_ids[:, t].gather(1, idx[:, None])[:, 0]
            picks.append(prev)
        return torch.stack(picks, 1), (torch.stack(probs, 1) if probs else None)

    @torch.no_grad()
    def greedy_walk(self, cand_ids, U, hidden, anchor_ids) -> torch.Tensor:
        """The upstream decoder: argmax_b S_t(prev, b) at each position, prev the token just picked. -> (N, P)."""
        return self._walk(cand_ids, U, hidden, anchor_ids, 0.0, None)[0]

    @torch.no_grad()
    def sample_walk(self, cand_ids, U, hidden, anchor_ids, temperature: float,
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw each position from softmax(S_t(prev, .) / T) over its K candidates -> (ids (N, P), q (N, P, V)).

        q[n, t] is the distribution over the target vocabulary that ids[n, t] was drawn from, given the tokens drawn
        before it (zero outside the candidates). Speculative sampling stays exact with it: the target checks draft t
        only after accepting drafts 1 .. t-1, which are the very predecessors q[n, t] was conditioned on."""
        if temperature <= 0:
            raise ValueError("sample_walk needs temperature > 0; use greedy_walk or viterbi at T = 0")
        ids, probs = self._walk(cand_ids, U, hidden, anchor_ids, temperature, generator)
        q = probs.new_zeros(*ids.shape, self.vocab_size).scatter_add_(-1, cand_ids, probs)
        return ids, q

    @torch.no_grad()
    def viterbi(self, cand_ids, U, hidden, anchor_ids, normalize: bool = True) -> torch.Tensor:
        """The best whole path through the K x K transitions, exactly, in O(P K^2) -> (N, P).

        normalize (default): maximise the sum of log softmax_b S_t(a, b), the path's log-probability under the model
        `selector_loss` trains (softmax over the K candidates given the predecessor). Raw S would favour a
        predecessor whose whole row is high, which says nothing about its successor. normalize=False: sum of raw S.
        """
        N, P, K = cand_ids.shape
        prev = torch.cat([anchor_ids[:, None, None].expand(N, 1, K), cand_ids[:, :-1]], 1)  # row t: candidates of t-1
        s = self.scores(U, hidden, prev, cand_ids)  # (N, P, K prev, K next); at t = 0 every row is the anchor's
        if normalize:
            s = s.log_softmax(-1)
        best, back = s[:, 0, 0], []  # best: (N, K) score of the best path ending in each candidate
        for t in range(1, P):
            best, arg = (best[:, :, None] + s[:, t]).max(1)
            back.append(arg)
        idx = best.argmax(-1)
        path = [idx]
        for arg in reversed(back):
            idx = arg.gather(1, idx[:, None])[:, 0]
            path.append(idx)
        return cand_ids.gather(2, torch.stack(path[::-1], 1)[..., None])[..., 0]


def scorings_per_round(method: str, positions: int, top_k: int) -> int:
    """Candidate scorings (pairs (a, b) through the bilinear term) one block costs: greedy and sample walks score K
    candidates per position, Viterbi K x K (the first position's K rows all hold the anchor)."""
    per_position = {"greedy": top_k, "sample": top_k, "viterbi": top_k * top_k}
    if method not in per_position:
        raise ValueError(f"unknown selector decoding {method!r}; use one of {sorted(per_position)}")
    return positions * per_position[method]


def top_candidates(logits: torch.Tensor, top_k: int,
                   to_target_ids: Callable[[torch.Tensor], torch.Tensor] | None = None):
    """The drafter's K best candidates, best first: logits (..., V or Vd) -> (target ids (..., K), U (..., K) float32).
    to_target_ids maps logit columns to target ids when the drafter has a draft vocabulary
    (DFlashDrafter.to_target_ids)."""
    U, idx = logits.float().topk(top_k, dim=-1)
    return (idx if to_target_ids is None else to_target_ids(idx)), U


def selector_loss(selector: PairSelector, hidden: torch.Tensor, cand_ids: torch.Tensor, U: torch.Tensor,
                  prev_true: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                  weights: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Teacher-forced cross-entropy over the K candidates of the true token, given the TRUE previous token.

    hidden (N, P, H), cand_ids (N, P, K) target ids, U (N, P, K): the drafter's outputs (detach them to keep the
    drafter frozen); prev_true (N, P): the true token before each position (the anchor at the first); labels (N, P);
    valid (N, P) bool; weights (P,) or (N, P): the drafter's position weights.

    A position whose true token is not among the K candidates cannot be selected at any temperature: it is skipped,
    and counted (candidate recall = scored / (scored + skipped)). Returns (weighted loss SUM, stats); stats are 0-d
    tensors, not synced: scored, skipped, weight (sum of the weights scored), selector_correct (the selector's argmax
    given the true predecessor is the label), marginal_correct (the drafter's argmax is the label; both counted over
    scored positions).
    """
    hit = cand_ids == labels[..., None]  # (N, P, K)
    in_top = hit.any(-1)
    valid = valid.bool()
    scored = valid & in_top
    target = hit.int().argmax(-1)  # the label's candidate index (0 where absent: masked below)
    prev = torch.where(valid, prev_true, 0)  # padding may hold ids no codebook row has (-100)
    s = selector.scores(U, hidden, prev[..., None], cand_ids)[..., 0, :]  # (N, P, K)
    ce = F.cross_entropy(s.flatten(0, 1), target.flatten(), reduction="none").view_as(target)
    w = torch.where(scored, weights.to(ce.dtype).expand_as(ce), 0.0)
    loss = torch.where(scored, ce * w, 0.0).sum()  # where, not a product: padded positions may hold non-finite values
    stats = {
        "scored": scored.sum(),
        "skipped": (valid & ~in_top).sum(),
        "weight": w.sum().detach(),
        "selector_correct": (scored & (s.argmax(-1) == target)).sum(),
        "marginal_correct": (scored & (U.argmax(-1) == target)).sum(),
    }
    return loss, stats

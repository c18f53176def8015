"""The method protocol every decoding loop shares, and the target primitives under it.

A method proposes the drafts of one speculative round (eval/decode.py runs the rounds): it sees a RoundState and
returns a Proposal. ChainMethod is the DFlash block drafter (each position's argmax) and the base of every block
method: a subclass overrides `path` (greedy; its teacher-forced metrics use the same `path`) and `sample_path`
(temperature > 0), or declares itself `greedy_only`. A path may verify fewer drafts than the block holds by marking
the unverified tail NOT_VERIFIED. Tree methods (eval/tree.py) return a Proposal with a DraftTree.

This module imports nothing of the project above models/ and data/, so the decoding loop, the metrics, the trees, the
policies and the components' methods all build on it without importing each other.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from transformers import DynamicCache

from dflash_pipeline.data.blocks import pack_blocks
from dflash_pipeline.models.drafter import DFlashDrafter
from dflash_pipeline.models.families import tapped


NOT_VERIFIED = -1  # a path's drafts from here on are not verified this round (offline: they count as rejected)
CONTEXT = 8  # committed tokens, ending at the anchor, that a method sees as its context (RoundState.context)


# -- small helpers -----------------------------------------------------------------------------------------------
def device_of(model) -> torch.device:
    return next(model.parameters()).device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


class TargetStep(NamedTuple):
    logits: torch.Tensor  # (T, V), or (1, V): the last row only
    features: torch.Tensor  # (T, n*Ht) tapped features
    final: torch.Tensor  # (T, Ht) the final (normed) hidden states, the rows the LM head reads


def target_forward(model, ids: torch.Tensor, positions: torch.Tensor, cache: DynamicCache, layer_ids: list[int],
                   last_only: bool = False, attention_mask: torch.Tensor | None = None) -> TargetStep:
    """One target forward of ids (1, T) at positions (1, T) on `cache` (extended in place); attention_mask: a
    custom 4-D mask (tree verification), None = causal.

    Returns logits (T, V) (only the last row with last_only), tapped features (T, n*Ht): the concatenation of
    hidden_states[i + 1] for i in layer_ids, as the teacher's capture() stores them, and the final hidden states.
    """
    extra = {} if attention_mask is None else {"attention_mask": attention_mask}
    out = model(input_ids=ids, position_ids=positions, cache=cache, use_cache=True, output_hidden_states=True,
                logits_to_keep=1 if last_only else 0, **extra)
    feats = tapped(out.hidden_states, layer_ids)  # (1, T, n*Ht)
    return TargetStep(out.logits[0], feats[0], out.hidden_states[-1][0])


# -- methods: who proposes the drafts ----------------------------------------------------------------------------
@dataclass
class RoundState:
    """What a method sees at the start of a round."""

    new_features: torch.Tensor  # (1, Tn, n*Ht) tapped target features of the tokens committed since the last round
    new_positions: torch.Tensor  # (Tn,) their positions
    anchor: int  # the token at anchor_pos (committed by the target, features not yet known)
    anchor_pos: int  # L: committed tokens before the anchor
    output: list[int]  # generated so far, ending with the anchor
    context: list[int] = field(default_factory=list)  # the last CONTEXT committed tokens (prompt included), anchor last
    verifier_hidden: torch.Tensor | None = None  # (Ht,) the target's final hidden state of the row that chose the anchor


@dataclass
class Proposal:
    tokens: torch.Tensor  # (B-1,) target token ids for positions L+1 .. L+B-1
    q: torch.Tensor | None = None  # (B-1, V) the distributions the tokens were sampled from (sampling only)
    select_s: float = 0.0  # time spent choosing among the candidates (after the drafter's forward)
    scorings: int = 0  # candidate scorings the choice took
    drafted: bool = True  # False: the method skipped the drafter this round (no drafts; a plain target step)
    tree: object | None = None  # a DraftTree (eval/tree.py) of the drafts in `tokens`: verified as a tree


def drafter_blocks(drafter: DFlashDrafter, items: list[dict], block_size: int, anchors_per_sequence: int | None = None,
                   generators=None) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """The drafter's forward over the packed anchor blocks of `items` (data/blocks.py pack_blocks; None: every
    anchor), as offline metrics and the components on a frozen drafter see it: (post-norm hidden (N, B, H) of the
    real blocks, anchor first; the packed batch on the drafter's device; keep, its mask of the real blocks)."""
    b = pack_blocks(items, block_size=block_size, mask_token_id=drafter.config.mask_token_id,
                    anchors_per_sequence=anchors_per_sequence, generators=generators)
    b = {k: v.to(drafter.norm.weight.device) for k, v in b.items()}
    keep = b["anchor_valid"]
    hidden = drafter.forward_packed(b["features"], b["block_ids"], b["anchor_pos"], b["context_valid"], keep)
    return hidden[keep], b, keep


def candidates(drafter: DFlashDrafter, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's top-k per position: (target ids, logits), each (..., P, k), best first. hidden (..., P, H)."""
    logits = drafter.logits(hidden).float()
    top = logits.topk(min(k, logits.shape[-1]), dim=-1)
    return drafter.to_target_ids(top.indices), top.values


class ChainMethod:
    """The DFlash block drafter: one forward drafts the whole block (docs/methods.md, 'The drafter'), and each
    position takes its own argmax.

    The drafter's context K/V live in a DrafterCache across rounds; only committed tokens ever enter it, so it
    never needs a rollback. The block itself is not cached. Subclasses choose differently by overriding `path`
    (greedy) and `sample_path` (temperature > 0) over the top `top_k` candidates.
    """

    name = "chain"
    top_k = 1

    def __init__(self, drafter: DFlashDrafter):
        self.drafter = drafter
        self.layer_ids = list(drafter.config.target_layer_ids)
        self.max_block_size = drafter.config.block_size
        self.cache = None

    def start(self) -> None:
        self.cache = self.drafter.new_cache()

    greedy_only = False  # True: the method has no sampling distribution q, so speculative sampling cannot run it

    def check(self, block_size: int, temperature: float) -> None:
        """Raise ValueError when the method cannot run at this block size / temperature (before any decoding)."""
        if self.greedy_only and temperature > 0:
            raise ValueError(f"{self.name} decodes greedily only: evaluate it with eval.temperature=0")

    def prepare(self, ctx) -> dict:
        """Called once per eval run before decoding, with the run's EvalContext (eval/policies.py: the target's
        verify-cost curve, calibration sequences); returns what the method chose (reported), e.g. a calibrated
        temperature. Most methods need nothing."""
        return {}

    def path(self, cand_ids: torch.Tensor, cand_logits: torch.Tensor, hidden: torch.Tensor,
             anchors: torch.Tensor, context: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """The drafts (N, P) among the candidates (N, P, K) given the block hidden states (N, B, H, anchor first),
        anchors (N,) and context (N, CONTEXT) the committed tokens ending at the anchor (-1 before the sequence
        start); returns them with the number of candidate scorings per block. Drafts from a NOT_VERIFIED on are
        not verified."""
        return cand_ids[..., 0], 0

    def sample_path(self, logits: torch.Tensor, hidden: torch.Tensor, anchor: int, temperature: float,
                    generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sampled drafts (P,) target ids and the distributions q (P, V) over the target vocabulary they were drawn
        from; logits (P, V or Vd) of the drafter. The chain samples every position independently."""
        d = self.drafter
        q = probs(logits, temperature)
        idx = torch.multinomial(q, 1, generator=generator).squeeze(-1)
        if d.draft_to_target is not None:  # spread the draft vocabulary's distribution over the target vocabulary
            q = q.new_zeros(q.shape[0], d.config.vocab_size).index_copy_(1, d.draft_to_target, q)
        return d.to_target_ids(idx), q

    def block_hidden(self, state: RoundState, block_size: int) -> torch.Tensor:
        """The drafter's forward of [anchor, MASK x (B-1)] after the newly committed context enters its cache:
        post-norm hidden states (1, B, H)."""
        d = self.drafter
        device = d.norm.weight.device
        block = torch.full((1, block_size), d.config.mask_token_id, dtype=torch.long, device=device)
        block[0, 0] = state.anchor
        positions = torch.arange(state.anchor_pos, state.anchor_pos + block_size, device=device)
        return d.forward_step(state.new_features, state.new_positions, block, positions, self.cache)

    @torch.no_grad()
    def propose(self, state: RoundState, block_size: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> Proposal:
        d = self.drafter
        device = d.norm.weight.device
        hidden = self.block_hidden(state, block_size)  # (1, B, H)
        if temperature <= 0:
            ids, logits = candidates(d, hidden[:, 1:], self.top_k)
            sync(device)
            t0 = time.perf_counter()  # selection: what the method does after the drafter's logits and top-K
            tokens, scorings = self.path(ids, logits, hidden, torch.tensor([state.anchor], device=device),
                                         context_tensor(state.context, device))
            sync(device)
            return Proposal(verified_prefix(tokens[0]), select_s=time.perf_counter() - t0, scorings=scorings)
        logits = d.logits(hidden[0, 1:]).float()
        sync(device)
        t0 = time.perf_counter()
        tokens, q = self.sample_path(logits, hidden, state.anchor, temperature, generator)
        sync(device)
        return Proposal(tokens, q, select_s=time.perf_counter() - t0)


def context_tensor(tokens: list[int], device) -> torch.Tensor:
    """(1, CONTEXT): the last CONTEXT tokens, left-padded with -1."""
    tail = list(tokens[-CONTEXT:])
    return torch.tensor([[-1] * (CONTEXT - len(tail)) + tail], device=device)


def verified_prefix(drafts: torch.Tensor) -> torch.Tensor:
    """The drafts before the first NOT_VERIFIED (all of them when there is none)."""
    cut = (drafts == NOT_VERIFIED).nonzero()
    return drafts[: int(cut[0, 0])] if len(cut) else drafts

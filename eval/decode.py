"""Decoding loops at batch size 1: plain autoregressive decoding and speculative decoding with block verification.

Speculative round (docs/metrics.md, 'The speculative round'), with L = the number of committed tokens before the anchor:
  propose   a method drafts B-1 tokens for positions L+1 .. L+B-1 from the anchor at L (chain: the DFlash drafter,
            fed the tapped target features of the tokens committed since the last round);
  verify    the target runs [anchor, drafts] at positions L .. L+B-1 in ONE forward on its KV cache;
  accept    greedy: the longest prefix of drafts equal to the target's argmax; sampling: the standard
            accept/reject rule (accept x with prob min(1, p(x)/q(x)), else resample from norm(max(0, p - q)));
  commit    anchor + accepted drafts become context (their features come from this verify forward); the target's
            token after the accepted prefix is the next anchor; the target KV cache is cropped to the new L.

Methods come from the components of conf/catalogue.py (each module's METHODS). A block method is a ChainMethod
whose `path` chooses the drafts among the drafter's top-K candidates (the chain: each position's argmax); the same
`path` gives its teacher-forced (offline) metrics. A path may verify fewer drafts than the block holds: it marks the
unverified tail NOT_VERIFIED (policies of eval/policies.py), and a round then verifies [anchor, leading drafts].
A tree method proposes a DraftTree (eval/tree.py): the round verifies every node in one forward with an
ancestor-only mask and keeps the accepted path's KV entries.

Timings use time.perf_counter after a device synchronize, so GPU runs time real work, not kernel launches.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from transformers import DynamicCache

from dflash_pipeline.models.drafter import DFlashDrafter


NOT_VERIFIED = -1  # a path's drafts from here on are not verified this round (offline: they count as rejected)
CONTEXT = 8  # committed tokens, ending at the anchor, that a method sees as its context (RoundState.context)


# -- small helpers -----------------------------------------------------------------------------------------------
def _device(model) -> torch.device:
    return next(model.parameters()).device


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` tokens of the target's KV cache. (transformers 5: crop(-n) REMOVES n tokens.)"""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def _sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
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
    feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)  # (1, T, n*Ht)
    return TargetStep(out.logits[0], feats[0], out.hidden_states[-1][0])


# -- autoregressive baseline ---------------------------------------------------------------------------------------
@torch.no_grad()
def autoregressive(target, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                   generator: torch.Generator | None = None) -> tuple[list[int], dict]:
    """Plain KV-cache decoding, one token per target forward; stops after an EOS id (kept) or max_new_tokens.

    target: anything with .model (a causal LM) and .eos_ids. Returns (tokens, timings) with timings prefill_s,
    decode_s, total_s, target_forwards.
    """
    model, eos = target.model, target.eos_ids
    device = _device(model)
    tokens: list[int] = []
    if max_new_tokens <= 0:
        return tokens, {"prefill_s": 0.0, "decode_s": 0.0, "total_s": 0.0, "target_forwards": 0}
    _sync(device)
    t0 = time.perf_counter()
    cache = DynamicCache()
    ids = torch.tensor([prompt_ids], device=device)
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    forwards = 1
    pos = len(prompt_ids)
    first = True
    while True:
        logits = out.logits[0, -1]
        tok = int(logits.argmax()) if temperature <= 0 else _sample(_probs(logits, temperature), generator)
        tokens.append(tok)
        if first:
            _sync(device)
            t1, first = time.perf_counter(), False
        if tok in eos or len(tokens) >= max_new_tokens:
            break
        out = model(input_ids=torch.tensor([[tok]], device=device), position_ids=torch.tensor([[pos]], device=device),
                    cache=cache, use_cache=True)
        forwards += 1
        pos += 1
    _sync(device)
    t2 = time.perf_counter()
    return tokens, {"prefill_s": t1 - t0, "decode_s": t2 - t1, "total_s": t2 - t0, "target_forwards": forwards}


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
        q = _probs(logits, temperature)
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
            _sync(device)
            t0 = time.perf_counter()  # selection: what the method does after the drafter's logits and top-K
            tokens, scorings = self.path(ids, logits, hidden, torch.tensor([state.anchor], device=device),
                                         context_tensor(state.context, device))
            _sync(device)
            return Proposal(verified_prefix(tokens[0]), select_s=time.perf_counter() - t0, scorings=scorings)
        logits = d.logits(hidden[0, 1:]).float()
        _sync(device)
        t0 = time.perf_counter()
        tokens, q = self.sample_path(logits, hidden, state.anchor, temperature, generator)
        _sync(device)
        return Proposal(tokens, q, select_s=time.perf_counter() - t0)


def context_tensor(tokens: list[int], device) -> torch.Tensor:
    """(1, CONTEXT): the last CONTEXT tokens, left-padded with -1."""
    tail = list(tokens[-CONTEXT:])
    return torch.tensor([[-1] * (CONTEXT - len(tail)) + tail], device=device)


def verified_prefix(drafts: torch.Tensor) -> torch.Tensor:
    """The drafts before the first NOT_VERIFIED (all of them when there is none)."""
    cut = (drafts == NOT_VERIFIED).nonzero()
    return drafts[: int(cut[0, 0])] if len(cut) else drafts


# -- speculative decoding ----------------------------------------------------------------------------------------
@dataclass
class SpecResult:
    tokens: list[int]
    accepted: list[int] = field(default_factory=list)  # drafts accepted per verify round, 0 .. B-1 (before truncation)
    verified: list[int] = field(default_factory=list)  # drafts verified per round (B-1 unless the method verifies fewer)
    drafted: list[bool] = field(default_factory=list)  # per round: whether the drafter ran
    draft_s: list[float] = field(default_factory=list)  # per round: propose (drafter forward + selection)
    select_s: list[float] = field(default_factory=list)  # per round: the selection part of propose
    scorings: list[int] = field(default_factory=list)  # per round: candidate scorings of the selection
    verify_s: list[float] = field(default_factory=list)  # per round: target forward, acceptance, cache crop
    prefill_s: float = 0.0
    total_s: float = 0.0
    target_forwards: int = 0

    @property
    def tau(self) -> float:
        """Mean accepted + 1 over verify rounds (docs/metrics.md, 'Definitions')."""
        return (sum(self.accepted) + len(self.accepted)) / len(self.accepted) if self.accepted else 0.0


def _accept_greedy(drafts: torch.Tensor, logits: torch.Tensor) -> tuple[int, int]:
    """drafts (B-1,), logits (B, V) -> (accepted, next anchor): matching prefix with the target's argmax."""
    best = logits.argmax(-1)  # (B,)
    n = int((drafts == best[:-1]).long().cumprod(0).sum())
    return n, int(best[n])


def _accept_sampling(drafts: torch.Tensor, q: torch.Tensor, logits: torch.Tensor, temperature: float,
                     generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. / Chen et al.): the output is distributed as the target's samples."""
    p = _probs(logits, temperature)  # (B, V)
    for k in range(drafts.shape[0]):
        x = int(drafts[k])
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * float(q[k, x]) < float(p[k, x]):  # u < p/q without dividing
            continue
        residual = (p[k] - q[k]).clamp(min=0)
        total = float(residual.sum())
        return k, _sample(residual / total if total > 0 else p[k], generator)
    return drafts.shape[0], _sample(p[-1], generator)  # all accepted: the bonus from p


@torch.no_grad()
def speculative(target, drafter, prompt_ids: list[int], max_new_tokens: int, block_size: int | None = None,
                temperature: float = 0.0, generator: torch.Generator | None = None) -> SpecResult:
    """Speculative decoding of one prompt. drafter: a DFlashDrafter (run as the "chain" method) or a method object.

    Greedy output equals `autoregressive`'s token for token; with temperature > 0 it is distributed as the
    target's own samples. A round verifies the anchor and the drafts the method proposed (at most B-1). Stops after an EOS id (kept; an EOS among accepted drafts ends the output there) or at
    exactly max_new_tokens.
    """
    method = ChainMethod(drafter) if isinstance(drafter, DFlashDrafter) else drafter
    B = block_size or method.max_block_size
    if not 2 <= B <= method.max_block_size:
        raise ValueError(f"block size {B} must be in 2 .. {method.max_block_size} (the trained block size)")
    method.check(B, temperature)  # e.g. a greedy-only method at temperature > 0: refused, never run differently
    model, eos = target.model, target.eos_ids
    device = _device(model)
    res = SpecResult(tokens=[])
    if max_new_tokens <= 0:
        return res
    _sync(device)
    t_start = time.perf_counter()
    method.start()
    cache = DynamicCache()
    L = len(prompt_ids)
    logits, feats, final = target_forward(model, torch.tensor([prompt_ids], device=device),
                                          torch.arange(L, device=device)[None], cache, method.layer_ids,
                                          last_only=True)
    res.target_forwards = 1
    anchor = int(logits[-1].argmax()) if temperature <= 0 else _sample(_probs(logits[-1], temperature), generator)
    output = [anchor]
    new_features, new_positions, verifier_hidden = feats[None], torch.arange(L, device=device), final[-1]
    _sync(device)
    res.prefill_s = time.perf_counter() - t_start
    done = anchor in eos or len(output) >= max_new_tokens
    while not done:
        t0 = time.perf_counter()
        context = (prompt_ids + output)[-CONTEXT:]
        prop = method.propose(RoundState(new_features, new_positions, anchor, L, output, context, verifier_hidden),
                              B, temperature, generator)
        drafts = prop.tokens.to(device)
        _sync(device)
        t1 = time.perf_counter()
        if prop.tree is not None:  # one forward over the tree, greedy walk, the cache compacted to the path
            from dflash_pipeline.eval.tree import verify_tree

            verdict = verify_tree(model, cache, L, anchor, prop.tree, method.layer_ids)
            n, next_anchor, accepted = len(verdict.path), verdict.next_anchor, verdict.tokens
            feats, verifier_hidden = verdict.features, verdict.final[-1]
        else:
            ids = torch.cat([torch.tensor([anchor], device=device), drafts])[None]  # (1, 1 + drafts)
            positions = torch.arange(L, L + ids.shape[1], device=device)[None]
            logits, feats, final = target_forward(model, ids, positions, cache, method.layer_ids)  # (1+d, ...)
            if temperature <= 0:
                n, next_anchor = _accept_greedy(drafts, logits)
            else:
                n, next_anchor = _accept_sampling(drafts, prop.q.to(device), logits, temperature, generator)
            crop_cache(cache, L + n + 1)  # keep anchor + accepted drafts
            accepted, verifier_hidden = drafts[:n].tolist(), final[n]
        res.target_forwards += 1
        _sync(device)
        t2 = time.perf_counter()
        res.accepted.append(n)
        res.verified.append(len(drafts))
        res.drafted.append(prop.drafted)
        res.draft_s.append(t1 - t0)
        res.select_s.append(prop.select_s)
        res.scorings.append(prop.scorings)
        res.verify_s.append(t2 - t1)
        new = accepted + [next_anchor]
        for i, tok in enumerate(new):
            if tok in eos:
                new, done = new[: i + 1], True
                break
        output += new
        if len(output) >= max_new_tokens:
            output, done = output[:max_new_tokens], True
        new_features, new_positions = feats[None, : n + 1], torch.arange(L, L + n + 1, device=device)
        L, anchor = L + n + 1, next_anchor
    res.tokens = output
    _sync(device)
    res.total_s = time.perf_counter() - t_start
    return res

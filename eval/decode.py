"""Decoding loops at batch size 1: plain autoregressive decoding and speculative decoding with block verification.

Speculative round (docs/metrics.md, 'The speculative round'), with L = the number of committed tokens before the anchor:
  propose   a method drafts B-1 tokens for positions L+1 .. L+B-1 from the anchor at L (chain: the DFlash drafter,
            fed the tapped target features of the tokens committed since the last round);
  verify    the target runs [anchor, drafts] at positions L .. L+B-1 in ONE forward on its KV cache;
  accept    greedy: the longest prefix of drafts equal to the target's argmax; sampling, by `acceptance`
            (docs/metrics.md, 'Acceptance at temperature'): "sampled" drafts x ~ q, kept with prob min(1, p(x)/q(x)),
            else the token is resampled from norm(max(0, p - q)); "greedy_draft" drafts x = argmax q, kept with prob
            p(x), else resampled from p without x (the same rule with q one-hot: what vLLM does by default). Both
            give the target's own distribution; their acceptance rates differ;
  commit    anchor + accepted drafts become context (their features come from this verify forward); the target's
            token after the accepted prefix is the next anchor; the target KV cache is cropped to the new L.

Methods come from the catalogue of eval/methods.py and follow the protocol of
eval/protocol.py: a block method's Proposal holds its drafts (a round verifies [anchor, drafts before the first
NOT_VERIFIED]); a tree method's holds a DraftTree (eval/tree.py): the round verifies every node in one forward with
an ancestor-only mask and keeps the accepted path's KV entries.

Timings use time.perf_counter after a device synchronize, so GPU runs time real work, not kernel launches.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dflash_pipeline.eval.protocol import CONTEXT, ChainMethod, RoundState, device_of, probs, sample, sync, \
    target_forward
from dflash_pipeline.eval.tree import check_target, verify_tree
from dflash_pipeline.models import cache as target_cache
from dflash_pipeline.models.drafter import DFlashDrafter


# -- autoregressive baseline ---------------------------------------------------------------------------------------
@torch.no_grad()
def autoregressive(target, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                   generator: torch.Generator | None = None) -> tuple[list[int], dict]:
    """Plain KV-cache decoding, one token per target forward; stops after an EOS id (kept) or max_new_tokens.

    target: anything with .model (a causal LM) and .eos_ids. Returns (tokens, timings) with timings prefill_s,
    decode_s, total_s, target_forwards.
    """
    model, eos = target.model, target.eos_ids
    device = device_of(model)
    tokens: list[int] = []
    if max_new_tokens <= 0:
        return tokens, {"prefill_s": 0.0, "decode_s": 0.0, "total_s": 0.0, "target_forwards": 0}
    sync(device)
    t0 = time.perf_counter()
    cache = target_cache.new_cache(model)
    ids = torch.tensor([prompt_ids], device=device)
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    forwards = 1
    pos = len(prompt_ids)
    first = True
    while True:
        logits = out.logits[0, -1]
        tok = int(logits.argmax()) if temperature <= 0 else sample(probs(logits, temperature), generator)
        tokens.append(tok)
        if first:
            sync(device)
            t1, first = time.perf_counter(), False
        if tok in eos or len(tokens) >= max_new_tokens:
            break
        out = model(input_ids=torch.tensor([[tok]], device=device), position_ids=torch.tensor([[pos]], device=device),
                    cache=cache, use_cache=True)
        forwards += 1
        pos += 1
    sync(device)
    t2 = time.perf_counter()
    return tokens, {"prefill_s": t1 - t0, "decode_s": t2 - t1, "total_s": t2 - t0, "target_forwards": forwards}


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
    p = probs(logits, temperature)  # (B, V)
    for k in range(drafts.shape[0]):
        x = int(drafts[k])
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * float(q[k, x]) < float(p[k, x]):  # u < p/q without dividing
            continue
        residual = (p[k] - q[k]).clamp(min=0)
        total = float(residual.sum())
        return k, sample(residual / total if total > 0 else p[k], generator)
    return drafts.shape[0], sample(p[-1], generator)  # all accepted: the bonus from p


ACCEPTANCE_RULES = ("sampled", "greedy_draft")


def one_hot_q(drafts: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The draft distribution the greedy-draft rule verifies against: all mass on each draft."""
    q = torch.zeros(drafts.shape[0], vocab_size, device=drafts.device)
    return q.scatter_(1, drafts.long()[:, None], 1.0)


def _method_and_block(drafter, model, block_size: int | None, temperature: float, acceptance: str):
    """(method, B) for this decode, or a one-line refusal before any work: a block outside what the method was trained
    for, a method that cannot run at this temperature, an unknown acceptance rule or a target the method cannot tap."""
    method = ChainMethod(drafter) if isinstance(drafter, DFlashDrafter) else drafter
    B = block_size or method.max_block_size
    if not 2 <= B <= method.max_block_size:
        raise ValueError(f"block size {B} must be in 2 .. {method.max_block_size} (the trained block size)")
    method.check(B, temperature)  # e.g. a greedy-only method at temperature > 0: refused, never run differently
    if acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"unknown acceptance rule {acceptance!r}: use one of {', '.join(ACCEPTANCE_RULES)}")
    check_target(method, model)
    return method, B


def _prefill(model, method, prompt_ids: list[int], cache, rollback, B: int, temperature: float,
             generator: torch.Generator | None):
    """The prompt in one target forward: (first anchor, the prompt's tapped features (1, L, .), their positions,
    the final hidden state that chose the anchor), what the method's first round reads. A recording rollback starts
    on the filled cache (it keeps the states of each block from here on); the anchor is picked as autoregressive's."""
    device = device_of(model)
    L = len(prompt_ids)
    logits, feats, final = target_forward(model, torch.tensor([prompt_ids], device=device),
                                          torch.arange(L, device=device)[None], cache, method.layer_ids,
                                          last_only=True)
    rollback.start(cache, B)
    anchor = int(logits[-1].argmax()) if temperature <= 0 else sample(probs(logits[-1], temperature), generator)
    return anchor, feats[None], torch.arange(L, device=device), final[-1]


def _accept(drafts: torch.Tensor, logits: torch.Tensor, q: torch.Tensor | None, temperature: float,
            greedy_draft: bool, generator: torch.Generator | None) -> tuple[int, int]:
    """(accepted, next anchor) by the round's rule: the argmax prefix at temperature 0; else speculative sampling
    against the distribution the drafts came from (the method's q, or one-hot on each draft under greedy_draft)."""
    if temperature <= 0:
        return _accept_greedy(drafts, logits)
    q = one_hot_q(drafts, logits.shape[-1]) if greedy_draft else q.to(drafts.device)
    return _accept_sampling(drafts, q, logits, temperature, generator)


def _verify(model, cache, rollback, layer_ids, prop, drafts: torch.Tensor, L: int, anchor: int, temperature: float,
            greedy_draft: bool, generator: torch.Generator | None):
    """One target forward over the round's proposal: (accepted n, next anchor, accepted tokens, tapped features of
    anchor + accepted (n+1, .), the final hidden state that chose the next anchor). The cache keeps anchor + accepted
    only (a recurrent target's state too: target.rollback), so the next round continues from position L + n + 1."""
    if prop.tree is not None:  # one forward over the tree, greedy walk, the cache compacted to the path
        verdict = verify_tree(model, cache, L, anchor, prop.tree, layer_ids)
        return len(verdict.path), verdict.next_anchor, verdict.tokens, verdict.features, verdict.final[-1]
    device = device_of(model)
    ids = torch.cat([torch.tensor([anchor], device=device), drafts])[None]  # (1, 1 + drafts)
    positions = torch.arange(L, L + ids.shape[1], device=device)[None]
    rollback.before(cache)
    logits, feats, final = target_forward(model, ids, positions, cache, layer_ids)  # (1+d, ...)
    n, next_anchor = _accept(drafts, logits, prop.q, temperature, greedy_draft, generator)
    rollback.after(cache, L + n + 1, ids[:, : n + 1], positions[:, : n + 1])
    return n, next_anchor, drafts[:n].tolist(), feats, final[n]


def _record_round(res: SpecResult, prop, n: int, verified: int, draft_s: float, verify_s: float) -> None:
    """One verify round's entries in the per-round lists of SpecResult (docs/metrics.md reads them)."""
    res.accepted.append(n)
    res.verified.append(verified)
    res.drafted.append(prop.drafted)
    res.draft_s.append(draft_s)
    res.select_s.append(prop.select_s)
    res.scorings.append(prop.scorings)
    res.verify_s.append(verify_s)


def _commit(output: list[int], new: list[int], eos, max_new_tokens: int) -> tuple[list[int], bool]:
    """(output, done) after a round's new tokens (accepted drafts, then the next anchor): extended in place (it is
    the list the method sees as RoundState.output), cut after the first EOS among them and at max_new_tokens."""
    done = False
    for i, tok in enumerate(new):
        if tok in eos:
            new, done = new[: i + 1], True
            break
    output += new
    if len(output) >= max_new_tokens:
        output, done = output[:max_new_tokens], True
    return output, done


@torch.no_grad()
def speculative(target, drafter, prompt_ids: list[int], max_new_tokens: int, block_size: int | None = None,
                temperature: float = 0.0, generator: torch.Generator | None = None,
                rollback: str | None = None, acceptance: str = "sampled") -> SpecResult:
    """Speculative decoding of one prompt. drafter: a DFlashDrafter (run as the "chain" method) or a method object.

    Greedy output equals `autoregressive`'s token for token; with temperature > 0 it is distributed as the
    target's own samples. A round verifies the anchor and the drafts the method proposed (at most B-1). Stops after
    an EOS id (kept; an EOS among accepted drafts ends the output there) or at exactly max_new_tokens.
    rollback: how a recurrent target's state goes back after a rejection (models/cache.py Rollback; attention
    targets crop); None: the target's own setting (target.rollback).
    acceptance: the rule at temperature > 0 (ACCEPTANCE_RULES; the module docstring says what each does).
    """
    method, B = _method_and_block(drafter, target.model, block_size, temperature, acceptance)
    greedy_draft = temperature > 0 and acceptance == "greedy_draft"
    model, eos = target.model, target.eos_ids
    device = device_of(model)
    res = SpecResult(tokens=[])
    if max_new_tokens <= 0:
        return res
    sync(device)
    t_start = time.perf_counter()
    method.start()
    cache = target_cache.new_cache(model)
    rollback = target_cache.Rollback(model, rollback or getattr(target, "rollback", "record"))
    L = len(prompt_ids)
    anchor, new_features, new_positions, verifier_hidden = _prefill(model, method, prompt_ids, cache, rollback, B,
                                                                    temperature, generator)
    res.target_forwards = 1
    output = [anchor]
    sync(device)
    res.prefill_s = time.perf_counter() - t_start
    done = anchor in eos or len(output) >= max_new_tokens
    while not done:
        t0 = time.perf_counter()
        context = (prompt_ids + output)[-CONTEXT:]
        prop = method.propose(RoundState(new_features, new_positions, anchor, L, output, context, verifier_hidden),
                              B, 0.0 if greedy_draft else temperature, generator)
        drafts = prop.tokens.to(device)
        sync(device)
        t1 = time.perf_counter()
        n, next_anchor, accepted, feats, verifier_hidden = _verify(model, cache, rollback, method.layer_ids, prop,
                                                                   drafts, L, anchor, temperature, greedy_draft,
                                                                   generator)
        res.target_forwards += 1
        sync(device)
        t2 = time.perf_counter()
        _record_round(res, prop, n, len(drafts), t1 - t0, t2 - t1)
        output, done = _commit(output, accepted + [next_anchor], eos, max_new_tokens)
        new_features, new_positions = feats[None, : n + 1], torch.arange(L, L + n + 1, device=device)
        L, anchor = L + n + 1, next_anchor
    res.tokens = output
    res.target_forwards += rollback.replays
    sync(device)
    res.total_s = time.perf_counter() - t_start
    return res

"""Exactness of greedy speculative decoding against the target's own autoregressive decoding, at every precision.

float32: a speculative output must equal the autoregressive one token for token; any difference is a bug in
verification (ExactnessError), never a property of the drafter.

bfloat16 / float16: a verify forward of n tokens and a 1-token step compute the same logits through kernels of
other shapes, which round differently. Where the target's top two tokens are nearly tied, the argmax can differ,
and from there the two decodes go on differently, each a greedy decode of the target under its own rounding. So
every output is classified against the autoregressive reference (docs/metrics.md, 'Exactness check'):
  identical  token for token;
  near_tie   at the first divergence the two tokens' log-probabilities, recomputed once in float32 on the shared
             prefix, differ by less than `tolerance` (eval.near_tie_tolerance); the gap is recorded;
  wrong      anything else (a length difference, a clear winner replaced): raised, as in float32.
Acceptance counts every round the speculative run made (each exact against its own verification), and beside it
the rounds before the divergence (`rounds_before`): the tokens verified against the reference.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

IDENTICAL, NEAR_TIE, WRONG = "identical", "near_tie", "wrong"
# nats; eval.near_tie_tolerance. bf16 SmolLM2 moves the float32 top-2 gap by up to 0.33 (a verify block) and 0.37
# (1-token steps), 0.48 both together, over 576 positions (scripts/bench_precision.py; docs/results/precision.md)
DEFAULT_TOLERANCE = 0.5


class ExactnessError(RuntimeError):
    """Greedy speculative output differs from autoregressive output beyond a near-tie: a bug in verification."""


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """First output position where a and b differ (a length difference counts), or None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def rounds_before(accepted: list[int], position: int | None) -> list[int]:
    """The leading rounds (accepted drafts per round) whose committed tokens all lie before output `position`
    (None: every round). Output position 0 is the prefill's token; a round commits its accepted drafts + 1."""
    if position is None:
        return list(accepted)
    end, kept = 1, []
    for n in accepted:
        end += n + 1
        if end > position:
            break
        kept.append(n)
    return kept


@dataclass
class Verdict:
    kind: str  # IDENTICAL | NEAR_TIE | WRONG
    position: int | None = None  # first divergence (None: identical)
    detail: dict = field(default_factory=dict)  # tokens at the divergence and their float32 log-prob gap


class ExactnessJudge:
    """Classifies outputs against the reference for a target of `model`'s dtype (see the module doc).

    The float32 recomputation runs on a float32 copy of the target made at the first divergence (the same weights
    upcast: what is tested is the arithmetic, not the rounding of the weights), kept for later ones."""

    def __init__(self, model, tolerance: float):
        self.model, self.tolerance = model, tolerance
        self.reduced = next(model.parameters()).dtype != torch.float32
        self.near_ties = self.reduced  # float32: outputs must match exactly (near_ties_allowed: other kernels)
        self._float32 = None

    def near_ties_allowed(self) -> ExactnessJudge:
        """This judge for outputs of another engine's kernels (llama.cpp), which round differently from torch's even
        in float32: a divergence at a near-tie is classified as such, not as wrong."""
        judge = copy.copy(self)
        judge.near_ties = True
        return judge

    def float32_model(self):
        """The float32 copy of the target (made once; also the float32 baseline the eval may time)."""
        if self._float32 is None:
            self._float32 = copy.deepcopy(self.model).float().eval() if self.reduced else self.model
        return self._float32

    @torch.no_grad()
    def logprob_gap(self, prefix: list[int], a: int, b: int) -> float:
        """|log p(a) - log p(b)| of the target in float32 after `prefix`."""
        model = self.float32_model()
        device = next(model.parameters()).device
        logits = model(input_ids=torch.tensor([prefix], device=device), logits_to_keep=1).logits[0, -1]
        logp = torch.log_softmax(logits.float(), -1)
        return abs(float(logp[a] - logp[b]))

    def classify(self, prompt_ids: list[int], reference: list[int], other: list[int]) -> Verdict:
        pos = first_mismatch(reference, other)
        if pos is None:
            return Verdict(IDENTICAL)
        ref_tok = reference[pos] if pos < len(reference) else None
        got_tok = other[pos] if pos < len(other) else None
        detail = {"reference_token": ref_tok, "other_token": got_tok,
                  "lengths": [len(reference), len(other)]}
        if not self.near_ties or ref_tok is None or got_tok is None:
            return Verdict(WRONG, pos, detail)
        gap = self.logprob_gap(prompt_ids + reference[:pos], ref_tok, got_tok)
        detail.update(logprob_gap=gap, tolerance=self.tolerance)
        return Verdict(NEAR_TIE if gap < self.tolerance else WRONG, pos, detail)

    def check(self, prompt_id: str, prompt_ids: list[int], reference: list[int], other: list[int], what: str,
              strict: bool = True) -> Verdict:
        """classify(); a WRONG verdict raises ExactnessError when `strict` (else it is returned, to be recorded)."""
        verdict = self.classify(prompt_ids, reference, other)
        if verdict.kind == WRONG and strict:
            d = verdict.detail
            gap = (f"; float32 log-prob gap {d['logprob_gap']:.4f} >= near-tie tolerance {d['tolerance']}"
                   if "logprob_gap" in d else "")
            raise ExactnessError(
                f"prompt {prompt_id}: {what} differs from autoregressive greedy decoding at output position "
                f"{verdict.position} (autoregressive token {_tok(d['reference_token'])}, got "
                f"{_tok(d['other_token'])}; lengths {d['lengths'][0]} vs {d['lengths'][1]}{gap})")
        return verdict


def _tok(t: int | None) -> str:
    return "<end>" if t is None else str(t)

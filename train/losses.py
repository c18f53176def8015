"""Block losses (docs/methods.md, 'Losses'). Every loss returns a SUM and its normaliser separately, so the training
loop can normalise by the global count across processes and micro-batches (the same gradient on 1 or N processes).

Shapes: N blocks, P = B - 1 drafted positions, V (draft) vocabulary.
"""
from __future__ import annotations

import math

import torch


LOSSES = ("decay", "dpace", "kl")


def default_gamma(block_size: int) -> float:
    """The DFlash paper's decay constant: 7 for B=16, 5 for B=10, 4 for B=8 (interpolated in between)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, 0.45 * block_size))


def decay_weights(num_positions: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/gamma) for k = 1..P: early positions matter most, every later one needs them accepted."""
    k = torch.arange(num_positions, device=device, dtype=torch.float32)
    return torch.exp(-k / gamma)


def dpace_weights(q: torch.Tensor, valid: torch.Tensor, alpha: float, carries: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """D-PACE: s_k = (1-a) q_k + a, P_k = prod_{j<=k} s_j, w_k = sum_{j>=k} P_j mask_j; detached.

    q (N, P): the draft's probability of the true token (exp(-CE); 0 for a label the draft vocabulary lacks);
    valid (N, P): positions with a label (s = 1 past the sequence's end); carries (N, P): positions that carry
    loss (mask_j; default `valid`). A label outside the draft vocabulary has a label but no loss: its q is 0, so
    it lowers the weight of every later position, as the path through it cannot survive.
    """
    carries = valid if carries is None else carries
    with torch.no_grad():
        s = torch.where(valid, (1 - alpha) * q.float() + alpha, torch.ones_like(q, dtype=torch.float32))
        p = torch.cumprod(s, dim=-1) * carries
        return p.flip(-1).cumsum(-1).flip(-1)


def effective_valid(kind: str, labels: torch.Tensor, valid: torch.Tensor,
                    teacher_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Positions that carry loss: a label inside the (draft) vocabulary for CE, some top-k id inside it for KL."""
    if kind == "kl":
        return valid if teacher_ids is None else valid & (teacher_ids >= 0).any(-1)
    return valid & (labels >= 0)


def normaliser(kind: str, valid: torch.Tensor, gamma: float) -> float:
    """What a batch's loss sum is divided by, known before the forward so it can be summed over processes:
    the weight sum for decay/kl (a weighted mean), the number of blocks for D-PACE (as the method states)."""
    if kind == "dpace":
        return float(valid.shape[0])
    return float((decay_weights(valid.shape[1], gamma, valid.device) * valid).sum())


def block_loss(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, *, kind: str, gamma: float,
               alpha: float = 0.5, teacher_ids: torch.Tensor | None = None,
               teacher_logprobs: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted loss SUM over N blocks (divide by `normaliser`).

    logits (N, P, V); labels (N, P) in logit-column space (-1 where the label is outside the draft vocabulary);
    valid (N, P) bool. kind: "decay" (CE with exponential position weights), "dpace" (CE with D-PACE weights),
    "kl" (KL(target || draft) on the target's stored top-k, renormalised, with decay weights; needs
    teacher_ids/teacher_logprobs (N, P, k) in logit-column space, -1 for ids outside the draft vocabulary).
    """
    if kind not in LOSSES:
        raise ValueError(f"unknown trainer.loss {kind!r}; use decay, dpace or kl")
    if kind == "kl" and (teacher_ids is None or teacher_logprobs is None):
        raise ValueError("trainer.loss=kl needs the target's top-k log-probs: set teacher.topk_logprobs > 0")
    has_label, valid = valid, effective_valid(kind, labels, valid, teacher_ids)
    logp = torch.log_softmax(logits.float(), dim=-1)  # (N, P, V)
    if kind == "kl":
        keep = teacher_ids >= 0
        p = torch.softmax(teacher_logprobs.float().masked_fill(~keep, -math.inf), dim=-1).nan_to_num(0.0)
        q = logp.gather(-1, teacher_ids.clamp(min=0))  # (N, P, k)
        kl = (p * (torch.log(p.clamp(min=1e-20)) - q) * keep).sum(-1)
        return (kl * decay_weights(labels.shape[1], gamma, logits.device) * valid).sum()
    ce = -logp.gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)  # (N, P)
    if kind == "decay":
        return (ce * decay_weights(labels.shape[1], gamma, logits.device) * valid).sum()
    q = torch.where(valid, torch.exp(-ce.detach()), 0.0)  # a label outside the draft vocabulary: q = 0
    return (ce * dpace_weights(q, has_label, alpha, valid) * valid).sum()


class _SlicedLoss(torch.autograd.Function):
    """A loss SUM over slices whose gradient is taken in the forward, slice by slice, then scaled in the backward (as
    fused linear cross entropy kernels do): only one slice's logits ever exist, and nothing is recomputed."""

    @staticmethod
    def forward(ctx, fn, slices, sink, hidden, *params):
        grad_hidden, grad_params = torch.zeros_like(hidden), [torch.zeros_like(p) for p in params]
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for part in slices:
            with torch.enable_grad():
                h = hidden[part].detach().requires_grad_(True)
                loss, stats = fn(h, part)
                grads = torch.autograd.grad(loss, [h, *params], allow_unused=True)
            grad_hidden[part] = grads[0]
            for acc, g in zip(grad_params, grads[1:]):
                if g is not None:
                    acc += g
            total += loss.detach().float()
            sink.append(stats)
        ctx.save_for_backward(grad_hidden, *grad_params)
        return total

    @staticmethod
    def backward(ctx, grad_out):
        grad_hidden, *grad_params = ctx.saved_tensors
        return (None, None, None, grad_hidden * grad_out.to(grad_hidden.dtype),
                *(g * grad_out.to(g.dtype) for g in grad_params))


def sliced_loss(fn, hidden: torch.Tensor, slices: list, params: list[torch.Tensor]) -> tuple[torch.Tensor, list]:
    """sum over `slices` of fn(hidden[part], part) -> (loss SUM, stats), with the list of each slice's stats.

    With gradients, each slice's gradient (to hidden and to `params`, the trainable tensors fn uses besides hidden)
    is computed in the forward and its logits freed at once: memory holds one slice's logits, and the backward
    costs no second pass over the LM head. Without, a plain loop."""
    sink: list = []
    if torch.is_grad_enabled() and (hidden.requires_grad or any(p.requires_grad for p in params)):
        return _SlicedLoss.apply(fn, slices, sink, hidden, *params), sink
    total = 0.0
    for part in slices:
        loss, stats = fn(hidden[part], part)
        total, sink = total + loss, sink + [stats]
    return total, sink

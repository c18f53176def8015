"""DFlash4 separate jump head: a small network with its own forward pass, run after the drafter, that predicts the
tokens at sparse block offsets; the gaps between the fixed tokens are filled as for the fused heads (models/jump.py:
fill_gaps).

The fused heads of models/jump.py only re-rank the drafter's top-K from a hidden state the drafter already produced,
which is cheap by construction. This head pays for one transformer layer over the block and a vocabulary projection
at each offset, so comparing the two measures what fusing saves (selection time, acceptance) instead of assuming it.

The head reads the drafter's post-norm block hidden states (N, B, H, anchor first): one pre-norm layer (bidirectional
attention over the B positions, SwiGLU MLP) and a final RMSNorm give a state per offset, which the drafter's own
frozen LM head (`DFlashDrafter.logits`) turns into logits over its columns (the draft vocabulary, if it has one).
The anchor at o_j is their argmax, fixed where its top-1 minus top-2 logit margin passes the gate.

Shapes: N blocks, B block size, P = B - 1 drafted positions, H drafter hidden, J offsets, K candidates per position,
C logit columns (V, or Vd with a draft vocabulary).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from dflash_pipeline.models.jump import Transition, check_offsets, fill_gaps

# The separate jump head's tensors in a component export are named under this prefix (docs/export.md).
JUMP_HEAD_PREFIX = "jump_head."


class BlockAttention(nn.Module):
    """Multi-head attention of the offsets' queries over every position of the block (no mask: bidirectional)."""

    def __init__(self, hidden_size: int, num_heads: int):
        super().__init__()
        if hidden_size % num_heads:
            raise ValueError(f"num_heads {num_heads} must divide the hidden size {hidden_size}")
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, queries: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """queries (N, J, H), block (N, B, H) -> (N, J, H)."""
        (N, J, H), B = queries.shape, block.shape[1]
        q = self.q_proj(queries).view(N, J, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(block).view(N, B, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(block).view(N, B, self.num_heads, self.head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v)  # (N, h, J, D)
        return self.o_proj(out.transpose(1, 2).reshape(N, J, H))


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SeparateJumpHead(nn.Module):
    """One pre-norm transformer layer over the drafter's block plus a final RMSNorm; outputs the states at the
    offsets (N, J, H), for the drafter's LM head.

    state_dict (stable names, exported under `jump_head.`):
      position_embedding.weight          [B, H]  added to the normed attention input (the layer has no RoPE)
      input_layernorm.weight             [H]
      self_attn.{q,k,v,o}_proj.weight    [H, H]
      post_attention_layernorm.weight    [H]
      mlp.{gate,up}_proj.weight          [I, H]
      mlp.down_proj.weight               [H, I]
      norm.weight                        [H]
    It is one layer, so only the offsets need queries and the MLP: the other rows would feed nothing.
    o_proj and down_proj start at zero, so a fresh head outputs RMSNorm(h_{o_j}): the drafter's own state at the
    offset rescaled by a positive factor, and with a bias-free LM head the drafter's logits times that factor (same
    ranking, same argmax; the margin scales). The position embedding starts at zero too.
    """

    def __init__(self, hidden_size: int, block_size: int, offsets: list[int], num_heads: int = 4,
                 intermediate_size: int | None = None, rms_norm_eps: float = 1e-6):
        super().__init__()
        self.offsets = check_offsets(offsets, block_size)
        self.hidden_size, self.block_size, self.num_heads = hidden_size, block_size, num_heads
        self.intermediate_size = intermediate_size or 2 * hidden_size
        self.register_buffer("offset_positions", torch.tensor(self.offsets), persistent=False)  # (J,) for indexing
        self.position_embedding = nn.Embedding(block_size, hidden_size)
        self.input_layernorm = Qwen3RMSNorm(hidden_size, rms_norm_eps)
        self.self_attn = BlockAttention(hidden_size, num_heads)
        self.post_attention_layernorm = Qwen3RMSNorm(hidden_size, rms_norm_eps)
        self.mlp = SwiGLU(hidden_size, self.intermediate_size)
        self.norm = Qwen3RMSNorm(hidden_size, rms_norm_eps)
        nn.init.zeros_(self.position_embedding.weight)
        nn.init.zeros_(self.self_attn.o_proj.weight)
        nn.init.zeros_(self.mlp.down_proj.weight)

    @property
    def num_offsets(self) -> int:
        return len(self.offsets)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, B, H) the drafter's full block (post-norm, anchor first) -> (N, J, H) at block positions o_j."""
        if hidden.shape[-2] != self.block_size:
            raise ValueError(f"hidden has {hidden.shape[-2]} block positions, the head was built for "
                             f"block_size {self.block_size}")
        x = hidden.to(self.norm.weight.dtype)
        a = self.input_layernorm(x) + self.position_embedding.weight
        y = x[:, self.offset_positions] + self.self_attn(a[:, self.offset_positions], a)
        y = y + self.mlp(self.post_attention_layernorm(y))
        return self.norm(y)


def head_logits(head: SeparateJumpHead, drafter, hidden: torch.Tensor) -> torch.Tensor:
    """(N, J, C) float32: the head's states through the drafter's frozen LM head. `head` may be wrapped (DDP)."""
    return drafter.logits(head(hidden)).float()


@torch.no_grad()
def choose_head_anchors(head: SeparateJumpHead, drafter, hidden: torch.Tensor,
                        margin: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per offset, the head's argmax as a target id (N, J) and whether it is fixed (N, J): top-1 minus top-2 logit
    >= margin (-inf fixes every offset, +inf none; a one-column vocabulary is certain)."""
    logits = head_logits(head, drafter, hidden)
    top = logits.topk(min(2, logits.shape[-1]), dim=-1)
    gap = (top.values[..., 0] - top.values[..., 1] if logits.shape[-1] > 1
           else torch.full_like(top.values[..., 0], math.inf))
    return drafter.to_target_ids(top.indices[..., 0]), gap >= margin


@torch.no_grad()
def head_path(cand_ids: torch.Tensor, U: torch.Tensor, hidden: torch.Tensor, anchor_ids: torch.Tensor,
              head: SeparateJumpHead, drafter, margin: float,
              transition: Transition | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One draft path per block: the head's confident anchors fixed, the gaps filled by `fill_gaps` (argmax of U, or
    with a transition the Viterbi pinned at both ends). Arguments as models/jump.py: guided_path.

    Returns ids (N, P) target ids and work (N,): the gap fill's candidate scorings. The head's forward and its
    vocabulary projection are not candidate scorings; their cost is in the method's measured selection time."""
    N, P, _ = cand_ids.shape
    anchors, keep = choose_head_anchors(head, drafter, hidden, margin)  # (N, J)
    at = head.offset_positions - 1
    fixed = torch.zeros(N, P, dtype=torch.bool, device=cand_ids.device)
    fixed[:, at] = keep
    fixed_ids = torch.zeros(N, P, dtype=torch.long, device=cand_ids.device)
    fixed_ids[:, at] = anchors
    return fill_gaps(cand_ids, U, hidden, anchor_ids, fixed, fixed_ids, transition)


def jump_head_loss(head: SeparateJumpHead, drafter, hidden: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor,
                   position_weights: torch.Tensor | None = None,
                   marginal_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Training loss of the head on a frozen drafter: CE of the teacher token over the drafter's logit columns at
    each offset.

    hidden (N, B, H) full block (detached); labels (N, J) teacher target ids at the offsets; valid (N, J) bool;
    position_weights (N, J) optional factor; marginal_ids (N, J) the drafter's own argmax at the offsets (target
    ids), for the marginal accuracy. A label outside a draft vocabulary is skipped (no column can predict it) and
    counted.

    Returns the loss SUM over scored offsets and detached counts: scored, skipped, correct (the head's argmax is the
    label) and correct_marginal (the drafter's argmax is; 0 without marginal_ids).
    """
    logits = head_logits(head, drafter, hidden)  # (N, J, C)
    column = drafter.target_to_column()[labels]  # -1 outside a draft vocabulary
    valid = valid.bool()
    scored, skipped = valid & (column >= 0), valid & (column < 0)
    target = column.clamp(min=0).unsqueeze(-1)
    loss = logits.logsumexp(-1) - logits.gather(-1, target).squeeze(-1)  # (N, J)
    if position_weights is not None:
        loss = loss * position_weights
    loss_sum = torch.where(scored, loss, 0.0).sum()
    with torch.no_grad():
        marginal = (torch.zeros_like(scored) if marginal_ids is None else marginal_ids == labels)
        stats = {"scored": scored.sum(), "skipped": skipped.sum(),
                 "correct": (scored & (logits.argmax(-1) == column)).sum(),
                 "correct_marginal": (scored & marginal).sum()}
    return loss_sum, stats

"""DFlash4 separate jump head as a component: trained on a frozen drafter, a small network with its own forward pass
(one transformer layer over the drafter's block, projected through the drafter's LM head) predicts the tokens at
sparse block offsets; the confident ones are fixed and the gaps filled as for the fused heads of train/jump.py
(models/jump_head.py). Its cost is measured, not assumed: the head runs inside the method's selection time.

Stage: train/jump_head/ in the run folder. Export: the drafter's export plus `jump_head.*` (models/jump_head.py:
SeparateJumpHead's state_dict) and `jump_head_offsets`, `jump_head_margin`, `jump_head_num_heads`,
`jump_head_intermediate_size`, `jump_head_top_k` in `dflash_config`. Eval methods (greedy decoding only; they need the
trained block size): jump_head (gaps take the drafter's argmax) and jump_head_selector (gaps are the trained
selector's best path between their fixed neighbours).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from dflash_pipeline.conf.schema import ranged
from dflash_pipeline.models.jump import default_offsets
from dflash_pipeline.models.jump_head import SeparateJumpHead, head_path, jump_head_loss
from dflash_pipeline.models.selector import PairSelector
from dflash_pipeline.train.errors import TrainError
from dflash_pipeline.train.frozen import FrozenComponentConfig, FrozenDrafterComponent, OffsetHeadMethod, \
    load_trained, offset_head_methods, scored_rates
from dflash_pipeline.train.selector import load_selector

PREFIX = "jump_head."


@dataclass
class JumpHeadConfig(FrozenComponentConfig):
    """conf/jump_head/: the separate jump head."""

    every: int = ranged(4, ge=1)  # offsets at block positions every, 2*every, ... (the anchor is position 0)
    margin: float = 0.0  # fix an offset when the head's top-1 minus top-2 logit is at least this
    num_heads: int = ranged(4, ge=1)  # attention heads of the head's layer (must divide the drafter's hidden size)
    intermediate_size: Optional[int] = ranged(None, ge=1)  # its SwiGLU width; None: 2 x the drafter's hidden size
    top_k: int = ranged(16, ge=2)  # the drafter's candidates per position, for the gap fill and the selector


class JumpHeadComponent(FrozenDrafterComponent):
    name = section = "jump_head"

    def __init__(self, cfg, inputs, device):
        super().__init__(cfg, inputs, device)
        c, o = self.drafter.config, self.own
        if c.hidden_size % o.num_heads:
            raise TrainError(f"jump_head.num_heads={o.num_heads} must divide the drafter's hidden size "
                             f"{c.hidden_size}")
        self.offsets = default_offsets(self.block_size, o.every)
        self.at = torch.tensor(self.offsets, device=device) - 1  # index of block position o_j among positions 1..B-1
        self.to_column = self.drafter.target_to_column()
        self.model = SeparateJumpHead(c.hidden_size, self.block_size, self.offsets, o.num_heads,
                                      o.intermediate_size, c.rms_norm_eps).to(device)

    def _scored(self, batch: dict) -> torch.Tensor:
        at = self.at
        return batch["valid"][:, at] & (self.to_column[batch["labels"][:, at]] >= 0)

    def normaliser(self, batch: dict) -> float:
        return float((self._scored(batch) * self.position_weights(batch)[:, self.at]).sum())

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, dict]:
        at, b = self.at, batch
        weights = self.position_weights(b)[:, at]
        return jump_head_loss(model, self.drafter, b["hidden"], b["labels"][:, at], b["valid"][:, at], weights,
                              marginal_ids=b["cand_ids"][:, at, 0])

    def train_metrics(self, stats: list[dict]) -> dict:
        return scored_rates(stats, "vocab_coverage", head_acc="correct", marginal_acc="correct_marginal")

    def evaluate(self, model) -> dict:
        m = self.heldout_metrics(model, lambda head: {"jump_head": jump_head_method(self.drafter, head, self.own.margin,
                                                                                    self.own.top_k)})
        return self.method_summary(m, "jump_head")

    def export(self, head, folder: Path) -> Path:
        return self.export_with_drafter(
            folder, {PREFIX + k: v for k, v in head.state_dict().items()},
            {"jump_head_offsets": head.offsets, "jump_head_margin": self.own.margin,
             "jump_head_num_heads": head.num_heads, "jump_head_intermediate_size": head.intermediate_size,
             "jump_head_top_k": self.own.top_k},
            {"drafter_dir": str(self.drafter_dir), "steps": self.settings.steps})


def jump_head_method(drafter, head: SeparateJumpHead, margin: float, top_k: int = 16,
                     selector: PairSelector | None = None) -> OffsetHeadMethod:
    """Drafts guided by the separate head (models/jump_head.py head_path: fixed at its argmax where its margin
    passes `margin`), the gaps filled as for `jump`."""
    def guide(ids, logits, hidden, anchors, transition):
        return head_path(ids, logits, hidden, anchors, head, drafter, margin, transition)

    return OffsetHeadMethod(drafter, "jump_head", head, top_k, guide, selector, margin=margin)


def load_jump_head(folder: Path, drafter, selector: PairSelector | None = None) -> OffsetHeadMethod:
    """The jump_head method of an export written by JumpHeadComponent.export; with a selector, the gaps between
    fixed tokens are its best path from both neighbours."""
    head, dc = load_trained(folder, PREFIX, lambda c, dc: SeparateJumpHead(
        c["hidden_size"], c["block_size"], dc["jump_head_offsets"], dc["jump_head_num_heads"],
        dc["jump_head_intermediate_size"], c["rms_norm_eps"]), drafter.norm.weight.device)
    return jump_head_method(drafter, head, dc["jump_head_margin"], dc["jump_head_top_k"], selector)


# The catalogue entry (conf/catalogue.py).
CONFIG = JumpHeadConfig
SECTIONS = ("jump_head",)
INPUTS = ("teacher", "drafter")
COMPONENT = JumpHeadComponent
METHODS = offset_head_methods("jump_head", load_jump_head, load_selector)  # jump_head, jump_head_selector

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

from pathlib import Path

import torch

from dflash_pipeline.models.jump import default_offsets
from dflash_pipeline.eval.components import jump_head_method
from dflash_pipeline.models.jump_head import JUMP_HEAD_PREFIX, SeparateJumpHead, jump_head_loss
from dflash_pipeline.train.errors import TrainError
from dflash_pipeline.train.frozen import FrozenDrafterComponent, scored_rates

PREFIX = JUMP_HEAD_PREFIX


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

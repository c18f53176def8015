"""DFlash5 fused low-rank jump heads as a component: trained on a frozen drafter, they re-rank the drafter's top-K at
sparse block offsets from the drafter's own hidden state one position earlier (no extra model forward), fix the
confident ones, and the gaps between fixed tokens take the drafter's argmax (models/jump.py).

Stage: train/jump/ in the run folder. Export: the drafter's export plus `jump_heads.{projection.weight [r, H],
offset_embedding.weight [J, r], codebook [V, r]}` and `jump_offsets`, `jump_rank`, `jump_top_k`, `jump_margin`,
`jump_weight` in `dflash_config`. Eval methods (greedy decoding only; they need the trained block size): jump
(gaps take the drafter's argmax) and jump_selector (gaps are the trained selector's best path between their fixed
neighbours).
"""
from __future__ import annotations

from pathlib import Path

import torch

from dflash_pipeline.eval.components import jump_method
from dflash_pipeline.models.jump import JUMP_PREFIX, JumpHeads, default_offsets, jump_loss
from dflash_pipeline.train.errors import TrainError
from dflash_pipeline.train.frozen import FrozenDrafterComponent, scored_rates

PREFIX = JUMP_PREFIX


class JumpComponent(FrozenDrafterComponent):
    name = section = "jump"

    def __init__(self, cfg, inputs, device):
        super().__init__(cfg, inputs, device)
        c = self.drafter.config
        self.offsets = default_offsets(self.block_size, self.own.every)
        self.at = torch.tensor(self.offsets, device=device) - 1  # index of block position o_j among positions 1..B-1
        if self.own.kl_weight > 0 and "topk_ids" not in self.data[self.train_idx[0]]:
            raise TrainError(f"jump.kl_weight={self.own.kl_weight} needs teacher data with top-k log-probs: "
                             "regenerate it with teacher.topk_logprobs=<k>, or set jump.kl_weight=0")
        self.model = JumpHeads(c.vocab_size, c.hidden_size, self.block_size, self.offsets, self.own.rank).to(device)

    def _scored(self, batch: dict) -> torch.Tensor:
        at = self.at
        return batch["valid"][:, at] & (batch["cand_ids"][:, at] == batch["labels"][:, at, None]).any(-1)

    def normaliser(self, batch: dict) -> float:
        return float((self._scored(batch) * self.position_weights(batch)[:, self.at]).sum())

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, dict]:
        at, b = self.at, batch
        teacher = {}
        if self.own.kl_weight > 0 and "topk_ids" in b:
            teacher = {"teacher_ids": b["topk_ids"][:, at], "teacher_logprobs": b["topk_logprobs"][:, at],
                       "kl_weight": self.own.kl_weight}
        weights = self.position_weights(b)[:, at]
        return jump_loss(model, b["hidden"], b["cand_ids"][:, at], b["U"][:, at], b["labels"][:, at],
                         b["valid"][:, at], weight=self.own.weight, position_weights=weights, **teacher)

    def train_metrics(self, stats: list[dict]) -> dict:
        return scored_rates(stats, "candidate_recall", jump_acc="correct", marginal_acc="correct_marginal")

    def evaluate(self, model) -> dict:
        o = self.own
        m = self.heldout_metrics(model, lambda heads: {"jump": jump_method(self.drafter, heads, o.margin, o.weight,
                                                                           o.top_k)})
        return self.method_summary(m, "jump")

    def export(self, heads, folder: Path) -> Path:
        o = self.own
        return self.export_with_drafter(
            folder, {PREFIX + k: v for k, v in heads.state_dict().items()},
            {"jump_offsets": self.offsets, "jump_rank": o.rank, "jump_top_k": o.top_k, "jump_margin": o.margin,
             "jump_weight": o.weight},
            {"drafter_dir": str(self.drafter_dir), "steps": self.settings.steps})

"""The DFlash2 pair-codebook selector as a component: trained on a frozen drafter, it picks the block's drafts among
the drafter's top-K candidates with pair scores S_t(a, b) = U_t(b) + <A[a] * H(h_t), B[b]> (models/selector.py).

Stage: train/selector/ in the run folder. Export: the drafter's export plus the selector's tensors under the
DFlash2 names `candidate_selector.{hidden_projection.weight [r, H], predecessor_codebook [V, r],
successor_codebook [V, r]}` and `selector_rank` / `selector_top_k` in `dflash_config`. The codebooks index the
target vocabulary, also for a draft-vocabulary drafter (candidates are mapped to target ids first).
Eval methods: selector_greedy (left-to-right walk, K scorings per position) and selector_viterbi (exact best path,
K^2 per position). At temperature > 0 selector_greedy samples the walk and returns the distributions drawn from;
selector_viterbi, the exact best path, is greedy only (its sampled form would be the walk, not a Viterbi: refused).
"""
from __future__ import annotations

from pathlib import Path

import torch

from dflash_pipeline.eval.components import SelectorMethod
from dflash_pipeline.models.selector import SELECTOR_PREFIX as PREFIX
from dflash_pipeline.models.selector import PairSelector, selector_loss
from dflash_pipeline.train.frozen import FrozenDrafterComponent, scored_rates


class SelectorComponent(FrozenDrafterComponent):
    name = section = "selector"

    def __init__(self, cfg, inputs, device):
        super().__init__(cfg, inputs, device)
        c = self.drafter.config
        self.model = PairSelector(c.vocab_size, c.hidden_size, self.own.rank, self.own.top_k).to(device)

    def normaliser(self, batch: dict) -> float:
        """The position weights of the positions the selector can score (true token among the candidates)."""
        scored = batch["valid"] & (batch["cand_ids"] == batch["labels"][..., None]).any(-1)
        return float((scored * self.position_weights(batch)).sum())

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, dict]:
        return selector_loss(model, batch["hidden"][:, 1:], batch["cand_ids"], batch["U"], batch["prev_true"],
                             batch["labels"], batch["valid"], self.position_weights(batch))

    def train_metrics(self, stats: list[dict]) -> dict:
        return selector_rates(stats)

    def evaluate(self, model) -> dict:
        """Teacher-forced on the held-out sequences: the greedy and Viterbi paths against the chain's and the
        oracle's (any choice among the top-K)."""
        m = self.heldout_metrics(model, lambda selector: {f"selector_{how}": SelectorMethod(self.drafter, selector, how)
                                                          for how in ("greedy", "viterbi")})
        return {**self.method_summary(m, "selector_greedy"),
                "viterbi_tau_offline": m["methods"]["selector_viterbi"]["tau_offline"]}

    def export(self, selector, folder: Path) -> Path:
        tensors = {PREFIX + k: v for k, v in selector.state_dict().items()}
        return self.export_with_drafter(folder, tensors, selector.config_dict(),
                                        {"drafter_dir": str(self.drafter_dir), "steps": self.settings.steps})


def selector_rates(stats: list[dict]) -> dict[str, float]:
    """The selector's train metrics from selector_loss stats, on a frozen drafter or trained jointly with it."""
    return scored_rates(stats, "candidate_recall", selector_acc="selector_correct", marginal_acc="marginal_correct")

"""The Weaver adapter as a component (models/weaver.py): trained on a frozen drafter and the frozen target,
teacher-forced along the true path of the teacher data, it rescores each depth's pool (the drafter's top-K) given
the path so far; at eval it grows draft trees with the modified DySpec builder (eval/tree.py: build_tree).

Training needs the target's final hidden state of the row before each anchor, which the teacher data does not
store: it is captured from the frozen target once per sequence, when the sequence is first used, and kept in memory.
Loss: CE on the true token where it is in the pool (how often it is not is reported as `pool_miss`), plus
weaver.kl_weight x KL and weaver.tv_weight x TV against the target's stored top-k distribution restricted to the
pool (teacher.topk_logprobs data).

Stage: train/weaver/ in the run folder. Export: the drafter's export plus `weaver.*` tensors and the adapter's
shape under `weaver` in `dflash_config`. Eval method: weaver_tree, one per node budget of eval.tree_budgets
(greedy verification; the training-free ddtree of train/drafter.py is its baseline).
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from dflash_pipeline.data.splits import anchor_generators
from dflash_pipeline.eval.metrics import conditional_acceptance, simulated_tau
from dflash_pipeline.eval.components import WeaverTreeMethod
from dflash_pipeline.eval.tree import DDTreeMethod, tree_offline_metrics
from dflash_pipeline.models.generation import capture
from dflash_pipeline.models.weaver import WEAVER_PREFIX, Weaver, weaver_loss
from dflash_pipeline.train.errors import TrainError
from dflash_pipeline.train.frozen import FrozenDrafterComponent, summed

PREFIX = WEAVER_PREFIX
log = logging.getLogger(__name__)


class WeaverComponent(FrozenDrafterComponent):
    name = section = "weaver"

    def __init__(self, cfg, inputs, device):
        super().__init__(cfg, inputs, device)
        o = self.own
        if (o.kl_weight > 0 or o.tv_weight > 0) and "topk_ids" not in self.data[self.train_idx[0]]:
            raise TrainError("weaver.kl_weight / tv_weight need teacher data with top-k log-probs: regenerate it "
                             "with teacher.topk_logprobs=<k>, or set both to 0")
        try:
            self.model = Weaver(self.drafter.config.hidden_size, o.rank, o.num_layers, o.num_heads, o.mlp_dim,
                                o.top_k).to(device)
        except ValueError as err:  # a shape the settings cannot build
            raise TrainError(f"{err}: fix the weaver.* settings") from err
        self.final_hidden: dict[int, torch.Tensor] = {}  # sequence index -> the target's final hidden states
        log.info("weaver: %d parameters (rank %d, %d layers, pool %d)", self.model.num_parameters(), o.rank,
                 o.num_layers, o.top_k)

    # -- data: teacher items with the target's final hidden states --------------------------------------------
    @torch.no_grad()
    def items(self, indices: list[int]) -> list[dict]:
        """Teacher items with `final_hidden`, captured from the frozen target the first time a sequence is used."""
        items = {i: self.data[i] for i in indices}  # each sequence read once
        missing = [i for i in items if i not in self.final_hidden]
        for start in range(0, len(missing), 8):
            part = missing[start:start + 8]
            outs = capture(self.target.model, [items[i]["input_ids"].tolist() for i in part], [],
                           pad_id=self.target.tokenizer.pad_token_id, final=True)
            for i, o in zip(part, outs):
                self.final_hidden[i] = o["final_hidden"].float().cpu()
        return [{**items[i], "final_hidden": self.final_hidden[i]} for i in indices]

    def batch(self, indices: list[int], step: int, slot0: int = 0) -> dict:
        return self.drafter_outputs(self.items(indices), self.own.top_k, self.settings.anchors_per_sequence,
                                    anchor_generators(self.cfg.seed, step, slot0, len(indices)))

    def heldout_items(self) -> list[dict]:
        return self.items(self.heldout_idx)

    # -- loss ---------------------------------------------------------------------------------------------------
    def normaliser(self, batch: dict) -> float:
        return float(batch["valid"].sum())

    def forward_chain(self, weaver: Weaver, b: dict) -> torch.Tensor:
        """The pool log-probs (N, B-1, K) along the true path of each block."""
        path = torch.cat([b["anchors"][:, None], b["labels"][:, :-1]], 1)  # tokens at depths 0 .. B-2
        lm = self.drafter.lm_head.weight
        return weaver.chain_log_probs(b["verifier_hidden"], b["hidden"][:, 1:], self.drafter.embed_tokens(path),
                                      b["U"], lm[b["cand_ids"]])

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, dict]:
        b = batch
        logp = self.forward_chain(model, b)
        teacher = {}
        if "topk_ids" in b:
            teacher = {"target_ids": b["topk_ids"], "target_logprobs": b["topk_logprobs"]}
        return weaver_loss(logp, b["cand_ids"], b["labels"], b["valid"], **teacher, kl_weight=self.own.kl_weight,
                           tv_weight=self.own.tv_weight)

    def train_metrics(self, stats: list[dict]) -> dict:
        total = summed(stats)
        return {"pool_miss": 1 - total["in_pool"] / max(1.0, total["positions"]),
                "weaver_acc": total["correct"] / max(1.0, total["in_pool"]),
                "ce_in_pool": total["ce_sum"] / max(1.0, total["in_pool"])}

    # -- held-out metrics ------------------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, weaver) -> dict:
        """Teacher-forced on the held-out sequences (every anchor): the Weaver's greedy path (a_k, tau_offline)
        against the drafter's, how often the true token is outside the pool; and on the first eval_blocks blocks,
        the tau_offline of the Weaver tree and of DDTree at eval_budget nodes (tree_offline_metrics)."""
        was_training = weaver.training
        weaver.eval()
        corrects, marginals, valids, hits = [], [], [], []
        items = self.heldout_items()
        for it in items:
            b = self.drafter_outputs([it], self.own.top_k, None)
            logp = torch.cat([self.forward_chain(weaver, {k: v[i:i + 32] for k, v in b.items()})
                              for i in range(0, b["anchors"].shape[0], 32)])  # the pool rows of 32 blocks at a time
            pick = b["cand_ids"].gather(-1, logp.argmax(-1, keepdim=True)).squeeze(-1)
            corrects.append(pick == b["labels"])
            marginals.append(b["cand_ids"][..., 0] == b["labels"])
            valids.append(b["valid"])
            hits.append((b["cand_ids"] == b["labels"][..., None]).any(-1)[b["valid"]])
        budget = self.own.eval_budget
        trees = tree_offline_metrics(self.drafter, items, self.block_size, {
            "weaver_tree": WeaverTreeMethod(self.drafter, weaver, budget, self.own.children, self.own.root_children,
                                           self.own.expansions),
            "ddtree": DDTreeMethod(self.drafter, budget)}, max_blocks=self.own.eval_blocks)
        weaver.train(was_training)
        valid = torch.cat(valids)
        a, _ = conditional_acceptance(torch.cat(corrects), valid)
        chain, _ = conditional_acceptance(torch.cat(marginals), valid)
        out = {"a_k": a, "tau_offline": simulated_tau(a), "chain_tau_offline": simulated_tau(chain),
               "pool_miss": 1 - float(torch.cat(hits).float().mean())}
        out.update({f"{name}_tau@{budget}": m["tau_offline"] for name, m in trees.items()})
        return out

    def export(self, weaver, folder: Path) -> Path:
        tensors = {PREFIX + k: v for k, v in weaver.state_dict().items()}
        return self.export_with_drafter(folder, tensors, {"weaver": weaver.config_dict()},
                                        {"drafter_dir": str(self.drafter_dir), "steps": self.settings.steps,
                                         "parameters": weaver.num_parameters()})

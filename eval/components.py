"""The decoding methods the trained components bring, and how each loads from its component's export.

The drafter's own methods live with the protocol (eval/protocol.py: the chain), the policies (eval/policies.py) and
the trees (eval/tree.py: DDTree); these need a component trained on the frozen drafter (train/<component>.py writes
the export, docs/export.md its format): the selector's walks (DFlash2), the offset heads' guided drafts (DFlash5 jump
heads, the separate jump head), the Weaver's trees. Every method is reached through the catalogue, eval/methods.py.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch

from dflash_pipeline.eval.protocol import ChainMethod
from dflash_pipeline.eval.tree import TreeMethod, build_tree
from dflash_pipeline.models.jump import JUMP_PREFIX, JumpHeads, guided_path
from dflash_pipeline.models.jump_head import JUMP_HEAD_PREFIX, SeparateJumpHead, head_path
from dflash_pipeline.models.selector import SELECTOR_PREFIX, PairSelector, scorings_per_round
from dflash_pipeline.models.weaver import WEAVER_PREFIX, Weaver, WeaverRound


# -- reading a component's export --------------------------------------------------------------------------------
def load_trained(folder: Path, prefix: str, build: Callable[[dict, dict], torch.nn.Module], device,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.nn.Module, dict]:
    """(the trained module, dflash_config) of a component's export: build(config.json, its dflash_config) makes the
    module, which loads the tensors under `prefix` strictly (safetensors only) and moves to device/dtype, eval mode."""
    config, tensors = read_export(folder, prefix)
    module = build(config, config["dflash_config"])
    module.load_state_dict(tensors, strict=True)
    return module.to(device=device, dtype=dtype).eval(), config["dflash_config"]


def read_export(folder: Path, prefix: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json, the tensors under `prefix` with it stripped) of a component's export (safetensors only)."""
    from safetensors.torch import load_file

    config = json.loads((Path(folder) / "config.json").read_text())
    tensors = {k[len(prefix):]: v for k, v in load_file(str(Path(folder) / "model.safetensors")).items()
               if k.startswith(prefix)}
    return config, tensors


# -- the selector (DFlash2) -------------------------------------------------------------------------------------
def load_selector(folder: Path, device: torch.device, dtype: torch.dtype = torch.float32) -> PairSelector:
    """The selector of an export written by SelectorComponent.export (safetensors + config.json only)."""
    return load_trained(folder, SELECTOR_PREFIX, lambda c, dc: PairSelector(c["vocab_size"], c["hidden_size"],
                                                                  dc["selector_rank"], dc["selector_top_k"]),
                        device, dtype)[0]


class SelectorMethod(ChainMethod):
    """Drafts chosen by the selector among the drafter's top-K: `how` = greedy (walk) or viterbi."""

    def __init__(self, drafter, selector: PairSelector, how: str):
        super().__init__(drafter)
        self.selector, self.how = selector, how
        self.name, self.top_k = f"selector_{how}", selector.top_k
        self.greedy_only = how == "viterbi"  # sampling runs the walk: refused rather than silently swapped

    def path(self, cand_ids, cand_logits, hidden, anchors, context=None):
        walk = self.selector.greedy_walk if self.how == "greedy" else self.selector.viterbi
        tokens = walk(cand_ids, cand_logits, hidden[:, 1:].float(), anchors)
        return tokens, scorings_per_round(self.how, cand_ids.shape[1], cand_ids.shape[-1])

    def sample_path(self, logits, hidden, anchor, temperature, generator):
        U, idx = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1)
        cand = self.drafter.to_target_ids(idx)[None]
        anchors = torch.tensor([anchor], device=logits.device)
        ids, q = self.selector.sample_walk(cand, U[None], hidden[:, 1:].float(), anchors, temperature, generator)
        return ids[0], q[0]



# -- offset heads: the jump heads (DFlash5) and the separate jump head -----------------------------------------
# guide(cand_ids, cand_logits, hidden, anchors, transition) -> (drafts (N, P), candidate scorings per block (N,)),
# given the selector's transition (None: the gaps take the argmax)
Guide = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class OffsetHeadMethod(ChainMethod):
    """Drafts guided by heads at sparse block offsets (the jump heads, the separate jump head: `module`, with its
    `guide`): offsets whose head is confident are fixed at its choice, the gaps take the drafter's argmax or, with a
    selector, its best path from both neighbours. Greedy only, at the heads' block size only."""

    greedy_only = True

    def __init__(self, drafter, name: str, module: torch.nn.Module, top_k: int, guide: Guide, selector=None,
                 **settings):
        super().__init__(drafter)
        self.module, self.guide, self.settings = module, guide, settings  # settings: what `guide` was built with
        self.head_block_size, self.top_k, self.selector = module.block_size, top_k, selector
        self.name = name if selector is None else f"{name}_selector"
        if selector is not None and selector.top_k != top_k:
            raise ValueError(f"{self.name} needs the same candidates: selector.top_k={selector.top_k}, "
                             f"{name}.top_k={top_k}")

    def check(self, block_size: int, temperature: float) -> None:
        if block_size != self.head_block_size:
            raise ValueError(f"{self.name} was trained for block {self.head_block_size}; evaluate it at "
                             f"eval.block_size={self.head_block_size}")
        super().check(block_size, temperature)

    def path(self, cand_ids, cand_logits, hidden, anchors, context=None):
        self.check(hidden.shape[1], 0.0)
        transition = None if self.selector is None else self.selector.transition
        ids, work = self.guide(cand_ids, cand_logits, hidden.float(), anchors, transition)
        return ids, float(work.float().mean())

    def sample_path(self, logits, hidden, anchor, temperature, generator):
        self.check(hidden.shape[1], temperature)



def jump_method(drafter, heads: JumpHeads, margin: float, weight: float, top_k: int = 16,
                selector: PairSelector | None = None) -> OffsetHeadMethod:
    """Drafts guided by the jump heads (models/jump.py guided_path: the heads' residual on the candidates, weight
    `weight`, fixed where the top-1/top-2 margin passes `margin`)."""
    def guide(ids, logits, hidden, anchors, transition):
        return guided_path(ids, logits, hidden, anchors, heads, margin, weight, transition)

    return OffsetHeadMethod(drafter, "jump", heads, top_k, guide, selector, margin=margin, weight=weight)


def load_jump(folder: Path, drafter, selector: PairSelector | None = None) -> OffsetHeadMethod:
    """The jump method of an export written by JumpComponent.export; with a selector, the gaps between fixed tokens
    are its best path from both neighbours."""
    heads, dc = load_trained(folder, JUMP_PREFIX, lambda c, dc: JumpHeads(c["vocab_size"], c["hidden_size"],
                                                                     c["block_size"], dc["jump_offsets"],
                                                                     dc["jump_rank"]), drafter.norm.weight.device)
    return jump_method(drafter, heads, dc["jump_margin"], dc["jump_weight"], dc["jump_top_k"], selector)


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
    head, dc = load_trained(folder, JUMP_HEAD_PREFIX, lambda c, dc: SeparateJumpHead(
        c["hidden_size"], c["block_size"], dc["jump_head_offsets"], dc["jump_head_num_heads"],
        dc["jump_head_intermediate_size"], c["rms_norm_eps"]), drafter.norm.weight.device)
    return jump_head_method(drafter, head, dc["jump_head_margin"], dc["jump_head_top_k"], selector)


# -- the Weaver's trees -----------------------------------------------------------------------------------------
def load_weaver(folder: Path, device: torch.device, dtype: torch.dtype = torch.float32) -> Weaver:
    """The Weaver of an export written by WeaverComponent.export (safetensors + config.json only)."""
    return load_trained(folder, WEAVER_PREFIX, lambda c, dc: Weaver(**dc["weaver"]), device, dtype)[0]


@torch.no_grad()
def weaver_tree(weaver: Weaver, drafter, verifier_hidden: torch.Tensor, hidden: torch.Tensor, anchor: int,
                budget: int, children: int = 8, calls: list | None = None, root_children: int | None = None,
                expansions: int = 4):
    """The Weaver tree of one block: hidden (B, H) the drafter's block states (anchor first). `calls`, when given,
    receives the number of nodes of each Weaver call."""
    logits = drafter.logits(hidden[1:]).float()
    top = logits.topk(min(weaver.top_k, logits.shape[-1]), -1)
    rnd = WeaverRound(weaver, verifier_hidden.to(hidden.dtype), hidden[1:], drafter.to_target_ids(top.indices),
                      top.values, drafter.lm_head.weight, drafter.embed_tokens, anchor)
    root = root_breadth(budget, children, root_children)
    k = max(children, root)
    tree, sizes = build_tree(lambda nodes, grown: rnd.expand(nodes, *grown.fields(nodes, anchor), k), budget,
                             hidden.shape[0] - 1, children, math.ceil(budget / expansions), root)
    if calls is not None:
        calls.extend(sizes)
    return tree


def root_breadth(budget: int, children: int, root_children: int | None = None) -> int:
    """The depth-1 candidates the root publishes: `root_children` when set, else half the node budget, at least
    `children` and at most 32: a weak drafter's acceptance is decided at depth 1, so the root widens with the budget
    (the comparison with a root of `children` is in docs/results/trees.md)."""
    if root_children is not None:
        return root_children
    return min(32, max(children, budget // 2))


class WeaverTreeMethod(TreeMethod):
    """Trees grown by the Weaver from the drafter's pools (docs/methods.md, 'Draft trees')."""

    def __init__(self, drafter, weaver: Weaver, budget: int, children: int = 8, root_children: int | None = None,
                 expansions: int = 4):
        super().__init__(drafter, budget)
        self.weaver, self.children, self.root_children, self.expansions = weaver, children, root_children, expansions
        self.name = f"weaver_tree_{budget}"

    def tree(self, hidden, verifier_hidden, anchor):
        return weaver_tree(self.weaver, self.drafter, verifier_hidden, hidden, anchor, self.budget, self.children,
                           root_children=self.root_children, expansions=self.expansions)

"""Draft trees: their construction (DDTree, the DySpec-style builder) and their greedy verification by the target.

A tree hangs below the anchor (the root, committed by the target at position L). The target verifies the whole tree
in ONE forward over [anchor, nodes...]: node i sits at position L + depth(i) and attends to the L cached tokens and,
among the new tokens, to exactly its ancestors and itself, so each node's logits are the ones a chain forward over its
own path would give. Greedy acceptance walks from the root down the child that matches the target's argmax; the KV
rows of the accepted path are then moved next to the cache's committed prefix (no recomputation).

transformers 5.x: a 4D `attention_mask` (batch, 1, q_len, kv_len) bypasses the model's mask construction
(masking_utils._preprocess_mask_arguments returns it as is). Eager attention ADDS the mask to the scores and sdpa
takes a float mask as additive too, so the mask is a float tensor: 0 where allowed, the dtype's minimum elsewhere.
Kernels that take no dense mask (flash attention, flex) would ignore the tree structure, so they are refused.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import DynamicCache

from dflash_pipeline.eval.metrics import conditional_acceptance, simulated_tau
from dflash_pipeline.eval.protocol import ChainMethod, Proposal, RoundState, drafter_blocks, sync
from dflash_pipeline.models import cache as target_cache
from dflash_pipeline.models.families import tapped, text_config

DENSE_MASK_ATTENTION = ("eager", "sdpa")  # attention implementations that honour a custom 4D float mask


@dataclass
class DraftTree:
    """Draft nodes below the anchor (the root, not stored), in topological order (a parent before its children)."""

    tokens: torch.Tensor  # (n,) long: target token ids
    parents: torch.Tensor  # (n,) long: index of the parent node among these nodes, -1 = the root (anchor)
    depths: torch.Tensor  # (n,) long: 1 .. B-1 (the root is depth 0)
    scores: torch.Tensor | None = None  # (n,) float path log-probability, when the builder has one

    @staticmethod
    def chain(tokens: torch.Tensor) -> "DraftTree":
        """A single path (a block's drafts): node i hangs under node i-1."""
        n = tokens.shape[0]
        idx = torch.arange(n, device=tokens.device)
        return DraftTree(tokens.long(), idx - 1, idx + 1)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class TreeVerdict:
    path: list[int]  # accepted node indices, root's child first (len = accepted)
    tokens: list[int]  # their tokens
    next_anchor: int  # the target's token after the accepted path
    features: torch.Tensor  # (1 + accepted, n*Ht) tapped features of [anchor, accepted nodes]
    logits: torch.Tensor  # (n + 1, V) the target's logits over [anchor, nodes] (for tests / metrics)
    final: torch.Tensor | None = None  # (1 + accepted, Ht) the target's last hidden states of [anchor, accepted nodes]


# -- verification ----------------------------------------------------------------------------------------------------
def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """(n+1, n+1) bool over [root, nodes...]: row i is True at j iff j is i or an ancestor of i (the root: all)."""
    par = parents.tolist()
    n = len(par)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for i, p in enumerate(par):
        if not -1 <= p < i:
            raise ValueError(f"node {i} has parent {p}: parents must come first (topological order)")
        mask[i + 1] = mask[p + 1]  # parents come first, so the parent's row is complete
        mask[i + 1, i + 1] = True
    return mask


def tree_attention_mask(parents: torch.Tensor, L: int, dtype: torch.dtype, device, window: int | None = None,
                        depths: torch.Tensor | None = None) -> torch.Tensor:
    """(1, 1, n+1, L+n+1) additive float mask: every cached position, then the ancestors (and self) of each row.
    With a sliding `window` (and the nodes' depths), a row at position p sees only keys at positions > p - window,
    as decoding applies the window."""
    allowed = torch.cat([torch.ones(len(parents) + 1, L, dtype=torch.bool), ancestor_mask(parents)], dim=1)
    if window is not None:
        q_pos = L + torch.cat([torch.zeros(1, dtype=torch.long), depths.cpu()])
        k_pos = torch.cat([torch.arange(L), q_pos])
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.to(device)[None, None]


TREE_LAYER_TYPES = {"full_attention", "sliding_attention"}  # the layer types tree_masks builds a mask for


def untreeable_layer_types(model) -> list[str]:
    """The target's layer types a tree mask cannot be built for (e.g. chunked attention)."""
    types = set(getattr(text_config(model), "layer_types", None) or [])
    return sorted(types - TREE_LAYER_TYPES)


def tree_masks(model, tree: "DraftTree", L: int, device) -> torch.Tensor | dict[str, torch.Tensor]:
    """The tree mask a target's forward takes: one tensor, or for targets with sliding-window layers one per layer
    type (transformers' models take {layer type: mask}), the sliding one with the window applied."""
    config = text_config(model)
    full = tree_attention_mask(tree.parents.cpu(), L, model.dtype, device)
    types = set(getattr(config, "layer_types", None) or [])
    if untreeable_layer_types(model):  # never a tree verified under the wrong mask
        raise ValueError(f"tree verification builds masks for full and sliding attention only; {type(model).__name__} "
                         f"has {', '.join(untreeable_layer_types(model))} layers: use a chain method")
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" not in types or not window:
        return full
    return {"full_attention": full, "sliding_attention": tree_attention_mask(
        tree.parents.cpu(), L, model.dtype, device, window=window, depths=tree.depths)}


def _children(parents: list[int]) -> list[list[int]]:
    """children[p + 1]: the nodes under p (p = -1: the root), in index order."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        out[p + 1].append(i)
    return out


def _walk_greedy(tree: DraftTree, best: list[int]) -> list[int]:
    """Accepted nodes: from the root, the (first) child whose token equals the target's argmax at the current row."""
    kids, tokens = _children(tree.parents.tolist()), tree.tokens.tolist()
    path: list[int] = []
    cur = -1
    while True:
        nxt = next((c for c in kids[cur + 1] if tokens[c] == best[cur + 1]), None)
        if nxt is None:
            return path
        path.append(nxt)
        cur = nxt


@torch.no_grad()
def verify_tree(model, cache: DynamicCache, L: int, anchor: int, tree: DraftTree, layer_ids: list[int]) -> TreeVerdict:
    """One target forward over [anchor, tree nodes] on `cache` (holding exactly the L tokens before the anchor),
    greedy acceptance, and cache compaction: afterwards the cache holds L + 1 + accepted tokens.

    features are those of target_forward (eval/protocol.py): hidden_states[i + 1] for i in layer_ids, concatenated;
    final: hidden_states[-1], the rows the LM head reads (a drafter conditioned on the verifier's state needs it).
    """
    impl = model.config._attn_implementation
    if impl not in DENSE_MASK_ATTENTION:
        raise ValueError(f"tree verification needs a dense attention mask: attention {impl!r} is not one of "
                         f"{DENSE_MASK_ATTENTION} (model.set_attn_implementation('sdpa'))")
    if target_cache.is_recurrent(model):
        raise target_cache.CacheError(f"tree verification needs per-branch states, which the recurrent target "
                                      f"{type(model).__name__} does not have: use a chain method")
    if target_cache.seq_length(cache) != L:
        raise ValueError(f"the cache holds {target_cache.seq_length(cache)} tokens, expected L = {L}")
    device = next(model.parameters()).device
    ids = torch.cat([torch.tensor([anchor]), tree.tokens.cpu()]).to(device)[None]
    positions = (L + torch.cat([torch.zeros(1, dtype=torch.long), tree.depths.cpu()])).to(device)[None]
    mask = tree_masks(model, tree, L, device)
    out = model(input_ids=ids, position_ids=positions, attention_mask=mask, cache=cache, use_cache=True,
                output_hidden_states=True)
    logits = out.logits[0]
    best = logits.argmax(-1).tolist()  # the target's greedy token after each row
    path = _walk_greedy(tree, best)
    keep = [0] + [i + 1 for i in path]  # rows of [anchor, accepted nodes]
    rows = torch.tensor(keep, device=device)
    feats = tapped(out.hidden_states, layer_ids)[0].index_select(0, rows)
    target_cache.keep_path(cache, L, rows)
    return TreeVerdict(path=path, tokens=tree.tokens[path].tolist(), next_anchor=best[keep[-1]], features=feats,
                       logits=logits, final=out.hidden_states[-1][0].index_select(0, rows))


# -- construction ----------------------------------------------------------------------------------------------------
def _tree(tokens: list[int], parents: list[int], depths: list[int], scores: list[float], device=None) -> DraftTree:
    long = dict(dtype=torch.long, device=device)
    return DraftTree(torch.tensor(tokens, **long), torch.tensor(parents, **long), torch.tensor(depths, **long),
                     torch.tensor(scores, dtype=torch.float32, device=device))


@dataclass
class GrowingTree:
    """The tree build_tree has grown so far, as Python lists: an expand call reads a few nodes of it, which costs
    nothing here and a tensor element read each on a DraftTree."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    scores: list[float]

    def __len__(self) -> int:
        return len(self.tokens)

    def fields(self, nodes: list[int], anchor: int) -> tuple[list[int], list[int], list[int]]:
        """Tokens, parents and depths of `nodes` (-1: the root, the anchor at depth 0)."""
        return ([anchor if n < 0 else self.tokens[n] for n in nodes], [-1 if n < 0 else self.parents[n] for n in nodes],
                [0 if n < 0 else self.depths[n] for n in nodes])


def ddtree(logprobs: torch.Tensor, ids: torch.Tensor, budget: int) -> DraftTree:
    """The training-free DDTree baseline: the `budget` most probable path prefixes when depth d's token is drawn
    independently from the drafter's marginal at d. logprobs / ids (P, K): per depth, sorted best first.

    Best-first over (depth, rank) under each node: a popped node pushes its next sibling and its first child; both
    score no better than it (sorted ranks, log-probs <= 0), so pops come in path-probability order. Ties: push order.
    """
    P, K = logprobs.shape
    lp, tok = logprobs.float().cpu().tolist(), ids.cpu().tolist()
    if any(row[i] < row[i + 1] for row in lp for i in range(K - 1)):
        raise ValueError("ddtree needs each depth's log-probs sorted best first")
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    scores: list[float] = []
    heap = [(-lp[0][0], 0, 1, 0, -1, 0.0)]  # (-score, counter, depth, rank, parent node, parent's score)
    counter = 1
    while heap and len(tokens) < budget:
        neg, _, d, r, parent, base = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(tok[d - 1][r])
        parents.append(parent)
        depths.append(d)
        scores.append(-neg)
        pushes = []
        if r + 1 < K:
            pushes.append((base + lp[d - 1][r + 1], d, r + 1, parent, base))
        if d < P:
            pushes.append((-neg + lp[d][0], d + 1, 0, node, -neg))
        for score, dd, rr, pp, bb in pushes:
            heapq.heappush(heap, (-score, counter, dd, rr, pp, bb))
            counter += 1
    return _tree(tokens, parents, depths, scores, ids.device)


Expand = Callable[[list[int], GrowingTree], tuple[torch.Tensor, torch.Tensor]]


def build_tree(expand: Expand, budget: int, max_depth: int, children: int = 8,
               width: int | None = None, root_children: int | None = None) -> tuple[DraftTree, list[int]]:
    """The modified DySpec builder: grow the tree by path log-prob, expanding `width` nodes per scoring call.

    expand(nodes, grown) -> (child_ids (w, c), child_logprobs (w, c)): `nodes` are indices into `grown` (the
    GrowingTree built so far; -1 = the root, the anchor), and row j holds node j's candidate children, best first,
    with their
    conditional log-probs log p(child | path). Each expanded node pushes its first `children` candidates (those with
    log-prob -inf are skipped) onto a frontier keyed by path log-prob; the root pushes `root_children` (default
    `children`: a wider root spends budget on depth-1 siblings, where a weak drafter's acceptance is decided, and
    expand must then return that many columns). The root is expanded alone; then each step
    pops the best w = width or ceil(budget / 16) entries (fewer when the frontier or the remaining budget is
    smaller), adds them as nodes in pop order, and expands those shallower than max_depth in one call, except
    after the pop that fills the budget. Returns the tree and the number of nodes of each expand call (the root's
    1 first). Ties on the frontier: push order.
    """
    w = width or math.ceil(budget / 16)
    grown = GrowingTree([], [], [], [])
    tokens, parents, depths, scores = grown.tokens, grown.parents, grown.depths, grown.scores
    calls: list[int] = []
    frontier: list[tuple[float, int, int, int, int]] = []  # (-score, counter, parent, depth, token)
    counter = 0
    pending = [-1] if max_depth > 0 else []  # nodes to expand next
    while len(tokens) < budget:
        if pending:
            child_ids, child_lp = expand(pending, grown)
            calls.append(len(pending))
            child_ids, child_lp = child_ids.tolist(), child_lp.float().tolist()
            for node, row_ids, row_lp in zip(pending, child_ids, child_lp):
                base, depth = (0.0, 0) if node < 0 else (scores[node], depths[node])
                n = (root_children or children) if node < 0 else children
                for tok, lp in zip(row_ids[:n], row_lp[:n]):
                    if lp != -math.inf:
                        heapq.heappush(frontier, (-(base + lp), counter, node, depth + 1, int(tok)))
                        counter += 1
        if not frontier:
            break
        pending = []
        for _ in range(min(w, len(frontier), budget - len(tokens))):
            neg, _, parent, depth, tok = heapq.heappop(frontier)
            if depth < max_depth:
                pending.append(len(tokens))
            tokens.append(tok)
            parents.append(parent)
            depths.append(depth)
            scores.append(-neg)
    return _tree(tokens, parents, depths, scores), calls


def walk(tree: DraftTree, truth: list[int]) -> list[int]:
    """The nodes of the longest path from the root whose tokens are `truth`'s first tokens (teacher-forced
    acceptance: what a greedy target that continues with `truth` would accept)."""
    children: dict[int, dict[int, int]] = {}
    for i, (tok, parent) in enumerate(zip(tree.tokens.tolist(), tree.parents.tolist())):
        children.setdefault(parent, {}).setdefault(tok, i)
    path, node = [], -1
    for tok in truth:
        node = children.get(node, {}).get(tok)
        if node is None:
            break
        path.append(node)
    return path


def ddtree_of_logits(logits: torch.Tensor, drafter, budget: int) -> DraftTree:
    """DDTree from the drafter's logits (B-1, V or Vd) at depths 1 .. B-1: per depth the top min(budget, V)
    log-softmax values (no depth can use more ranks than the budget)."""
    top = torch.log_softmax(logits.float(), -1).topk(min(budget, logits.shape[-1]), -1)
    return ddtree(top.values, drafter.to_target_ids(top.indices), budget)


def check_target(method, model) -> None:
    """Refuse a tree method at once on a target whose cache cannot be cut to a tree path (recurrent layers keep one
    state for the whole tree), before any decoding: never a silent wrong state."""
    if not isinstance(method, TreeMethod):
        return
    if target_cache.is_recurrent(model):
        raise ValueError(f"{method.name} verifies draft trees, which need a state per branch; the recurrent target "
                         f"{type(model).__name__} keeps one per sequence: use a chain method (chain, selector_greedy, ...)")
    if untreeable_layer_types(model):
        raise ValueError(f"{method.name} verifies draft trees under masks for full and sliding attention only; "
                         f"{type(model).__name__} has {', '.join(untreeable_layer_types(model))} layers: use a chain "
                         "method")


class TreeMethod(ChainMethod):
    """A method that proposes a draft tree of `budget` nodes per round from the drafter's block (greedy only):
    subclasses build it in `tree`. Its build time is reported as the selection time."""

    greedy_only = True  # the walk follows the target's argmax

    def __init__(self, drafter, budget: int):
        super().__init__(drafter)
        self.budget = budget

    def tree(self, hidden: torch.Tensor, verifier_hidden: torch.Tensor, anchor: int) -> DraftTree:
        """The tree of one block: hidden (B, H) the drafter's block states (anchor first), verifier_hidden (Ht,)
        the target's final hidden state of the row that chose the anchor."""
        raise NotImplementedError

    @torch.no_grad()
    def propose(self, state: RoundState, block_size: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> Proposal:
        device = self.drafter.norm.weight.device
        hidden = self.block_hidden(state, block_size)
        sync(device)
        t0 = time.perf_counter()
        tree = self.tree(hidden[0], state.verifier_hidden, state.anchor)
        sync(device)
        return Proposal(tree.tokens, select_s=time.perf_counter() - t0, tree=tree)


class DDTreeMethod(TreeMethod):
    """The training-free DDTree baseline from the drafter's marginals."""

    def __init__(self, drafter, budget: int):
        super().__init__(drafter, budget)
        self.name = f"ddtree_{budget}"

    def tree(self, hidden, verifier_hidden, anchor):
        return ddtree_of_logits(self.drafter.logits(hidden[1:]), self.drafter, self.budget)


@torch.no_grad()
def tree_offline_metrics(drafter, items: list[dict], block_size: int, methods: dict[str, TreeMethod],
                         progress=None, max_blocks: int | None = None) -> dict:
    """Teacher-forced acceptance of tree methods: at every anchor of `items` (with `final_hidden`; the first
    `max_blocks` anchors only, when given), the tree each method builds from the drafter's block, walked along the
    true tokens. Returns per method a_k (per depth), tau_offline (simulated from a_k, as for block methods) and
    nodes_per_block."""
    device = drafter.norm.weight.device
    accepted: dict[str, list[int]] = {m: [] for m in methods}
    nodes: dict[str, int] = {m: 0 for m in methods}
    valids = []
    for it in items:
        if max_blocks is not None and len(valids) >= max_blocks:
            break  # no drafter forward for items past the limit
        hidden, b, keep = drafter_blocks(drafter, [it], block_size)
        labels, valid = b["labels"][keep], b["label_valid"][keep]
        verifier, anchors = b["verifier_hidden"][keep].to(hidden.dtype), b["block_ids"][keep][:, 0]
        room = hidden.shape[0] if max_blocks is None else min(hidden.shape[0], max_blocks - len(valids))
        for n in range(room):
            valids.append(valid[n])
            truth = labels[n][valid[n].long().cumprod(0).bool()].tolist()
            for m, method in methods.items():
                tree = method.tree(hidden[n], verifier[n], int(anchors[n]))
                accepted[m].append(len(walk(tree, truth)))
                nodes[m] += len(tree)
        if progress is not None:
            progress.update()
    valid = torch.stack(valids)
    out = {}
    for m, acc in accepted.items():
        reached = torch.tensor(acc, device=device)
        correct = torch.arange(1, block_size, device=device)[None] <= reached[:, None]  # depth k accepted
        a, _ = conditional_acceptance(correct, valid)
        out[m] = {"a_k": a, "tau_offline": simulated_tau(a), "nodes_per_block": nodes[m] / max(1, len(acc))}
    return out

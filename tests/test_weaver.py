"""The Weaver adapter (models/weaver.py): it never touches the full vocabulary, its tree expansion agrees with its
teacher-forced path, it starts as the drafter's marginals, and trained on data where a token depends on the one
before it, its tree beats the marginal (DDTree) tree at the same budget."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from dflash_pipeline.eval.tree import build_tree, ddtree, walk
from dflash_pipeline.models.weaver import Weaver, WeaverRound, weaver_loss
from dflash_pipeline.eval.components import root_breadth

V, H, K, B = 997, 24, 16, 5  # a vocabulary size no other dimension shares


class Shapes(TorchFunctionMode):
    """Records the shape of every tensor any torch function returns."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def _round_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lm, embed = torch.randn(V, H, generator=g), nn.Embedding(V, H)
    pool_ids = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(B - 1)])
    return lm, embed, pool_ids, torch.randn(B - 1, K, generator=g), torch.randn(H, generator=g), \
        torch.randn(B - 1, H, generator=g)


def test_the_weaver_never_makes_a_full_vocabulary_tensor():
    lm, embed, pool_ids, pool_logits, verifier, drafter_hidden = _round_inputs()
    weaver = Weaver(H, rank=16, num_layers=2, num_heads=2, mlp_dim=32, top_k=K)
    nn.init.normal_(weaver.query.weight)
    with Shapes() as seen, torch.no_grad():
        rnd = WeaverRound(weaver, verifier, drafter_hidden, pool_ids, pool_logits, lm, embed, anchor=5)
        tree, _ = build_tree(lambda nodes, t: rnd.expand(nodes, *t.fields(nodes, 5), 4), 12, B - 1, 4, 3)
        path = torch.cat([torch.tensor([[5]]), pool_ids[None, :-1, 0]], 1)
        weaver.chain_log_probs(verifier[None], drafter_hidden[None], embed(path), pool_logits[None], lm[pool_ids][None])
    assert len(tree) == 12 and seen.shapes
    assert not [s for s in seen.shapes if V in s]


def test_tree_expansion_scores_a_path_as_teacher_forcing_does():
    """The log-probs a node gets from the batched, ancestor-masked expansion equal those of the causal
    teacher-forced forward along the same path (the training path)."""
    lm, embed, pool_ids, pool_logits, verifier, drafter_hidden = _round_inputs(1)
    weaver = Weaver(H, rank=16, num_layers=2, num_heads=2, mlp_dim=32, top_k=K)
    nn.init.normal_(weaver.query.weight, std=0.3)
    with torch.no_grad():
        rnd = WeaverRound(weaver, verifier, drafter_hidden, pool_ids, pool_logits, lm, embed, anchor=5)
        tree, _ = build_tree(lambda nodes, t: rnd.expand(nodes, *t.fields(nodes, 5), K), 20, B - 1, K, 2)
        deep = int(tree.depths.argmax())
        path = [deep]
        while int(tree.parents[path[0]]) != -1:
            path.insert(0, int(tree.parents[path[0]]))
        tokens = torch.tensor([[5] + [int(tree.tokens[i]) for i in path[:-1]]])  # the nodes that score the path
        forced = weaver.chain_log_probs(verifier[None], drafter_hidden[None], embed(tokens),
                                        pool_logits[None, :len(path)], lm[pool_ids[:len(path)]][None])[0]
    scores = [0.0] + [float(tree.scores[i]) for i in path]
    for depth, node in enumerate(path):  # the node's conditional log-prob = its score minus its parent's
        column = int((pool_ids[depth] == tree.tokens[node]).nonzero())
        assert float(forced[depth, column]) == pytest.approx(scores[depth + 1] - scores[depth], abs=1e-4)


def test_an_untrained_weaver_scores_as_the_drafter():
    lm, embed, pool_ids, pool_logits, verifier, drafter_hidden = _round_inputs(2)
    weaver = Weaver(H, rank=16, num_layers=1, num_heads=2, mlp_dim=32, top_k=K)
    path = torch.cat([torch.tensor([[5]]), pool_ids[None, :-1, 3]], 1)
    logp = weaver.chain_log_probs(verifier[None], drafter_hidden[None], embed(path), pool_logits[None],
                                  lm[pool_ids][None])
    assert torch.allclose(logp[0], torch.log_softmax(pool_logits, -1), atol=1e-6)


def test_pool_misses_are_not_trained_and_kl_needs_target_mass_on_the_pool():
    logp = torch.log_softmax(torch.randn(1, 2, 4), -1)
    pool = torch.tensor([[[1, 2, 3, 4], [5, 6, 7, 8]]])
    labels, valid = torch.tensor([[2, 9]]), torch.ones(1, 2, dtype=torch.bool)
    loss, stats = weaver_loss(logp, pool, labels, valid)
    assert int(stats["in_pool"]) == 1 and float(loss) == pytest.approx(-float(logp[0, 0, 1]))
    ids, lps = torch.tensor([[[2, 40], [41, 42]]]), torch.log(torch.tensor([[[0.6, 0.4], [0.5, 0.5]]]))
    mixed, stats = weaver_loss(logp, pool, labels, valid, ids, lps, kl_weight=1.0)
    kl = -float(logp[0, 0, 1])  # p is all on token 2 once restricted to the pool: KL = -log q(2)
    assert float(mixed) == pytest.approx(float(loss) + kl, rel=1e-5)  # position 2 has no target mass on its pool


def test_a_trained_weaver_tree_beats_the_marginal_tree_on_dependent_tokens():
    """Synthetic rounds: depth 1 is one of two tokens at random; each later token is a fixed function of the one
    before, so the marginals at depths 2 and 3 are 50/50 and only the path tells them apart. At 6 nodes DDTree (on the
    true marginals) holds every depth-2 pair, right and wrong, and accepts 2; a trained Weaver keeps both branches
    whole and accepts 3."""
    torch.manual_seed(0)
    depth1 = torch.tensor([10, 20])
    succ = {10: 11, 20: 21, 11: 12, 21: 22}
    pool_ids = torch.tensor([[10, 20, 30, 31], [11, 21, 32, 33], [12, 22, 34, 35], [13, 23, 36, 37]])
    pool_logits = torch.tensor([[2.0, 2.0, -2.0, -2.0]] * 4)
    lm, embed = torch.randn(V, H), nn.Embedding(V, H)
    embed.requires_grad_(False)
    verifier, drafter_hidden = torch.randn(H), torch.randn(B - 1, H)
    weaver = Weaver(H, rank=32, num_layers=1, num_heads=2, mlp_dim=64, top_k=4)
    opt = torch.optim.Adam(weaver.parameters(), lr=3e-2)
    for _ in range(60):
        first = depth1[torch.randint(0, 2, (16,))]
        second = torch.tensor([succ[int(t)] for t in first])
        third = torch.tensor([succ[int(t)] for t in second])
        labels = torch.stack([first, second, third, torch.full_like(first, 13)], 1)
        path = torch.cat([torch.full((16, 1), 5), labels[:, :-1]], 1)
        logp = weaver.chain_log_probs(verifier.expand(16, H), drafter_hidden.expand(16, -1, -1), embed(path),
                                      pool_logits.expand(16, -1, -1), lm[pool_ids].expand(16, -1, -1, -1))
        valid = torch.ones(16, 4, dtype=torch.bool)
        valid[:, 3] = False
        loss, _ = weaver_loss(logp, pool_ids.expand(16, -1, -1), labels, valid)
        opt.zero_grad()
        (loss / valid.sum()).backward()
        opt.step()
    weaver.eval()
    budget, depth = 6, 3
    with torch.no_grad():
        rnd = WeaverRound(weaver, verifier, drafter_hidden, pool_ids, pool_logits, lm, embed, anchor=5)
        grown, _ = build_tree(lambda nodes, t: rnd.expand(nodes, *t.fields(nodes, 5), 2), budget, depth, 2,
                              math.ceil(budget / 16))
    marginal = ddtree(torch.log_softmax(pool_logits[:depth], -1), pool_ids[:depth], budget)
    for first in (10, 20):
        truth = [first, succ[first], succ[succ[first]]]
        assert len(walk(grown, truth)) == 3
        assert len(walk(marginal, truth)) == 2


def test_the_root_widens_with_the_node_budget_unless_set():
    """The measured default (docs/results/trees.md): 8 depth-1 candidates at 16 nodes, 16 at 32, 32 at 64 and 128;
    never fewer than `children`; an explicit weaver.root_children wins."""
    assert [root_breadth(b, 8) for b in (16, 32, 64, 128, 512)] == [8, 16, 32, 32, 32]
    assert root_breadth(8, 8) == 8 and root_breadth(4, 4) == 4
    assert root_breadth(128, 8, root_children=12) == 12
    lm, embed, pool_ids, pool_logits, verifier, drafter_hidden = _round_inputs(2)
    weaver = Weaver(H, rank=16, num_layers=2, num_heads=2, mlp_dim=32, top_k=K)
    with torch.no_grad():
        for budget, want, depth1 in ((8, 4, 4), (16, 8, 8), (32, 16, 15)):  # children 4, pools of 16
            rnd = WeaverRound(weaver, verifier, drafter_hidden, pool_ids, pool_logits, lm, embed, anchor=5)
            root = root_breadth(budget, 4)
            tree, _ = build_tree(lambda nodes, t: rnd.expand(nodes, *t.fields(nodes, 5), max(4, root)), budget,
                                 B - 1, 4, 1, root)
            assert root == want and len(tree) == budget
            assert int((tree.parents == -1).sum()) == depth1  # a narrow root would stop at 4
            assert max(int((tree.parents == p).sum()) for p in range(len(tree))) <= 4

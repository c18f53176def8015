"""The DFlash2 pair selector (models/selector.py) on small random tensors: the checkpoint names, Viterbi against
brute force, the marginal drafter at zero transitions, sampling that matches the q it reports, the loss's skipping and
counts, and a synthetic fork where only a predecessor-aware selector can stay on one branch."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from dflash_pipeline.models.selector import (PairSelector, scorings_per_round, selector_loss, top_candidates)

V, H, R, K = 50, 12, 8, 4


def random_selector(seed: int = 0, scale: float = 1.0) -> PairSelector:
    """A selector whose transitions are large enough to change decisions (the default init has them all zero)."""
    torch.manual_seed(seed)
    sel = PairSelector(V, H, rank=R, top_k=K)
    with torch.no_grad():
        sel.successor_codebook.normal_(std=scale)
    return sel


def random_blocks(N: int, P: int, seed: int = 1):
    """cand_ids (N, P, K) distinct target ids per position, U (N, P, K) sorted best first, hidden (N, P, H),
    anchor (N,)."""
    g = torch.Generator().manual_seed(seed)
    cand = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(N * P)]).view(N, P, K)
    U = torch.randn(N, P, K, generator=g).sort(-1, descending=True).values
    hidden = torch.randn(N, P, H, generator=g)
    anchor = torch.randint(V, (N,), generator=g)
    return cand, U, hidden, anchor


def path_score(sel, cand, U, hidden, anchor, idx, normalize):
    """Score of one block's path idx (P,) of candidate indices, summed position by position."""
    prev, total = anchor.view(1), 0.0
    for t, i in enumerate(idx):
        with torch.no_grad():
            s = sel.scores(U[t], hidden[t], prev, cand[t])[0]  # (K,)
        total += float((s.log_softmax(-1) if normalize else s)[i])
        prev = cand[t, i].view(1)
    return total


def test_state_dict_names_and_shapes():
    sel = PairSelector(V, H, rank=R, top_k=K)
    assert {k: tuple(v.shape) for k, v in sel.state_dict().items()} == {
        "hidden_projection.weight": (R, H), "predecessor_codebook": (V, R), "successor_codebook": (V, R)}
    assert sel.config_dict() == {"selector_rank": R, "selector_top_k": K}


def test_transition_is_the_bilinear_term_for_every_pair():
    sel = random_selector()
    cand, U, hidden, anchor = random_blocks(3, 5)
    prev = torch.randint(V, (3, 5, K))
    got = sel.transition(hidden, prev, cand)  # (3, 5, K, K)
    proj = hidden @ sel.hidden_projection.weight.T
    want = torch.einsum("npar,npbr->npab", sel.predecessor_codebook[prev] * proj[:, :, None],
                        sel.successor_codebook[cand])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(sel.scores(U, hidden, prev, cand), U[:, :, None] + want)


@pytest.mark.parametrize("normalize", [True, False])
def test_viterbi_equals_brute_force(normalize):
    K3, P = 3, 4
    sel = random_selector(scale=2.0)
    cand, U, hidden, anchor = random_blocks(6, P)
    cand, U = cand[..., :K3], U[..., :K3]
    got = sel.viterbi(cand, U, hidden, anchor, normalize=normalize)
    differs_from_greedy = False
    for n in range(cand.shape[0]):
        best = max(itertools.product(range(K3), repeat=P),
                   key=lambda idx: path_score(sel, cand[n], U[n], hidden[n], anchor[n], idx, normalize))
        assert got[n].tolist() == [int(cand[n, t, i]) for t, i in enumerate(best)]
        differs_from_greedy |= got[n].tolist() != sel.greedy_walk(cand[n:n + 1], U[n:n + 1], hidden[n:n + 1],
                                                                  anchor[n:n + 1])[0].tolist()
    assert differs_from_greedy, "transitions too weak: the test would not tell Viterbi from the greedy walk"


def test_zero_transitions_decode_as_the_marginal_drafter():
    cand, U, hidden, anchor = random_blocks(8, 6)
    U = U[..., torch.randperm(K)]  # not sorted, so the argmax is not just column 0
    marginal = cand.gather(2, U.argmax(-1, keepdim=True))[..., 0]
    fresh = PairSelector(V, H, rank=R, top_k=K)  # the init: successor codebook at zero
    zero_projection = random_selector()
    with torch.no_grad():
        zero_projection.hidden_projection.weight.zero_()
    for sel in (fresh, zero_projection):
        assert torch.equal(sel.greedy_walk(cand, U, hidden, anchor), marginal)
        assert torch.equal(sel.viterbi(cand, U, hidden, anchor), marginal)
        assert torch.equal(sel.viterbi(cand, U, hidden, anchor, normalize=False), marginal)


def test_greedy_walk_picks_the_argmax_after_its_own_previous_pick():
    sel = random_selector(scale=2.0)
    cand, U, hidden, anchor = random_blocks(5, 6)
    ids = sel.greedy_walk(cand, U, hidden, anchor)
    prev = torch.cat([anchor[:, None], ids[:, :-1]], 1)
    s = sel.scores(U, hidden, prev[..., None], cand)[..., 0, :]
    assert torch.equal(ids, cand.gather(2, s.argmax(-1, keepdim=True))[..., 0])


def test_sample_walk_draws_from_the_q_it_returns():
    sel = random_selector(scale=1.0)
    cand, U, hidden, anchor = random_blocks(1, 2)
    N = 20000  # the same block N times: one fixed predecessor at position 1
    ids, q = sel.sample_walk(cand.expand(N, -1, -1), U.expand(N, -1, -1), hidden.expand(N, -1, -1),
                             anchor.expand(N), temperature=0.7, generator=torch.Generator().manual_seed(0))
    assert q.shape == (N, 2, V)
    torch.testing.assert_close(q.sum(-1), torch.ones(N, 2))
    outside = torch.ones(N, 2, V, dtype=torch.bool).scatter_(-1, cand.expand(N, -1, -1), False)
    assert (q[outside] == 0).all()
    assert (q.gather(-1, ids[..., None]) > 0).all()
    # position 1: every row shares the anchor; position 2: condition on the most frequent position-1 token
    first = ids[:, 0].mode().values
    for rows, t in ((torch.ones(N, dtype=torch.bool), 0), (ids[:, 0] == first, 1)):
        freq = torch.bincount(ids[rows, t], minlength=V).float() / rows.sum()
        expected = q[rows, t]
        assert torch.allclose(expected, expected[:1].expand_as(expected))  # one predecessor, one distribution
        assert (freq - expected[0]).abs().max() < 0.02, (freq[cand[0, t]], expected[0, cand[0, t]])
    with pytest.raises(ValueError, match="temperature"):
        sel.sample_walk(cand, U, hidden, anchor, temperature=0.0)


def test_sample_walk_at_low_temperature_is_the_greedy_walk():
    sel = random_selector(scale=2.0)
    cand, U, hidden, anchor = random_blocks(16, 5)
    ids, _ = sel.sample_walk(cand, U, hidden, anchor, temperature=1e-4)
    assert torch.equal(ids, sel.greedy_walk(cand, U, hidden, anchor))


def test_selector_loss_skips_and_counts():
    sel = random_selector()
    N, P = 6, 3
    cand, U, hidden, anchor = random_blocks(N, P)
    g = torch.Generator().manual_seed(2)
    pick = torch.randint(K, (N, P), generator=g)
    labels = cand.gather(2, pick[..., None])[..., 0]
    outside = torch.tensor([[0, 1, 0], [0, 0, 0], [1, 0, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0]], dtype=torch.bool)
    labels[outside] = -1  # surely not a candidate
    valid = torch.ones(N, P, dtype=torch.bool)
    valid[3, 2] = valid[4, 2] = False  # a padded position, and a padded one that is also outside the top-K
    prev = torch.cat([anchor[:, None], labels[:, :-1].clamp(min=0)], 1)
    prev[3, 2] = -100  # padding: never looked up
    weights = torch.tensor([1.0, 0.5, 0.25])
    loss, stats = selector_loss(sel, hidden, cand, U, prev, labels, valid, weights)
    scored = valid & ~outside
    s = sel.scores(U, hidden, prev.clamp(min=0)[..., None], cand)[..., 0, :]
    ce = F.cross_entropy(s[scored], pick[scored], reduction="none")
    torch.testing.assert_close(loss, (ce * weights.expand(N, P)[scored]).sum())
    assert int(stats["scored"]) == int(scored.sum()) == 14 and int(stats["skipped"]) == 2
    torch.testing.assert_close(stats["weight"], weights.expand(N, P)[scored].sum())
    assert int(stats["selector_correct"]) == int((s.argmax(-1) == pick)[scored].sum())
    assert int(stats["marginal_correct"]) == int((pick == 0)[scored].sum())  # U is sorted: the drafter picks 0
    loss.backward()
    assert sel.successor_codebook.grad.abs().sum() > 0


def fork_blocks(N: int, g: torch.Generator, pairs: torch.Tensor, follow: torch.Tensor, hidden_mean: torch.Tensor,
                anchor_id: int, K4: int = 4):
    """Blocks of P = 2 with a fork: position 1 is one of a pair (a, b), each with prob 1/2; position 2 is follow[it].

    The drafter's logits U are the marginals: both branches tie at each position (two distractors below them), and
    the candidates come in random order, so the marginal path takes the right position-2 branch half the time. The
    hidden states share a mean direction, as real post-norm states do; the pair term is multiplied by W h, so
    zero-mean noise alone would average it out."""
    pair = pairs[torch.randint(len(pairs), (N,), generator=g)]  # (N, 2)
    branch = torch.randint(2, (N,), generator=g)
    first = pair.gather(1, branch[:, None])[:, 0]
    labels = torch.stack([first, follow[first]], 1)  # (N, 2)
    distractors = torch.randint(40, V, (N, 2, 2), generator=g)
    cand = torch.cat([torch.stack([pair, follow[pair]], 1), distractors], -1)  # (N, 2, K)
    U = torch.tensor([0.0, 0.0, -2.0, -3.0]).expand(N, 2, K4)
    order = torch.rand(N, 2, K4, generator=g).argsort(-1)
    cand, U = cand.gather(2, order), U.gather(2, order)
    hidden = hidden_mean + 0.3 * torch.randn(N, 2, H, generator=g)
    anchor = torch.full((N,), anchor_id)
    return cand, U, hidden, anchor, labels


def test_selector_learns_a_fork_the_marginal_drafter_cannot():
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    pairs = torch.arange(12).view(6, 2)  # tokens 0..11 pair up; token x continues with 20 + x
    follow = torch.arange(V)
    follow[:12] += 20
    hidden_mean = torch.randn(2, H, generator=g)
    sel = PairSelector(V, H, rank=R, top_k=K)
    opt = torch.optim.Adam(sel.parameters(), lr=1e-2)
    weights = torch.ones(2)
    for _ in range(200):  # learnt by ~50 steps: the loss reaches its floor ln(2)/2 (position 1 is a coin flip)
        cand, U, hidden, anchor, labels = fork_blocks(64, g, pairs, follow, hidden_mean, anchor_id=49)
        prev = torch.cat([anchor[:, None], labels[:, :1]], 1)  # teacher forcing: the true predecessor
        loss, stats = selector_loss(sel, hidden, cand, U, prev, labels, torch.ones(64, 2, dtype=torch.bool), weights)
        opt.zero_grad()
        (loss / stats["weight"]).backward()
        opt.step()
    assert int(stats["skipped"]) == 0

    cand, U, hidden, anchor, labels = fork_blocks(4000, g, pairs, follow, hidden_mean, anchor_id=49)
    marginal = cand.gather(2, U.argmax(-1, keepdim=True))[..., 0]

    def second_right_given_first(ids):
        first = ids[:, 0] == labels[:, 0]
        assert first.sum() > 1000
        return float((ids[first, 1] == labels[first, 1]).float().mean())

    assert second_right_given_first(marginal) <= 0.6
    assert second_right_given_first(sel.greedy_walk(cand, U, hidden, anchor)) >= 0.9
    assert second_right_given_first(sel.viterbi(cand, U, hidden, anchor)) >= 0.9


def test_scorings_and_top_candidates():
    assert scorings_per_round("greedy", 15, 16) == scorings_per_round("sample", 15, 16) == 240
    assert scorings_per_round("viterbi", 15, 16) == 15 * 256
    with pytest.raises(ValueError, match="viterbi"):
        scorings_per_round("beam", 15, 16)
    logits = torch.tensor([[0.1, 3.0, -1.0, 2.0]])  # a draft vocabulary of 4 target ids
    draft_to_target = torch.tensor([7, 3, 40, 11])
    ids, U = top_candidates(logits, 2, lambda idx: draft_to_target[idx])
    assert ids.tolist() == [[3, 11]] and U.tolist() == [[3.0, 2.0]]

"""DFlash5 jump heads (models/jump.py) on synthetic tensors: the heads start as the plain drafter, the margin gate,
the gap fill against brute force (the transition into the right fixed token included), the head reads the hidden
state one position before its offset, the loss and its counts, a short training run that learns what the marginals
cannot, and the state_dict layout a checkpoint relies on."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from dflash_pipeline.models.jump import JumpHeads, choose_anchors, default_offsets, guided_path, jump_loss

V, H, r = 40, 12, 8


def random_block(N: int, B: int, K: int, seed: int = 0):
    """cand_ids (N, P, K) distinct target ids per position, U (N, P, K), hidden (N, B, H), anchor_ids (N,)."""
    g = torch.Generator().manual_seed(seed)
    P = B - 1
    cand_ids = torch.rand(N, P, V, generator=g).argsort(-1)[..., :K]
    U = torch.randn(N, P, K, generator=g)
    hidden = torch.randn(N, B, H, generator=g)
    anchor_ids = torch.randint(0, V, (N,), generator=g)
    return cand_ids, U, hidden, anchor_ids


def randomise(heads: JumpHeads, seed: int = 0) -> JumpHeads:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return heads


def table_transition(seed: int = 0):
    """A transition scorer of the selector's form: depends on predecessor, candidate and the hidden state."""
    g = torch.Generator().manual_seed(seed)
    pair, pair_h, w = torch.randn(V, V, generator=g), torch.randn(V, V, generator=g), torch.randn(H, generator=g)

    def transition(hidden, prev_ids, cand_ids):  # (M, H), (M, Kp), (M, Ks) -> (M, Kp, Ks)
        a, b = prev_ids[:, :, None], cand_ids[:, None, :]
        return pair[a, b] + (hidden @ w)[:, None, None] * pair_h[a, b]

    return transition


def test_default_offsets():
    assert default_offsets(16) == [4, 8, 12]
    assert default_offsets(8) == [4]
    assert default_offsets(8, every=3) == [3, 6]
    with pytest.raises(ValueError):
        default_offsets(4, every=4)  # no drafted position 4 in a block of 4
    with pytest.raises(ValueError):
        JumpHeads(V, H, 8, [0, 4])  # position 0 is the anchor
    with pytest.raises(ValueError):
        JumpHeads(V, H, 8, [4, 4])


def test_zero_codebook_margin_extremes_give_the_chain_path():
    """At init the residuals are zero: no offset fixed (margin=+inf) or every offset fixed at argmax U (margin=-inf)
    both give the per-position argmax of U."""
    B, K = 16, 5
    heads = JumpHeads(V, H, B, default_offsets(B), rank=r)
    cand_ids, U, hidden, anchor_ids = random_block(6, B, K)
    chain = cand_ids.gather(-1, U.argmax(-1, keepdim=True)).squeeze(-1)  # (N, P)
    at = torch.tensor(heads.offsets) - 1

    ids, work = guided_path(cand_ids, U, hidden, anchor_ids, heads, margin=math.inf)
    assert torch.equal(ids, chain)
    assert torch.equal(work, torch.full((6,), 3 * K + K * (B - 1)))

    choice, keep = choose_anchors(heads, hidden, cand_ids, U, margin=-math.inf)
    assert keep.all()
    assert torch.equal(choice, U[:, at].argmax(-1))
    ids, work = guided_path(cand_ids, U, hidden, anchor_ids, heads, margin=-math.inf)
    assert torch.equal(ids, chain)
    assert torch.equal(work, torch.full((6,), 3 * K + K * (B - 1 - 3)))
    # With a transition the fixed offsets are still the argmax of U.
    ids, _ = guided_path(cand_ids, U, hidden, anchor_ids, heads, margin=-math.inf, transition=table_transition())
    assert torch.equal(ids[:, at], chain[:, at])


def gated_heads(B: int, K: int):
    """Heads whose residual at the offset is 3.0 for candidate 1 and 0 elsewhere; U prefers candidate 0 by 1.0.
    Jump scores at the offset: candidate 1 -> 1.0, candidate 0 -> 2 - 3 = -1.0, others -3.0; margin 2.0."""
    heads = JumpHeads(V, H, B, [4], rank=r)
    cand_ids, U, hidden, anchor_ids = random_block(1, B, K, seed=3)
    U[:, 3] = torch.tensor([2.0, 1.0] + [0.0] * (K - 2))
    with torch.no_grad():
        heads.projection.weight.zero_()
        heads.offset_embedding.weight.fill_(1.0)
        q = math.tanh(1.0)
        heads.codebook[cand_ids[0, 3, 1]] = 3.0 * math.sqrt(r) / (r * q)
    return heads, cand_ids, U, hidden, anchor_ids


def test_margin_gate():
    B, K = 8, 4
    heads, cand_ids, U, hidden, anchor_ids = gated_heads(B, K)
    score = heads.scores(hidden, cand_ids[:, [3]], U[:, [3]])
    assert torch.allclose(score[0, 0], torch.tensor([-1.0, 1.0, -3.0, -3.0]), atol=1e-5)
    for margin, fixed in [(1.5, True), (2.0 - 1e-4, True), (2.0 + 1e-4, False), (2.5, False)]:
        _, keep = choose_anchors(heads, hidden, cand_ids, U, margin)
        assert keep.item() is fixed
        ids, _ = guided_path(cand_ids, U, hidden, anchor_ids, heads, margin)
        assert ids[0, 3] == cand_ids[0, 3, 1 if fixed else 0]  # the head's choice only when it passes the gate


def all_path_scores(paths, cand_ids, U, hidden, anchor, transition):
    """Objective of every path (Np, P) of candidate indices in one row: sum over positions of U plus the transition
    from the previous token (the anchor before position 1), each pair scored by the transition callable."""
    P, K = U.shape
    total = U[torch.arange(P), paths].sum(-1)  # (Np,)
    first = transition(hidden[1][None], anchor.view(1, 1), cand_ids[0][None])[0, 0]  # (K,)
    total += first[paths[:, 0]]
    for p in range(1, P):
        pair = transition(hidden[p + 1][None], cand_ids[p - 1][None], cand_ids[p][None])[0]  # (K, K)
        total += pair[paths[:, p - 1], paths[:, p]]
    return total


@pytest.mark.parametrize("margin", [math.inf, -math.inf, 0.5])
def test_gap_fill_equals_brute_force(margin):
    """The pinned Viterbi equals exhaustive search over every path that keeps the fixed offsets, the transition into
    each fixed token included; work counts the scored transitions."""
    B, K, N = 8, 3, 5
    heads = randomise(JumpHeads(V, H, B, default_offsets(B, every=3), rank=r), seed=1)  # offsets 3, 6
    cand_ids, U, hidden, anchor_ids = random_block(N, B, K, seed=2)
    transition = table_transition(seed=4)
    choice, keep = choose_anchors(heads, hidden, cand_ids, U, margin)
    ids, work = guided_path(cand_ids, U, hidden, anchor_ids, heads, margin, transition=transition)
    if margin == 0.5:
        assert keep.any() and not keep.all()  # a mix of fixed and free offsets
    for n in range(N):
        pinned = {o - 1: choice[n, j].item() for j, o in enumerate(heads.offsets) if keep[n, j]}
        paths = torch.tensor([path for path in itertools.product(range(K), repeat=B - 1)
                              if all(path[p] == c for p, c in pinned.items())])  # (Np, P)
        best = paths[all_path_scores(paths, cand_ids[n], U[n], hidden[n], anchor_ids[n], transition).argmax()]
        assert torch.equal(ids[n], cand_ids[n].gather(-1, best[:, None]).squeeze(-1))
        states = [1] + [1 if p in pinned else K for p in range(B - 1)]  # the anchor is one state
        expected = 2 * K + sum(a * b for a, b in zip(states, states[1:]) if not (a == 1 and b == 1))
        assert work[n].item() == expected


def test_gap_fill_reaches_the_right_fixed_token():
    """A one-position gap between the anchor and a fixed token: the candidate with the better U loses when its
    transition into the fixed token is bad (a left-to-right walk alone would keep it)."""
    B = 4
    heads = JumpHeads(V, H, B, [2], rank=r)
    cand_ids = torch.tensor([[[10, 11], [20, 21], [30, 31]]])
    U = torch.tensor([[[1.0, 0.5], [3.0, 0.0], [0.0, 0.0]]])  # offset 2 fixed at 20 (margin 3 >= 1)
    hidden, anchor_ids = torch.zeros(1, B, H), torch.tensor([5])

    def transition(hidden, prev_ids, cand_ids):
        bad = (prev_ids[:, :, None] == 10) & (cand_ids[:, None, :] == 20)
        return torch.where(bad, -5.0, 0.0)

    ids, _ = guided_path(cand_ids, U, hidden, anchor_ids, heads, margin=1.0, transition=transition)
    assert ids[0, :2].tolist() == [11, 20]
    ids, _ = guided_path(cand_ids, U, hidden, anchor_ids, heads, margin=1.0)
    assert ids[0, :2].tolist() == [10, 20]


def test_heads_read_the_hidden_state_before_the_offset():
    B, K = 8, 4
    heads = randomise(JumpHeads(V, H, B, [4], rank=r))
    cand_ids, U, hidden, _ = random_block(2, B, K)
    at = cand_ids[:, [3]]
    base = heads.residuals(heads.hidden_before(hidden), at)
    moved = hidden.clone()
    moved[:, 4] += 1.0  # block position 4 = the offset itself
    assert torch.equal(heads.residuals(heads.hidden_before(moved), at), base)
    moved[:, 3] += 1.0  # block position 3 = o - 1
    assert not torch.allclose(heads.residuals(heads.hidden_before(moved), at), base)


def test_jump_loss_counts_and_zero_codebook_is_ce_on_U():
    B, K, N = 16, 4, 3
    heads = JumpHeads(V, H, B, default_offsets(B), rank=r)
    cand_ids, U, hidden, _ = random_block(N, B, K)
    at = torch.tensor(heads.offsets) - 1
    cand, u = cand_ids[:, at], U[:, at]  # (N, J, K)
    labels = cand[..., 1].clone()
    labels[0, 0] = V + 1  # not among the candidates: skipped
    valid = torch.ones(N, 3, dtype=torch.bool)
    valid[2, 2] = False
    loss, stats = jump_loss(heads, hidden, cand, u, labels, valid)
    scored = valid.clone()
    scored[0, 0] = False
    expected = F.cross_entropy(u[scored], torch.ones(int(scored.sum()), dtype=torch.long), reduction="sum")
    assert torch.allclose(loss, expected)
    assert stats["scored"] == 7 and stats["skipped"] == 1
    assert stats["correct"] == stats["correct_marginal"] == (u[scored].argmax(-1) == 1).sum()


def test_jump_loss_kl_mix():
    """KL to the teacher restricted to the candidates: zero when the heads' distribution is that restriction;
    with kl_weight 0.5 the per-offset loss is the CE/KL average."""
    B, K, N = 8, 3, 2
    heads = randomise(JumpHeads(V, H, B, [4], rank=r))
    cand_ids, U, hidden, _ = random_block(N, B, K)
    cand, u = cand_ids[:, [3]], U[:, [3]]
    labels, valid = cand[..., 0], torch.ones(N, 1, dtype=torch.bool)
    score = heads.scores(hidden, cand, u).detach()
    # Teacher top-4: the three candidates with the heads' own log-probs (shifted), plus one token outside them.
    outside = torch.full((N, 1, 1), V - 1)
    outside[cand.eq(V - 1).any(-1, keepdim=True)] = V - 2
    teacher_ids = torch.cat([cand, outside], -1)
    teacher_logprobs = torch.cat([score.log_softmax(-1) - 1.0, torch.full((N, 1, 1), -0.7)], -1)
    loss, _ = jump_loss(heads, hidden, cand, u, labels, valid, teacher_logprobs, teacher_ids, kl_weight=1.0)
    assert abs(loss.item()) < 1e-5
    other = torch.cat([torch.zeros(N, 1, K), torch.full((N, 1, 1), -0.7)], -1)  # uniform over the candidates
    ce, _ = jump_loss(heads, hidden, cand, u, labels, valid)
    mixed, _ = jump_loss(heads, hidden, cand, u, labels, valid, other, teacher_ids, kl_weight=0.5)
    kl = (-math.log(K) - score.log_softmax(-1)).mean(-1).sum()
    assert torch.allclose(mixed, 0.5 * ce + 0.5 * kl, atol=1e-5)
    with pytest.raises(ValueError):
        jump_loss(heads, hidden, cand, u, labels, valid, kl_weight=0.5)


def test_training_learns_what_the_marginals_miss():
    """The true token at each offset is written into the drafter state at o - 1; U is flat over the K candidates.
    A few hundred Adam steps on jump_loss make the heads' anchor choice right >= 90% of the time (U alone: 1/K)."""
    torch.manual_seed(0)
    B, K, N = 16, 8, 128
    offsets = default_offsets(B)
    J, at = len(offsets), torch.tensor(offsets) - 1
    token_state = torch.randn(V, H, generator=torch.Generator().manual_seed(5))

    def batch(n, g):
        hidden = torch.randn(n, B, H, generator=g)
        cand = torch.rand(n, J, V, generator=g).argsort(-1)[..., :K]
        labels = cand.gather(-1, torch.randint(0, K, (n, J, 1), generator=g)).squeeze(-1)
        hidden[:, at] = token_state[labels] + 0.3 * torch.randn(n, J, H, generator=g)
        return hidden, cand, torch.zeros(n, J, K), labels

    heads = JumpHeads(V, H, B, offsets, rank=16)
    opt = torch.optim.Adam(heads.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(6)
    valid = torch.ones(N, J, dtype=torch.bool)
    for _ in range(300):
        hidden, cand, U, labels = batch(N, g)
        loss, stats = jump_loss(heads, hidden, cand, U, labels, valid)
        opt.zero_grad()
        (loss / stats["scored"]).backward()
        opt.step()

    hidden, cand, U, labels = batch(1000, torch.Generator().manual_seed(7))
    cand_ids = torch.zeros(1000, B - 1, K, dtype=torch.long)
    cand_ids[:, at] = cand
    U_all = torch.zeros(1000, B - 1, K)
    choice, _ = choose_anchors(heads, hidden, cand_ids, U_all, margin=-math.inf)
    accuracy = (cand.gather(-1, choice[..., None]).squeeze(-1) == labels).float().mean().item()
    _, stats = jump_loss(heads, hidden, cand, U, labels, torch.ones(1000, J, dtype=torch.bool))
    assert accuracy >= 0.9
    assert stats["correct_marginal"].item() / stats["scored"].item() < 0.2  # U alone: about 1/K


def test_state_dict_layout():
    heads = JumpHeads(V, H, 16, default_offsets(16), rank=r)
    shapes = {k: tuple(v.shape) for k, v in heads.state_dict().items()}
    assert shapes == {"projection.weight": (r, H), "offset_embedding.weight": (3, r), "codebook": (V, r)}
    assert not heads.codebook.any()  # residuals start at zero
    other = randomise(JumpHeads(V, H, 16, default_offsets(16), rank=r))
    heads.load_state_dict(other.state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(heads.state_dict().values(), other.state_dict().values()))

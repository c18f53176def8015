"""DFlash4 separate jump head (models/jump_head.py, train/jump_head.py): a fresh head decodes as the drafter, the
margin gate, fixed tokens (also outside the top-K) kept and the gaps filled as the fused heads fill them, a short
training run that learns what the marginals cannot, the greedy/block-size check, and the export round trip."""
from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from torch import nn

from dflash_pipeline.eval.protocol import candidates
from dflash_pipeline.models.drafter import DFlashDrafter, DFlashDrafterConfig
from dflash_pipeline.models.jump import JumpHeads, default_offsets, fill_gaps, guided_path
from dflash_pipeline.models.jump_head import SeparateJumpHead, choose_head_anchors, head_logits, head_path, \
    jump_head_loss
from dflash_pipeline.models.selector import PairSelector
from dflash_pipeline.eval.components import jump_head_method, load_jump_head

from test_jump import randomise, table_transition

V, H = 40, 12  # as tests/test_jump.py, so its transition helper applies


def small_drafter(B: int, draft_vocab: bool = False, hidden: int = H, vocab: int = V,
                  lm_weight: torch.Tensor | None = None) -> DFlashDrafter:
    """A 1-layer drafter with a random frozen LM head (only logits / vocabulary mapping are used here)."""
    torch.manual_seed(0)
    conf = DFlashDrafterConfig(
        hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=hidden // 2, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64,
        vocab_size=vocab, block_size=B, target_hidden_size=hidden, target_layer_ids=[0], num_target_layers=2,
        mask_token_id=vocab - 1)
    lm_head = nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        lm_head.weight.copy_(torch.randn(vocab, hidden) if lm_weight is None else lm_weight)
    drafter = DFlashDrafter(conf, nn.Embedding(vocab, hidden), lm_head).eval()
    if draft_vocab:
        drafter.set_draft_vocab(torch.randperm(vocab, generator=torch.Generator().manual_seed(1))[: vocab // 2])
    return drafter


def drafter_block(drafter: DFlashDrafter, N: int, K: int, seed: int = 0):
    """hidden (N, B, H), the drafter's top-K (cand_ids target ids, U) at positions 1..P, anchor ids (N,)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, drafter.config.block_size, drafter.config.hidden_size, generator=g)
    cand_ids, U = candidates(drafter, hidden[:, 1:], K)
    return cand_ids, U, hidden, torch.randint(0, drafter.config.vocab_size, (N,), generator=g)


def chain_path(cand_ids, U):
    return cand_ids.gather(-1, U.argmax(-1, keepdim=True)).squeeze(-1)


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_fresh_head_is_the_drafter(draft_vocab):
    """Zero-initialised residual branches: the head's logits are the drafter's at the offsets times a positive
    factor per row (the final RMSNorm), so fixing every offset gives the chain path, and with a transition the same
    path as the fused heads that fix the same tokens (fresh fused heads fix the argmax of U)."""
    B, K, N = 9, 4, 6
    drafter = small_drafter(B, draft_vocab)
    offsets = default_offsets(B, every=3)  # 3, 6
    head = SeparateJumpHead(H, B, offsets, num_heads=2)
    cand_ids, U, hidden, anchor_ids = drafter_block(drafter, N, K)
    h = hidden[:, offsets]
    scale = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert torch.allclose(head_logits(head, drafter, hidden), drafter.logits(h * scale), atol=1e-5)

    anchors, keep = choose_head_anchors(head, drafter, hidden, margin=-math.inf)
    assert keep.all() and torch.equal(anchors, cand_ids[:, [o - 1 for o in offsets], 0])
    ids, work = head_path(cand_ids, U, hidden, anchor_ids, head, drafter, margin=-math.inf)
    assert torch.equal(ids, chain_path(cand_ids, U))
    assert torch.equal(work, torch.full((N,), K * (B - 1 - len(offsets))))  # the head's forward is not a scoring
    fused = JumpHeads(V, H, B, offsets, rank=4)
    transition = table_transition(seed=2)
    ids, work = head_path(cand_ids, U, hidden, anchor_ids, head, drafter, -math.inf, transition)
    fused_ids, fused_work = guided_path(cand_ids, U, hidden, anchor_ids, fused, -math.inf, transition=transition)
    assert torch.equal(ids, fused_ids)
    assert torch.equal(work + len(offsets) * K, fused_work)


def test_margin_gate_fixing_nothing_gives_the_chain_path():
    B, K, N = 9, 4, 6
    drafter = small_drafter(B)
    head = randomise(SeparateJumpHead(H, B, default_offsets(B, every=3), num_heads=2))
    cand_ids, U, hidden, anchor_ids = drafter_block(drafter, N, K)
    _, keep = choose_head_anchors(head, drafter, hidden, margin=math.inf)
    assert not keep.any()
    ids, work = head_path(cand_ids, U, hidden, anchor_ids, head, drafter, margin=math.inf)
    assert torch.equal(ids, chain_path(cand_ids, U))
    assert torch.equal(work, torch.full((N,), K * (B - 1)))
    # With a transition and nothing fixed: the plain pinned Viterbi, as the fused heads' fill with nothing fixed.
    transition = table_transition(seed=2)
    ids, _ = head_path(cand_ids, U, hidden, anchor_ids, head, drafter, math.inf, transition)
    fused_ids, _ = guided_path(cand_ids, U, hidden, anchor_ids, JumpHeads(V, H, B, [3, 6], rank=4), math.inf,
                               transition=transition)
    assert torch.equal(ids, fused_ids)


def brute_force(cand_ids, U, hidden, anchor, fixed, fixed_ids, transition):
    """Best token path of one row by enumeration: fixed positions hold their token (any id), the others one of their
    candidates; objective = U of the free positions + the transition into every position (the anchor before the
    first), each pair scored alone."""
    P, K = U.shape
    choices = [[(int(fixed_ids[p]), 0.0)] if fixed[p] else [(int(cand_ids[p, k]), float(U[p, k])) for k in range(K)]
               for p in range(P)]
    best, best_score = None, -math.inf
    for path in itertools.product(*choices):
        score, prev = 0.0, int(anchor)
        for p, (tok, u) in enumerate(path):
            score += u + float(transition(hidden[p + 1][None], torch.tensor([[prev]]), torch.tensor([[tok]]))[0, 0, 0])
            prev = tok
        if score > best_score:
            best, best_score = [tok for tok, _ in path], score
    return torch.tensor(best)


def test_fixed_tokens_are_kept_and_the_gaps_are_fill_gaps():
    """A random head with a margin that fixes some offsets and not others: the fixed offsets hold the head's
    tokens (some outside the top-K), every other position is what `fill_gaps` makes of the same fixed tokens, which
    equals enumeration with the transition into each fixed token scored."""
    B, K, N = 7, 2, 24
    drafter = small_drafter(B)
    offsets = default_offsets(B, every=2)  # 2, 4, 6
    head = randomise(SeparateJumpHead(H, B, offsets, num_heads=2), seed=3)
    cand_ids, U, hidden, anchor_ids = drafter_block(drafter, N, K, seed=4)
    anchors, _ = choose_head_anchors(head, drafter, hidden, margin=-math.inf)
    with torch.no_grad():
        logits = head_logits(head, drafter, hidden).topk(2, -1).values
    margin = float((logits[..., 0] - logits[..., 1]).median())
    anchors, keep = choose_head_anchors(head, drafter, hidden, margin)
    assert keep.any() and not keep.all()
    at = [o - 1 for o in offsets]
    outside = keep & ~(cand_ids[:, at] == anchors[..., None]).any(-1)
    assert outside.any()  # fixed tokens the drafter's top-K does not hold
    fixed = torch.zeros(N, B - 1, dtype=torch.bool)
    fixed[:, at] = keep
    fixed_ids = torch.zeros(N, B - 1, dtype=torch.long)
    fixed_ids[:, at] = anchors
    for transition in (None, table_transition(seed=5)):
        ids, work = head_path(cand_ids, U, hidden, anchor_ids, head, drafter, margin, transition)
        assert torch.equal(ids[fixed], fixed_ids[fixed])
        expected = fill_gaps(cand_ids, U, hidden, anchor_ids, fixed, fixed_ids, transition)
        assert torch.equal(ids, expected[0]) and torch.equal(work, expected[1])
    # the last path is the pinned Viterbi's
    for n in range(N):
        best = brute_force(cand_ids[n], U[n], hidden[n], anchor_ids[n], fixed[n], fixed_ids[n], transition)
        assert torch.equal(ids[n], best)


def test_fill_gaps_without_a_transition_takes_the_argmax_around_fixed_tokens():
    cand_ids = torch.tensor([[[10, 11], [20, 21], [30, 31]]])
    U = torch.tensor([[[1.0, 2.0], [3.0, 0.0], [0.0, 1.0]]])
    fixed = torch.tensor([[False, True, False]])
    ids, work = fill_gaps(cand_ids, U, torch.zeros(1, 4, H), torch.tensor([5]), fixed, torch.tensor([[0, 7, 0]]))
    assert ids.tolist() == [[11, 7, 31]] and work.tolist() == [4]


def test_loss_counts_and_a_label_outside_the_draft_vocabulary_is_skipped():
    B, N = 9, 4
    drafter = small_drafter(B, draft_vocab=True)
    head = randomise(SeparateJumpHead(H, B, [3, 6], num_heads=2))
    hidden = torch.randn(N, B, H)
    inside = drafter.draft_to_target
    labels = inside[torch.arange(2 * N).view(N, 2) % len(inside)].clone()
    outside = next(t for t in range(V) if t not in set(inside.tolist()))
    labels[0, 1] = outside
    valid = torch.ones(N, 2, dtype=torch.bool)
    valid[3, 0] = False
    weights = torch.rand(N, 2)
    loss, stats = jump_head_loss(head, drafter, hidden, labels, valid, weights, marginal_ids=labels)
    logits = head_logits(head, drafter, hidden)
    ce = logits.logsumexp(-1) - logits.gather(-1, drafter.target_to_column()[labels].clamp(min=0)[..., None])[..., 0]
    scored = valid.clone()
    scored[0, 1] = False
    assert torch.allclose(loss, (ce * weights)[scored].sum())
    assert stats["scored"] == 6 and stats["skipped"] == 1 and stats["correct_marginal"] == 6
    loss.backward()
    assert head.self_attn.q_proj.weight.grad is not None


@pytest.fixture
def one_thread():
    """Tiny matmuls: on a shared CPU extra intra-op threads mostly wait on each other (about 1 s vs a minute)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_training_learns_what_the_marginals_miss(one_thread):
    """The drafter predicted each offset's token one position too early: its state at o - 1 holds the token's LM-head
    row (orthonormal rows), its state at o is noise (marginal accuracy about 1/V). A few hundred Adam steps teach
    the head to read the token from o - 1 (>= 90% right)."""
    torch.manual_seed(0)
    B, Hs, Vs, N = 8, 32, 24, 64
    lm = torch.linalg.qr(torch.randn(Hs, Hs))[0][:Vs]  # orthonormal rows
    drafter = small_drafter(B, hidden=Hs, vocab=Vs, lm_weight=lm)
    offsets = default_offsets(B, every=2)
    at = torch.tensor(offsets) - 1

    def batch(n, g):
        hidden = torch.randn(n, B, Hs, generator=g)
        labels = torch.randint(0, Vs, (n, len(offsets)), generator=g)
        hidden[:, at] = lm[labels] + 0.1 * torch.randn(n, len(offsets), Hs, generator=g)
        marginal = drafter.logits(hidden[:, offsets]).argmax(-1)
        return hidden, labels, marginal

    head = SeparateJumpHead(Hs, B, offsets, num_heads=4)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(6)
    valid = torch.ones(N, len(offsets), dtype=torch.bool)
    for _ in range(200):
        hidden, labels, marginal = batch(N, g)
        loss, stats = jump_head_loss(head, drafter, hidden, labels, valid, marginal_ids=marginal)
        opt.zero_grad()
        (loss / stats["scored"]).backward()
        opt.step()

    hidden, labels, marginal = batch(1000, torch.Generator().manual_seed(7))
    anchors, _ = choose_head_anchors(head, drafter, hidden, margin=-math.inf)
    assert (anchors == labels).float().mean().item() >= 0.9
    assert (marginal == labels).float().mean().item() < 0.2


def test_check_refuses_sampling_and_another_block_size():
    B, K = 9, 4
    drafter = small_drafter(B)
    method = jump_head_method(drafter, SeparateJumpHead(H, B, [3, 6], num_heads=2), 0.0, K)
    assert method.name == "jump_head"
    method.check(B, 0.0)
    with pytest.raises(ValueError, match="greedily only"):
        method.check(B, 0.7)
    with pytest.raises(ValueError, match="trained for block 9"):
        method.check(B - 1, 0.0)
    cand_ids, U, hidden, anchor_ids = drafter_block(small_drafter(B - 1), 2, K)
    with pytest.raises(ValueError, match="trained for block 9"):
        method.path(cand_ids, U, hidden, anchor_ids)
    with pytest.raises(ValueError, match="greedily only"):
        method.sample_path(U[0], torch.randn(1, B, H), 1, 0.7, None)
    with pytest.raises(ValueError, match="same candidates"):
        jump_head_method(drafter, method.module, 0.0, K, PairSelector(V, H, rank=4, top_k=K + 1))
    assert jump_head_method(drafter, method.module, 0.0, K, PairSelector(V, H, rank=4, top_k=K)).name == \
        "jump_head_selector"


def test_state_dict_layout():
    head = SeparateJumpHead(H, 9, [3, 6], num_heads=2, intermediate_size=20)
    shapes = {k: tuple(v.shape) for k, v in head.state_dict().items()}
    assert shapes == {
        "position_embedding.weight": (9, H), "input_layernorm.weight": (H,),
        **{f"self_attn.{p}_proj.weight": (H, H) for p in "qkvo"}, "post_attention_layernorm.weight": (H,),
        "mlp.gate_proj.weight": (20, H), "mlp.up_proj.weight": (20, H), "mlp.down_proj.weight": (H, 20),
        "norm.weight": (H,)}
    assert not head.self_attn.o_proj.weight.any() and not head.mlp.down_proj.weight.any()
    assert SeparateJumpHead(H, 9, [3], num_heads=3).intermediate_size == 2 * H
    with pytest.raises(ValueError):
        SeparateJumpHead(H, 9, [3], num_heads=5)  # 5 does not divide 12
    with pytest.raises(ValueError):
        SeparateJumpHead(H, 9, [0, 3])  # position 0 is the anchor


# -- the component on tiny: export -> load_jump_head ------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_component(tiny_teacher, tmp_path_factory):
    """A JumpHeadComponent on a 1-step tiny drafter, its head randomised (a fresh head decodes as the chain)."""
    from dflash_pipeline.train.component import StageInputs
    from dflash_pipeline.train.jump_head import JumpHeadComponent
    from dflash_pipeline.train.loop import run_train

    from conftest import make_config

    drafter_run = run_train(make_config("trainer.steps=1"), tmp_path_factory.mktemp("drafter") / "train",
                            data_dir=tiny_teacher)
    cfg = make_config("jump_head.top_k=4", "jump_head.every=2", "jump_head.margin=-1.0")
    comp = JumpHeadComponent(cfg, StageInputs(tiny_teacher, drafter_run / "export"), torch.device("cpu"))
    with torch.no_grad():
        for p in comp.model.parameters():
            p.normal_(0, 0.3)
    return comp


def test_component_export_round_trip_gives_identical_drafts(tiny_component, tmp_path):
    from dflash_pipeline.eval.methods import make_method

    comp = tiny_component
    batch = comp.batch(comp.step_items(0), 0)
    loss, stats = comp.loss(comp.model, batch)
    assert torch.isfinite(loss) and stats["scored"] > 0
    assert comp.normaliser(batch) > 0
    assert set(comp.evaluate(comp.model)) == {"a_k", "tau_offline", "chain_tau_offline", "oracle_tau"}

    folder = comp.export(comp.model, tmp_path / "export")
    dc = json.loads((folder / "config.json").read_text())["dflash_config"]
    hidden_size = comp.drafter.config.hidden_size
    assert {k: v for k, v in dc.items() if k.startswith("jump_head_")} == {
        "jump_head_offsets": [2], "jump_head_margin": -1.0, "jump_head_num_heads": 4,
        "jump_head_intermediate_size": 2 * hidden_size, "jump_head_top_k": 4}
    loaded = load_jump_head(folder, comp.drafter)
    assert loaded.settings == {"margin": -1.0} and loaded.top_k == 4 and loaded.module.offsets == comp.offsets == [2]
    made = make_method("jump_head", comp.drafter, {"jump_head": folder})
    selector = PairSelector(comp.drafter.config.vocab_size, comp.drafter.config.hidden_size, rank=8, top_k=4)
    with torch.no_grad():
        selector.successor_codebook.normal_()
    cand, U, hidden, anchors = batch["cand_ids"], batch["U"], batch["hidden"], batch["anchors"]
    for mine, theirs in [(jump_head_method(comp.drafter, comp.model.eval(), -1.0, 4), loaded),
                         (jump_head_method(comp.drafter, comp.model, -1.0, 4), made),
                         (jump_head_method(comp.drafter, comp.model, -1.0, 4, selector),
                          load_jump_head(folder, comp.drafter, selector))]:
        assert mine.name == theirs.name
        drafts = mine.path(cand, U, hidden, anchors)[0]
        assert torch.equal(drafts, theirs.path(cand, U, hidden, anchors)[0])
        assert not torch.equal(drafts, cand[..., 0])  # the randomised head fixes tokens of its own

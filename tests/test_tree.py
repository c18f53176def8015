"""Draft trees: the ancestor mask, one-forward tree verification (equal to chain verification and to autoregressive
decoding, with a compacted KV cache equal to a fresh forward), DDTree against brute force, and the DySpec builder's
budget and per-call width."""
from __future__ import annotations

import copy
import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from dflash_pipeline.eval.decode import _accept_greedy, autoregressive
from dflash_pipeline.eval.protocol import target_forward
from dflash_pipeline.models.cache import crop as crop_cache
from dflash_pipeline.eval.tree import DDTreeMethod, DraftTree, TreeMethod, ancestor_mask, build_tree, ddtree, \
    verify_tree
from tests.conftest import chat_prompt_ids

TEXT = "Write a haiku about the sea."


@pytest.fixture(scope="module")
def random_target():
    """A small random Llama whose greedy continuations vary (the tiny target's greedy output repeats one token)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()
    prompt = torch.randint(0, 64, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    return SimpleNamespace(model=model, eos_ids=set()), prompt


@pytest.fixture(scope="module", params=["tiny", "random"])
def case(request):
    """(target, prompt ids, tapped layers): the real tiny target on a chat prompt, or the random one."""
    if request.param == "tiny":
        target = request.getfixturevalue("target")
        prompt = chat_prompt_ids(target.tokenizer, [TEXT])[0]
    else:
        target, prompt = request.getfixturevalue("random_target")
    return target, prompt, [0, target.model.config.num_hidden_layers - 2]


def prefill(model, prompt: list[int], layer_ids: list[int]) -> tuple[DynamicCache, int, int]:
    """The cache over the prompt, L and the first anchor (the target's greedy token)."""
    cache = DynamicCache()
    L = len(prompt)
    step = target_forward(model, torch.tensor([prompt]), torch.arange(L)[None], cache, layer_ids, last_only=True)
    return cache, L, int(step[0][-1].argmax())


def tree_of(edges: list[tuple[int, int]]) -> DraftTree:
    """A DraftTree from (parent, token) pairs in topological order."""
    parents = [p for p, _ in edges]
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return DraftTree(torch.tensor([t for _, t in edges]), torch.tensor(parents), torch.tensor(depths))


def decoy_tree(true: list[int], k: int, vocab: int) -> tuple[DraftTree, list[int]]:
    """The first k true tokens as one branch; at every depth a wrong sibling comes first and carries the next true
    token as a decoy child; depth k+1 holds only a wrong token. Returns the tree and the true branch's nodes."""
    edges: list[tuple[int, int]] = []
    parent, branch = -1, []
    for d in range(k + 1):
        edges.append((parent, (true[d] + 1) % vocab))
        if d + 1 < len(true):
            edges.append((len(edges) - 1, true[d + 1]))
        if d < k:
            edges.append((parent, true[d]))
            parent = len(edges) - 1
            branch.append(parent)
    return tree_of(edges), branch


def chain_reference(model, cache: DynamicCache, L: int, ids: list[int], layer_ids: list[int]):
    """logits, features and final hidden states of a causal forward over ids at L .. on a copy of the cache."""
    out = model(input_ids=torch.tensor([ids]), position_ids=torch.arange(L, L + len(ids))[None],
                cache=copy.deepcopy(cache), use_cache=True, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)[0]
    return out.logits[0], feats, out.hidden_states[-1][0]


def assert_same_cache(cache: DynamicCache, ref: DynamicCache) -> None:
    assert len(cache.layers) == len(ref.layers)
    for got, want in zip(cache.layers, ref.layers):
        assert got.keys.shape == want.keys.shape and got.values.shape == want.values.shape
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-4)


# -- the mask --------------------------------------------------------------------------------------------------------
def test_ancestor_mask_of_a_hand_drawn_tree():
    # root -> a, b; a -> c, d; c -> e  (nodes a=0, b=1, c=2, d=3, e=4)
    expected = torch.tensor([
        # root a  b  c  d  e
        [1, 0, 0, 0, 0, 0],  # root
        [1, 1, 0, 0, 0, 0],  # a
        [1, 0, 1, 0, 0, 0],  # b
        [1, 1, 0, 1, 0, 0],  # c
        [1, 1, 0, 0, 1, 0],  # d
        [1, 1, 0, 1, 0, 1],  # e
    ], dtype=torch.bool)
    assert torch.equal(ancestor_mask(torch.tensor([-1, -1, 0, 0, 2])), expected)
    with pytest.raises(ValueError, match="topological"):
        ancestor_mask(torch.tensor([-1, 2, -1]))


# -- verification ----------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_tree_accepts_the_targets_greedy_branch_among_wrong_siblings(case):
    target, prompt, layers = case
    model = target.model
    greedy, _ = autoregressive(target, prompt, 8)
    cache, L, anchor = prefill(model, prompt, layers)
    assert anchor == greedy[0]
    tree, branch = decoy_tree(greedy[1:7], 4, model.config.vocab_size)
    logits, feats, final = chain_reference(model, cache, L, greedy[:5], layers)
    v = verify_tree(model, cache, L, anchor, tree, layers)
    assert v.path == branch and v.tokens == greedy[1:5] and v.next_anchor == greedy[5]
    rows = [0] + [i + 1 for i in branch]  # siblings and decoys must not leak into the branch's rows
    torch.testing.assert_close(v.logits[rows], logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v.features, feats, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(v.final, final, atol=1e-5, rtol=1e-4)
    assert v.logits.shape == (len(tree) + 1, model.config.vocab_size)
    assert cache.get_seq_length() == L + 5


@torch.no_grad()
def test_rounds_of_tree_verification_reproduce_autoregressive_decoding(case):
    target, prompt, layers = case
    model = target.model
    greedy, _ = autoregressive(target, prompt, 24)
    assert len(greedy) == 24
    cache, L, anchor = prefill(model, prompt, layers)
    output = [anchor]
    for k in itertools.cycle([3, 0, 2, 4, 1]):
        if len(output) >= 16:
            break
        n = len(output)
        tree, branch = decoy_tree(greedy[n: n + k + 2], k, model.config.vocab_size)
        v = verify_tree(model, cache, L, anchor, tree, layers)
        assert v.path == branch
        output += v.tokens + [v.next_anchor]
        L, anchor = L + 1 + len(v.path), v.next_anchor
        assert cache.get_seq_length() == L
    assert output[:16] == greedy[:16]


@torch.no_grad()
@pytest.mark.parametrize("wrong_at", [0, 2, None])
def test_single_path_tree_accepts_what_chain_verification_accepts(case, wrong_at):
    target, prompt, layers = case
    model = target.model
    greedy, _ = autoregressive(target, prompt, 8)
    cache, L, anchor = prefill(model, prompt, layers)
    drafts = torch.tensor(greedy[1:6])
    if wrong_at is not None:
        drafts[wrong_at] = (drafts[wrong_at] + 1) % model.config.vocab_size
    chain_cache = copy.deepcopy(cache)
    step = target_forward(model, torch.tensor([[anchor, *drafts.tolist()]]), torch.arange(L, L + 6)[None],
                          chain_cache, layers)
    n, next_anchor = _accept_greedy(drafts, step[0])
    crop_cache(chain_cache, L + n + 1)
    assert n == (5 if wrong_at is None else wrong_at)

    tree = DraftTree.chain(drafts)
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3] and tree.depths.tolist() == [1, 2, 3, 4, 5] and len(tree) == 5
    v = verify_tree(model, cache, L, anchor, tree, layers)
    assert v.path == list(range(n)) and v.tokens == drafts[:n].tolist() and v.next_anchor == next_anchor
    torch.testing.assert_close(v.features, step[1][: n + 1], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(v.logits, step[0], atol=1e-4, rtol=1e-4)
    assert_same_cache(cache, chain_cache)


@torch.no_grad()
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_compacted_cache_equals_a_fresh_forward_over_the_accepted_path(case, attn):
    target, prompt, layers = case
    model = target.model
    before = model.config._attn_implementation
    model.set_attn_implementation(attn)
    try:
        assert model.config._attn_implementation == attn
        greedy, _ = autoregressive(target, prompt, 8)
        cache, L, anchor = prefill(model, prompt, layers)
        tree, branch = decoy_tree(greedy[1:6], 3, model.config.vocab_size)
        v = verify_tree(model, cache, L, anchor, tree, layers)
        assert v.path == branch and cache.get_seq_length() == L + 1 + 3
        fresh = DynamicCache()
        model(input_ids=torch.tensor([prompt + [anchor] + v.tokens]), cache=fresh, use_cache=True)
        assert_same_cache(cache, fresh)
    finally:
        model.set_attn_implementation(before)


# -- DDTree ----------------------------------------------------------------------------------------------------------
def rank_paths(tree: DraftTree, ids: torch.Tensor) -> list[tuple[int, ...]]:
    """Each node's path as the candidate ranks per depth (ids distinct within a depth), following its parents."""
    paths: list[tuple[int, ...]] = []
    for tok, parent, depth in zip(tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()):
        assert parent < len(paths)  # topological
        prefix = () if parent < 0 else paths[parent]
        assert len(prefix) == depth - 1
        paths.append(prefix + (ids[depth - 1].tolist().index(tok),))
    return paths


@pytest.mark.parametrize("seed", [0, 1])
def test_ddtree_is_the_top_n_path_prefixes_of_brute_force(seed):
    P, K, V = 3, 3, 20
    gen = torch.Generator().manual_seed(seed)
    top = torch.log_softmax(torch.randn(P, V, generator=gen) * 2, -1).topk(K, -1)
    logprobs, ids = top.values, torch.randperm(V, generator=gen)[top.indices]
    every = [r for d in range(1, P + 1) for r in itertools.product(range(K), repeat=d)]
    score = {r: sum(float(logprobs[d, k]) for d, k in enumerate(r)) for r in every}
    ranked = sorted(every, key=score.get, reverse=True)
    for n in range(1, 11):
        tree = ddtree(logprobs, ids, n)
        paths = rank_paths(tree, ids)
        assert len(tree) == n and set(paths) == set(ranked[:n])
        torch.testing.assert_close(tree.scores, torch.tensor([score[p] for p in paths]))
    assert set(rank_paths(ddtree(logprobs, ids, 100), ids)) == set(every)  # the heap runs dry


# -- the builder -----------------------------------------------------------------------------------------------------
class FakeExpander:
    """Deterministic peaked children (so trees grow deep): recorded per call, with each node's candidates."""

    def __init__(self, seed: int, vocab: int = 50, cands: int = 10):
        self.gen = torch.Generator().manual_seed(seed)
        self.vocab, self.cands = vocab, cands
        self.calls: list[list[int]] = []
        self.children: dict[int, dict[int, float]] = {}

    def __call__(self, nodes: list[int], tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
        assert all(-1 <= i < len(tree) for i in nodes)
        self.calls.append(list(nodes))
        top = torch.log_softmax(torch.randn(len(nodes), self.vocab, generator=self.gen) * 3, -1).topk(self.cands, -1)
        for node, ids, lps in zip(nodes, top.indices.tolist(), top.values.tolist()):
            self.children[node] = dict(zip(ids, lps))
        return top.indices, top.values


@pytest.mark.parametrize("budget", [16, 32, 64, 100])
def test_builder_fills_the_budget_expanding_w_nodes_per_call(budget):
    max_depth, w = 7, math.ceil(budget / 16)
    fake = FakeExpander(budget)
    tree, sizes = build_tree(fake, budget, max_depth)
    parents, depths, scores = tree.parents.tolist(), tree.depths.tolist(), tree.scores.tolist()
    assert len(tree) == budget and sizes == [len(c) for c in fake.calls]
    assert fake.calls[0] == [-1] and sum(sizes) <= budget
    # the nodes popped together (w at a time, in order) are expanded together, except the pop that fills the budget
    chunks = [range(s, min(s + w, budget)) for s in range(0, budget, w)]
    assert fake.calls[1:] == [[i for i in c if depths[i] < max_depth] for c in chunks[:-1]]
    assert all(s <= w for s in sizes[1:]) and sizes[1] == w
    for i, (p, d) in enumerate(zip(parents, depths)):
        assert -1 <= p < i and 1 <= d <= max_depth and d == (1 if p < 0 else depths[p] + 1)
        lp = fake.children[p][int(tree.tokens[i])]  # the child's log-prob under its parent, as expand gave it
        assert scores[i] == pytest.approx((0.0 if p < 0 else scores[p]) + lp)
        assert p < 0 or scores[p] >= scores[i]
    if budget >= 64:
        assert max(depths) == max_depth and any(len(c) < w for c in fake.calls[1:])  # depth capping was exercised


def test_builder_with_width_one_and_depth_marginals_is_ddtree():
    P, K, V = 4, 3, 30
    gen = torch.Generator().manual_seed(3)
    top = torch.log_softmax(torch.randn(P, V, generator=gen) * 2, -1).topk(K, -1)

    def expand(nodes, tree):
        d = [0 if n < 0 else int(tree.depths[n]) for n in nodes]
        return top.indices[d], top.values[d]

    built, sizes = build_tree(expand, 20, P, children=K, width=1)
    want = ddtree(top.values, top.indices, 20)
    assert sizes[:2] == [1, 1] and max(sizes) == 1
    for name in ("tokens", "parents", "depths"):
        assert getattr(built, name).tolist() == getattr(want, name).tolist()
    torch.testing.assert_close(built.scores, want.scores)


def test_builder_root_breadth_widens_only_the_root():
    """root_children > children: the root publishes more depth-1 candidates, deeper nodes keep `children`."""
    def expand(nodes, tree):  # 12 candidates per node, each a little less likely than the one before
        return (torch.arange(12).expand(len(nodes), -1) + 100,
                torch.tensor([-0.1 * (i + 1) for i in range(12)]).expand(len(nodes), -1))

    narrow, _ = build_tree(expand, 300, 3, children=4, width=1)  # a budget above both trees: every candidate enters
    wide, _ = build_tree(expand, 300, 3, children=4, width=1, root_children=12)
    kids = lambda tree, p: sum(1 for q in tree.parents.tolist() if q == p)
    assert len(narrow.tokens) == 4 + 16 + 64 and len(wide.tokens) == 12 + 48 + 192
    assert kids(narrow, -1) == 4 and kids(wide, -1) == 12
    assert max(kids(wide, p) for p in range(len(wide.tokens))) == 4


def test_builder_stops_when_the_frontier_runs_dry():
    def one_child(nodes, tree):
        return torch.full((len(nodes), 1), 7), torch.full((len(nodes), 1), -0.5)

    tree, sizes = build_tree(one_child, 16, 3)
    assert tree.tokens.tolist() == [7, 7, 7] and tree.parents.tolist() == [-1, 0, 1] and sizes == [1, 1, 1]


# -- tree methods in the speculative loop ------------------------------------------------------------------------------
def untrained_drafter(target, layer_ids: list[int]):
    """A random drafter (block 4) on the case's target."""
    from dflash_pipeline.models.drafter import DFlashDrafter
    from dflash_pipeline.train.drafter import drafter_config
    from tests.conftest import make_config

    torch.manual_seed(0)
    m = target.model
    cfg = make_config(f"drafter.mask_token_id={m.config.vocab_size - 1}")
    return DFlashDrafter(drafter_config(cfg, target, layer_ids), m.get_input_embeddings(),
                         m.get_output_embeddings()).eval()


class OracleTree(TreeMethod):
    """Hides the target's greedy continuation among decoys (a wrong sibling first at every depth), so each round
    accepts the tree's full depth: the loop's commit (tokens, drafter features, the verifier's state for the next
    round) is exercised at full acceptance."""

    name = "oracle_tree"

    def __init__(self, drafter, continuation: list[int]):
        super().__init__(drafter, budget=0)
        self.continuation, self.verifier_states, self.output = continuation, [], []

    def propose(self, state, block_size, temperature=0.0, generator=None):
        self.output = state.output
        return super().propose(state, block_size, temperature, generator)

    def tree(self, hidden, verifier_hidden, anchor):
        self.verifier_states.append(verifier_hidden)
        done = len(self.output)  # output[-1] is the anchor
        assert self.continuation[done - 1] == anchor
        true = self.continuation[done: done + hidden.shape[0]]  # what follows the anchor
        tree, _ = decoy_tree(true, hidden.shape[0] - 1, self.drafter.config.vocab_size)
        return tree


def test_tree_methods_decode_exactly_in_the_speculative_loop(case):
    """DDTree, a random Weaver's tree and an oracle tree, in `speculative`: output equal to greedy decoding; every
    round verifies the whole tree; the oracle's rounds accept the tree's full depth, and each round's verifier state
    is the target's final hidden state of the row that chose its anchor."""
    from dflash_pipeline.eval.decode import speculative
    from dflash_pipeline.models.weaver import Weaver
    from dflash_pipeline.eval.components import WeaverTreeMethod

    target, prompt, layer_ids = case
    drafter = untrained_drafter(target, layer_ids)
    ar, _ = autoregressive(target, prompt, 40)
    weaver = Weaver(drafter.config.hidden_size, rank=16, num_layers=1, num_heads=2, mlp_dim=32, top_k=16)
    torch.nn.init.normal_(weaver.query.weight)
    for method in (DDTreeMethod(drafter, 6), WeaverTreeMethod(drafter, weaver.eval(), 6, children=3),
                   WeaverTreeMethod(drafter, weaver, 6, children=3, expansions=16)):
        res = speculative(target, method, prompt, 20)
        assert res.tokens == ar[:20], method.name
        assert set(res.verified) == {6} and max(res.accepted) <= 3
    oracle = OracleTree(drafter, ar)
    res = speculative(target, oracle, prompt, 20)
    assert res.tokens == ar[:20]
    assert res.accepted[:-1] == [3] * (len(res.accepted) - 1)
    out = target.model(input_ids=torch.tensor([prompt + ar[:20]]), output_hidden_states=True)
    final = out.hidden_states[-1][0]
    for r, state in enumerate(oracle.verifier_states):  # round r's anchor is output token 4r, chosen at that row - 1
        torch.testing.assert_close(state, final[len(prompt) + 4 * r - 1], atol=1e-4, rtol=1e-4)


def test_weaver_expansions_bound_the_weaver_calls_of_a_tree(case):
    """weaver.expansions=n grows the whole budget in at most n Weaver calls (the root's included), each expanding
    ceil(budget / n) frontier nodes: fewer calls, the same number of nodes."""
    from dflash_pipeline.models.weaver import Weaver
    from dflash_pipeline.eval.components import weaver_tree

    target, _, layer_ids = case
    drafter = untrained_drafter(target, layer_ids)
    weaver = Weaver(drafter.config.hidden_size, rank=16, num_layers=1, num_heads=2, mlp_dim=32, top_k=16).eval()
    g = torch.Generator().manual_seed(0)
    hidden, verifier = torch.randn(4, drafter.config.hidden_size, generator=g), torch.randn(drafter.config.hidden_size,
                                                                                             generator=g)
    counts = {}
    for n in (16, 4, 2):
        calls: list[int] = []
        tree = weaver_tree(weaver, drafter, verifier, hidden, 7, 32, children=3, calls=calls, expansions=n)
        assert len(tree) == 32 and calls[0] == 1 and len(calls) <= n
        counts[n] = len(calls)
    assert counts[16] > counts[4] > counts[2]

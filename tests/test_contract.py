"""The contract matrix, generated from the method catalogue (eval/methods.py): every eval method, as evaluated (a tree
method once per node budget), against each contract a user relies on:

  offline   its teacher-forced metrics are well formed: a_k per position in [0, 1], tau_offline = 1 + sum of the
            survival products, a block method no better than the oracle over its own candidates, a tree within its
            node budget;
  greedy    its speculative greedy output equals autoregressive decoding token for token, on a tiny target whose
            greedy output varies (target.tiny.initializer_range=0.1: not the one-token loop of the default tiny
            target), with every component trained on that target's teacher data;
  sampling  speculative sampling keeps the target's distribution (chi-square over the joint of the first tokens,
            with a draft vocabulary smaller than the target's), unless the method declares itself greedy-only, in
            which case sampling is refused before any decoding.

A new component's methods enter the matrix by being registered; `test_the_contract_checks_catch_planted_bugs` shows
each check failing on a method broken in its way. Also here: each component's sections (conf/catalogue.py) cover
the config it reads.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from dflash_pipeline.conf import catalogue
from dflash_pipeline.runtime.stages import stage_sections, train_stage
from dflash_pipeline.eval.decode import autoregressive, speculative
from dflash_pipeline.eval.metrics import offline_metrics, simulated_tau
from dflash_pipeline.eval.inputs import load_drafter, reply_items
from dflash_pipeline.eval.methods import METHODS, evaluated_names, load_methods, make_method
from dflash_pipeline.train.loop import COMPONENTS as TRAINING
from dflash_pipeline.eval.tree import TreeMethod, tree_offline_metrics
from dflash_pipeline.models.selector import PairSelector
from dflash_pipeline.models.target import load_target
from dflash_pipeline.train.component import StageInputs

from conftest import chat_prompt_ids, chi_square_p, make_config, sampling_case

VARYING = ("target.tiny.initializer_range=0.1", "drafter.block_size=4", "trainer.steps=30", "trainer.lr=3e-3",
           "trainer.batch_sequences=4", "trainer.save_every=30", "trainer.eval_every=30")
BUDGETS = [4, 8]
CASES = sorted(evaluated_names(sorted(METHODS), BUDGETS).items())
PROMPTS = ["Write a short poem about the sea.", "Explain what a hash table is.", "List three primary colours."]
NEW_TOKENS = 24


def contract_config(*extra: str):
    return make_config(*VARYING, f"eval.methods=[{','.join(sorted(METHODS))}]",
                       f"eval.tree_budgets=[{','.join(map(str, BUDGETS))}]", *extra)


@pytest.fixture(scope="module")
def varying(tmp_path_factory):
    """Teacher data of the varying tiny target, the drafter and every component trained on it, and every method of
    the catalogue loaded from those exports as the eval stage loads them."""
    from dflash_pipeline.data.teacher import run_teacher
    from dflash_pipeline.train.loop import run_train

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("contract")
    cfg = contract_config()
    teacher = run_teacher(cfg, root / "teacher")
    train = run_train(cfg, root / "train", data_dir=teacher)
    for name, entry in catalogue.COMPONENTS.items():
        if entry.on_frozen_drafter:
            run_train(cfg, train / name, data_dir=teacher, component=name, drafter_dir=train / "export")
    target = load_target(cfg.target, cfg.cache_dir)
    drafter, drafter_dir = load_drafter(cfg, train, target)
    methods = load_methods(cfg, drafter, train, {}, drafter_dir)
    prompts = chat_prompt_ids(target.tokenizer, PROMPTS)
    references = [autoregressive(target, p, NEW_TOKENS)[0] for p in prompts]
    # offline metrics on the target's own replies, their final hidden states included (the tree methods use them)
    heldout = reply_items(target, list(drafter.config.target_layer_ids), list(zip(prompts, references)), final=True)
    yield SimpleNamespace(cfg=cfg, teacher=teacher, train=train, target=target, drafter=drafter, methods=methods,
                          heldout=heldout, prompts=prompts, references=references, block=drafter.config.block_size)
    torch.set_num_threads(before)


@pytest.mark.slow
def test_every_method_is_in_the_matrix(varying):
    assert set(varying.methods) == {name for name, _ in CASES}


@pytest.mark.slow
def test_the_varying_target_exercises_acceptance_and_rejection(varying):
    """The greedy contract means something only if outputs vary and drafts are both accepted and rejected."""
    assert all(len(set(ref)) >= 4 for ref in varying.references), varying.references
    accepted = [n for p in varying.prompts for n in speculative(varying.target, varying.methods["chain"], p,
                                                                  NEW_TOKENS, varying.block).accepted]
    assert 0 in accepted and max(accepted) >= 1, accepted


# -- the three contracts, each a function a planted bug must fail --------------------------------------------
def check_offline(method, drafter, items, block: int) -> dict:
    """The method's teacher-forced metrics, as the eval stage computes them, checked for what they must satisfy."""
    if isinstance(method, TreeMethod):
        m = tree_offline_metrics(drafter, items, block, {"m": method})["m"]
        assert m["nodes_per_block"] <= method.budget, f"{m['nodes_per_block']} nodes per block > budget {method.budget}"
    else:
        res = offline_metrics(drafter, items, block, [1, method.top_k], methods={"m": method})
        m = res["methods"]["m"]
        oracle = res["oracle_tau"][str(method.top_k)]
        assert m["tau_offline"] <= oracle + 1e-6, f"tau_offline {m['tau_offline']} above the oracle's {oracle}"
    a = m["a_k"]
    assert len(a) == block - 1 and all(0.0 <= x <= 1.0 for x in a), a
    assert m["tau_offline"] == pytest.approx(simulated_tau(a)), (m["tau_offline"], a)
    assert 1.0 <= m["tau_offline"] <= block
    return m


def check_greedy(target, method, prompts, references, block: int) -> list[int]:
    """Speculative greedy decoding equals the autoregressive references; returns the accepted drafts per round."""
    accepted = []
    for i, (prompt, reference) in enumerate(zip(prompts, references)):
        res = speculative(target, method, prompt, NEW_TOKENS, block)
        assert res.tokens == reference, f"prompt {i}: differs from autoregressive decoding"
        accepted += res.accepted
    return accepted


def check_sampling(target, method, prompt, joint, V: int, block: int = 3, n: int = 2000,
                   temperature: float = 1.0) -> None:
    """The joint of the first 3 sampled tokens against the target's exact joint (chi-square), or, for a
    greedy-only method, sampling refused."""
    gen = torch.Generator().manual_seed(3)
    if method.greedy_only:
        with pytest.raises(ValueError, match="greedily only|temperature=0"):
            speculative(target, method, prompt, 3, block, temperature=temperature, generator=gen)
        return
    counts = torch.zeros(V ** 3, dtype=torch.float64)
    for _ in range(n):
        a, b, c = speculative(target, method, prompt, 3, block, temperature=temperature, generator=gen).tokens
        counts[(a * V + b) * V + c] += 1
    p = chi_square_p(counts, joint * n)
    assert p > 1e-3, f"sampled joint differs from the target's (chi-square p = {p:.2g})"


# -- the matrix ----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, _ in CASES])
def test_offline_metrics(varying, name):
    check_offline(varying.methods[name], varying.drafter, varying.heldout, varying.block)


@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, _ in CASES])
def test_greedy_equals_autoregressive(varying, name):
    check_greedy(varying.target, varying.methods[name], varying.prompts, varying.references, varying.block)


def fresh_selector(drafter, config) -> PairSelector:
    """An untrained selector with strong random pair scores (a trained one would be close to the marginals)."""
    selector = PairSelector(drafter.config.vocab_size, drafter.config.hidden_size, config.rank, config.top_k)
    with torch.no_grad():
        selector.successor_codebook.normal_(0, 1.0)
    return selector


# The components a sampling method may use, each as an untrained model on the sampling case's drafter: a new
# component whose methods sample adds its entry (test_sampling fails until it does).
FRESH = {"selector": (fresh_selector, {"top_k": 3, "rank": 8})}


@pytest.fixture(scope="module")
def sampling(tmp_path_factory):
    """The 6-token target of tests/conftest.py's sampling_case, its drafter over a 4-token draft vocabulary (two
    target tokens it can never draft), and untrained exports of the FRESH components on it."""
    V = 6
    tgt, drafter, prompt, _, joint = sampling_case(V)
    drafter.set_draft_vocab(torch.tensor([0, 2, 3, 5]))
    root = tmp_path_factory.mktemp("sampling")
    drafter.save_pretrained(str(root / "drafter"))
    exports, configs = {}, {}
    for name, (fresh, settings) in FRESH.items():
        configs[name] = config = OmegaConf.merge(OmegaConf.structured(catalogue.component(name).config), settings)
        comp = TRAINING[name].__new__(TRAINING[name])
        comp.drafter_dir, comp.own, comp.settings = root / "drafter", config, SimpleNamespace(steps=0)
        exports[name] = comp.export(fresh(drafter, config).eval(), root / name)  # the component's own export
    return SimpleNamespace(target=tgt, drafter=drafter, prompt=prompt, joint=joint, V=V, exports=exports,
                           configs=configs)

@pytest.mark.slow
@pytest.mark.parametrize("name", [name for name, _ in CASES])
def test_sampling_keeps_the_target_distribution_or_is_refused(sampling, varying, name):
    base, budget = dict(CASES)[name]
    if varying.methods[name].greedy_only:  # refused on the very method the eval stage loads
        check_sampling(varying.target, varying.methods[name], varying.prompts[0], None, 0, varying.block)
        return
    entry = METHODS[base]
    needs = entry.components()[1:]
    missing = [c for c in needs if c not in sampling.exports]
    assert not missing, f"{name} samples: add an untrained {missing} to FRESH in tests/test_contract.py"
    made = make_method(base, sampling.drafter, {c: sampling.exports[c] for c in needs}, budget=budget,
                       config=sampling.configs.get(entry.component))
    check_sampling(sampling.target, made, sampling.prompt, sampling.joint, sampling.V)


# -- planted bugs: each check fails on a method broken in its way ---------------------------------------------
@pytest.mark.slow
def test_the_contract_checks_catch_planted_bugs(varying, sampling):
    from dflash_pipeline.eval.protocol import ChainMethod
    from dflash_pipeline.eval.tree import DDTreeMethod, DraftTree

    class OverBudget(DDTreeMethod):  # builds a tree of twice its budget
        def tree(self, hidden, verifier_hidden, anchor):
            return DDTreeMethod(self.drafter, 2 * self.budget).tree(hidden, verifier_hidden, anchor)

    with pytest.raises(AssertionError, match="nodes per block > budget"):
        check_offline(OverBudget(varying.drafter, 4), varying.drafter, varying.heldout, varying.block)

    class MisplacedTree(DDTreeMethod):  # every node one position too deep: verified at the wrong positions
        def tree(self, hidden, verifier_hidden, anchor):
            t = super().tree(hidden, verifier_hidden, anchor)
            return DraftTree(t.tokens, t.parents, t.depths + 1, t.scores)

    with pytest.raises(AssertionError, match="differs from autoregressive decoding"):
        check_greedy(varying.target, MisplacedTree(varying.drafter, 8), varying.prompts, varying.references,
                     varying.block)

    class WrongQ(ChainMethod):  # samples at one temperature, reports the distribution of another
        def sample_path(self, logits, hidden, anchor, temperature, generator):
            tokens, _ = super().sample_path(logits, hidden, anchor, temperature, generator)
            return tokens, super().sample_path(logits, hidden, anchor, 4 * temperature, generator)[1]

    with pytest.raises(AssertionError, match="chi-square"):
        check_sampling(sampling.target, WrongQ(sampling.drafter), sampling.prompt, sampling.joint, sampling.V)

    class SilentlyGreedy(ChainMethod):  # cannot sample, but does not say so
        def propose(self, state, block_size, temperature=0.0, generator=None):
            return super().propose(state, block_size, 0.0, generator)

    with pytest.raises(Exception):  # no q to accept with: the round fails, or the joint is wrong
        check_sampling(sampling.target, SilentlyGreedy(sampling.drafter), sampling.prompt, sampling.joint,
                       sampling.V)


# -- sections cover what a component reads ----------------------------------------------------------------------
# Config read by training that never changes a stage's output: where the target's converted files are cached.
READ_WITHOUT_EFFECT = {"cache_dir"}


class ReadRecorder:
    """The root config, recording which top-level sections are read (attribute, item or get)."""

    def __init__(self, cfg):
        object.__setattr__(self, "_cfg", cfg)
        object.__setattr__(self, "read", set())

    def __getattr__(self, key):
        self.read.add(key)
        return getattr(self._cfg, key)

    def __getitem__(self, key):
        self.read.add(key)
        return self._cfg[key]

    def get(self, key, default=None):
        self.read.add(key)
        return self._cfg.get(key, default)


@pytest.mark.parametrize("name, overrides", [(name, {}) for name in catalogue.COMPONENTS]
                         + [("drafter", {"selector_loss_weight": 1.0})])  # DFlash2 joint: the selector's too
@pytest.mark.slow
def test_sections_cover_the_config_a_component_reads(varying, tmp_path, name, overrides):
    """A section a component reads but its stage hash omits would let a changed value reuse stale outputs."""
    cfg, teacher, train = varying.cfg.copy(), varying.teacher, varying.train
    for key, value in overrides.items():
        cfg.trainer[key] = value
    recorder = ReadRecorder(cfg)
    frozen = catalogue.component(name).on_frozen_drafter
    inputs = StageInputs(teacher=teacher, drafter=train / "export" if frozen else None)
    comp = TRAINING[name](recorder, inputs, torch.device("cpu"))
    batch = comp.batch(comp.step_items(0), 0)
    comp.normaliser(batch)
    loss, stats = comp.loss(comp.model, batch)
    comp.train_metrics([stats])
    comp.evaluate(comp.model)
    comp.export(comp.model, tmp_path / "export")
    allowed = set(stage_sections(cfg, train_stage(name))) | READ_WITHOUT_EFFECT
    assert recorder.read <= allowed, (f"{name} reads {sorted(recorder.read - allowed)}, which its stage hash "
                                      f"omits: add them to its sections (conf/catalogue.py)")

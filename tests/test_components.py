"""The catalogue contract: every component of conf/catalogue.py trains on tiny, resumes to the losses of an
uninterrupted run, exports, and its export reloads into the eval methods it brings; plus the selector's speculative
sampling."""
from __future__ import annotations


from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_pipeline.eval.decode import speculative
from dflash_pipeline.models.drafter import DFlashDrafter
from dflash_pipeline.models.selector import PairSelector
from dflash_pipeline.models.target import load_target
from dflash_pipeline.conf import catalogue
from dflash_pipeline.conf.schema import COMPONENT_CONFIGS
from dflash_pipeline.eval.methods import METHODS, make_method
from dflash_pipeline.train.loop import COMPONENTS as TRAINING
from dflash_pipeline.train.loop import run_train
from dflash_pipeline.eval.components import SelectorMethod

from conftest import chi_square_p, make_config, metrics, sampling_case


@pytest.fixture(scope="module")
def tiny_drafter_run(tiny_teacher, tmp_path_factory):
    """A trained tiny drafter stage (the frozen drafter of the other components)."""
    out = tmp_path_factory.mktemp("drafter") / "train"
    return run_train(make_config("trainer.steps=2"), out, data_dir=tiny_teacher)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(catalogue.COMPONENTS))
def test_every_component_trains_resumes_exports_and_reloads(name, tiny_teacher, tiny_drafter_run, tmp_path):
    own = [] if name == "drafter" else [f"{name}.warmup_steps=0"]
    steps = "trainer.steps" if name == "drafter" else f"{name}.steps"

    def train(folder, *extra):
        out = folder if name == "drafter" else folder / name
        return run_train(make_config(*own, "trainer.save_every=1", *extra), out, data_dir=tiny_teacher,
                         component=name, drafter_dir=None if name == "drafter" else tiny_drafter_run / "export")

    straight = train(tmp_path / "straight", f"{steps}=2")
    train(tmp_path / "resumed", f"{steps}=1")
    resumed = train(tmp_path / "resumed", f"{steps}=2", "trainer.resume=true")
    losses = [[row["loss"] for row in metrics(run)] for run in (straight, resumed)]
    assert len(losses[0]) == 2 and losses[1] == pytest.approx(losses[0], rel=1e-5)

    export = resumed / "export"
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()
    cfg = make_config()
    tgt = load_target(cfg.target, cfg.cache_dir).model
    drafter = DFlashDrafter.from_pretrained(str(export if name == "drafter" else tiny_drafter_run / "export"),
                                            tgt.get_input_embeddings(), tgt.get_output_embeddings())
    methods = {m: entry for m, entry in METHODS.items() if entry.component == name}
    assert methods, f"{name} brings no eval method"
    for method_name, entry in methods.items():
        if entry.also_needs:  # uses another component's export too: covered by the tiny pipeline test
            continue
        exports = {} if name == "drafter" else {name: export}
        hidden = torch.randn(3, drafter.config.block_size, drafter.config.hidden_size)
        if entry.tree:  # a draft tree of the budget's size, no deeper than the block
            tree = make_method(method_name, drafter, exports, budget=6).tree(
                hidden[0], torch.randn(drafter.config.target_hidden_size), 1)
            assert len(tree) == 6 and int(tree.depths.max()) <= drafter.config.block_size - 1
            if catalogue.component(name).config is not None and "children" in cfg[name]:  # the method reads its config
                assert make_method(method_name, drafter, exports, budget=6,
                                             config=make_config(f"{name}.children=3")[name]).children == 3
            continue
        method = make_method(method_name, drafter, exports)
        ids = torch.randint(0, drafter.config.vocab_size, (3, drafter.config.block_size - 1, method.top_k))
        tokens, _ = method.path(ids, torch.randn(ids.shape), hidden, torch.tensor([1, 2, 3]))
        assert tokens.shape == (3, drafter.config.block_size - 1)
    if name != "drafter":  # the drafter's tensors travel with the component's, unchanged
        mine, base = load_file(str(export / "model.safetensors")), load_file(str(tiny_drafter_run / "export" /
                                                                                 "model.safetensors"))
        if name == "selector":  # a trained selector replaces the DFlash2 drafter's pass-through one
            base = {k: v for k, v in base.items() if not k.startswith("candidate_selector.")}
        assert all(torch.equal(mine[k], v) for k, v in base.items()) and set(mine) > set(base)


@pytest.mark.slow
def test_selector_sampling_keeps_the_target_distribution():
    """As the chain's test (tests/test_eval.py): the joint of the first 3 sampled tokens against the target's exact
    joint, with the selector walking over the top-4 of 6 tokens with strong random pair scores."""
    V, T, N = 6, 1.0, 2000
    tgt, drafter, prompt, _, joint = sampling_case(V, T)
    selector = PairSelector(V, 32, rank=8, top_k=4)
    with torch.no_grad():
        selector.successor_codebook.normal_(0, 1.0)
    method = SelectorMethod(drafter, selector.eval(), "greedy")
    gen = torch.Generator().manual_seed(3)
    counts, accepted = torch.zeros(V ** 3, dtype=torch.float64), []
    for _ in range(N):
        res = speculative(tgt, method, prompt, 3, 3, temperature=T, generator=gen)
        a, b, c = res.tokens
        counts[(a * V + b) * V + c] += 1
        accepted += res.accepted
    hist = torch.bincount(torch.tensor(accepted), minlength=3).tolist()
    assert min(hist) > 0.05 * len(accepted), f"rejections and acceptances must both occur: {hist}"
    assert chi_square_p(counts, joint * N) > 1e-3


def test_eval_refuses_a_component_trained_on_another_drafter(tmp_path):
    """A component's export carries its drafter's tensors unchanged; the eval compares them with the drafter it
    evaluates, so a selector trained on yesterday's drafter is refused instead of scored on today's."""
    from safetensors.torch import save_file

    from dflash_pipeline.eval.methods import drafter_difference

    fixture = Path(__file__).parent / "fixtures" / "tiny_drafter"
    base = load_file(str(fixture / "model.safetensors"))
    export = tmp_path / "export"
    export.mkdir()
    save_file({**base, "candidate_selector.successor_codebook": torch.zeros(4, 2)}, str(export / "model.safetensors"))
    assert drafter_difference(export, fixture) is None
    key = sorted(base)[0]
    save_file({**base, key: base[key] + 1}, str(export / "model.safetensors"))
    assert drafter_difference(export, fixture) == f"tensor {key} differs"
    save_file({k: v for k, v in base.items() if k != key}, str(export / "model.safetensors"))
    assert drafter_difference(export, fixture) == f"no tensor {key}"


@pytest.mark.slow
def test_jump_kl_without_teacher_top_k_is_refused(tiny_drafter_run, tmp_path):
    """jump.kl_weight mixes in a KL to the teacher's stored top-k; without those in the data it used to train plain
    CE silently."""
    from dflash_pipeline.data.teacher import run_teacher
    from dflash_pipeline.train.errors import TrainError

    teacher = run_teacher(make_config("teacher.topk_logprobs=0"), tmp_path / "teacher")
    with pytest.raises(TrainError, match=r"jump.kl_weight=0.5 needs teacher data with top-k log-probs"):
        run_train(make_config("jump.kl_weight=0.5", "teacher.topk_logprobs=0"), tmp_path / "jump", data_dir=teacher,
                  component="jump", drafter_dir=tiny_drafter_run / "export")


@pytest.mark.slow
def test_a_weaver_shape_the_settings_cannot_build_is_one_line(tiny_teacher, tiny_drafter_run, tmp_path):
    from dflash_pipeline.train.errors import TrainError

    with pytest.raises(TrainError, match=r"weaver.num_heads 3 must divide weaver.rank 16 .*fix the weaver"):
        run_train(make_config("weaver.num_heads=3"), tmp_path / "weaver", data_dir=tiny_teacher, component="weaver",
                  drafter_dir=tiny_drafter_run / "export")
    assert not (tmp_path / "weaver" / "export").exists()


def test_no_component_is_half_registered():
    """Every component with a config group has its line in conf/config.yaml's defaults (else its
    conf/<name>/default.yaml is silently ignored and `<name>=x` needs a `+`), and the smoke test (`experiment=tiny`)
    trains every component on a frozen drafter and evaluates every method of the catalogue."""
    from omegaconf import OmegaConf

    root = Path(__file__).parents[1] / "conf"
    defaults = OmegaConf.load(root / "config.yaml").defaults
    groups = {k for entry in defaults if isinstance(entry, dict) or OmegaConf.is_dict(entry) for k in entry}
    for name in COMPONENT_CONFIGS:
        assert name in groups, f"conf/config.yaml's defaults lack `- {name}: default`"
        assert (root / name / "default.yaml").is_file(), f"conf/{name}/default.yaml is missing"
    cfg = make_config()
    assert set(cfg.eval.methods) == set(METHODS)
    assert {str(c) for c in cfg.pipeline.components} == {n for n, c in catalogue.COMPONENTS.items()
                                                         if c.on_frozen_drafter}
    # the configuration and the training code name the same components, each with its config section
    assert set(catalogue.COMPONENTS) == set(TRAINING) == {"drafter", *COMPONENT_CONFIGS}
    assert {n: c.config for n, c in catalogue.COMPONENTS.items() if c.config} == COMPONENT_CONFIGS
    assert {m.component for m in METHODS.values()} <= set(catalogue.COMPONENTS)

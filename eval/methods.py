"""The catalogue of decoding methods: every method `eval.methods` can name, in one table of typed entries.

An entry says which trained component brings the method (whose export and config section it reads), which other
components it needs, whether it is a tree (made once per node budget of eval.tree_budgets, evaluated as
`<name>_<budget>`), and how it is made. The classes live where their kind is explained: the chain in eval/protocol.py,
the decoding policies in eval/policies.py, DDTree in eval/tree.py, the trained components' methods in
eval/components.py. Adding a method is one line here and its class there; nothing registers itself.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from omegaconf import DictConfig, OmegaConf

from dflash_pipeline.conf.catalogue import COMPONENTS
from dflash_pipeline.conf.schema import ConfigError, PolicyConfig
from dflash_pipeline.eval import components as trained
from dflash_pipeline.eval import policies
from dflash_pipeline.eval.errors import EvalError
from dflash_pipeline.eval.protocol import ChainMethod
from dflash_pipeline.eval.tree import DDTreeMethod, check_target
from dflash_pipeline.models.drafter import DFlashDrafter
from dflash_pipeline.runtime.stages import component_export

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MethodInputs:
    """What a method is made from."""

    drafter: DFlashDrafter  # frozen
    exports: dict[str, Path]  # the trained export folder of each component the method uses besides the drafter
    policy: PolicyConfig | DictConfig  # the eval.policy settings (conf/schema.py PolicyConfig)
    # the config section of the component that brings the method (its defaults if not given)
    config: DictConfig | None = None
    budget: int | None = None  # a tree method's node budget


@dataclass(frozen=True)
class Method:
    """A catalogue entry: `make(MethodInputs)` -> the method (eval/protocol.py's protocol)."""

    component: str  # the trained component that brings it: "drafter", or one trained on the frozen drafter
    make: Callable[[MethodInputs], object]
    also_needs: tuple[str, ...] = ()  # other trained components whose exports it reads
    tree: bool = False  # one method per node budget of eval.tree_budgets

    def components(self) -> tuple[str, ...]:
        """The trained components it uses, the drafter always among them."""
        return tuple(dict.fromkeys(("drafter", self.component, *self.also_needs)))


def _selector(m: MethodInputs):
    return trained.load_selector(m.exports["selector"], m.drafter.norm.weight.device)


def _offset_heads(name: str, load: Callable) -> dict[str, Method]:
    """An offset-head component's two methods: its heads with the drafter's argmax in the gaps, and `<name>_selector`
    with the trained selector's best path from both neighbours there."""
    return {name: Method(name, lambda m: load(m.exports[name], m.drafter)),
            f"{name}_selector": Method(name, lambda m: load(m.exports[name], m.drafter, _selector(m)),
                                       also_needs=("selector",))}


METHODS: dict[str, Method] = {
    # the drafter alone: its argmax chain, and decoding policies on it (eval/policies.py)
    "chain": Method("drafter", lambda m: ChainMethod(m.drafter)),
    "boltzmann": Method("drafter", lambda m: policies.BoltzmannMethod(m.drafter, m.policy)),
    "act": Method("drafter", lambda m: policies.ActMethod(m.drafter, m.policy)),
    "adaptive": Method("drafter", lambda m: policies.AdaptiveMethod(m.drafter, m.policy)),
    # the training-free draft tree from the drafter's marginals (eval/tree.py)
    "ddtree": Method("drafter", lambda m: DDTreeMethod(m.drafter, m.budget), tree=True),
    # DFlash2's pair-codebook selector: its walk, its exact best path, middle-out selection (bmobs: Boltzmann centre)
    "selector_greedy": Method("selector", lambda m: trained.SelectorMethod(m.drafter, _selector(m), "greedy")),
    "selector_viterbi": Method("selector", lambda m: trained.SelectorMethod(m.drafter, _selector(m), "viterbi")),
    "mobs": Method("selector", lambda m: policies.MiddleOutMethod(m.drafter, _selector(m), m.policy, False)),
    "bmobs": Method("selector", lambda m: policies.MiddleOutMethod(m.drafter, _selector(m), m.policy, True)),
    # DFlash5's jump heads and the separate jump head
    **_offset_heads("jump", trained.load_jump),
    **_offset_heads("jump_head", trained.load_jump_head),
    # the Weaver's trees, shaped by its config section's decode settings
    "weaver_tree": Method("weaver", lambda m: trained.WeaverTreeMethod(
        m.drafter, trained.load_weaver(m.exports["weaver"], m.drafter.norm.weight.device), m.budget,
        m.config.children, m.config.root_children, m.config.expansions), tree=True),
}


def method(name: str) -> Method:
    if name not in METHODS:
        raise KeyError(f"unknown eval method {name!r}; available: {', '.join(sorted(METHODS))}")
    return METHODS[name]


def check_names(names) -> None:
    """Refuse eval.methods that the catalogue does not hold, before any stage writes."""
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise ConfigError(f"unknown eval.methods {unknown}; available: {', '.join(sorted(METHODS))} (fix the value on "
                          "the command line or in the experiment YAML)")


def evaluated_names(names, budgets) -> dict[str, tuple[str, int | None]]:
    """{name as evaluated and reported: (catalogue method, node budget)}: a tree method once per budget."""
    out = {}
    for name in names:
        if method(name).tree:
            out.update({f"{name}_{n}": (name, int(n)) for n in budgets})
        else:
            out[name] = (name, None)
    return out


def make_method(name: str, drafter, exports: dict[str, Path] | None = None, policy=None, budget: int | None = None,
                config=None):
    """The method `name` on `drafter`, with the export folders of the components it uses, the eval.policy settings
    and its component's config section (defaults of each when not given); a tree method with its node budget."""
    entry = method(name)
    own = COMPONENTS[entry.component].config
    policy = OmegaConf.structured(PolicyConfig) if policy is None else policy
    if config is None and own is not None:
        config = OmegaConf.structured(own)
    if entry.tree and budget is None:
        raise ValueError(f"{name} is a tree method: give it a node budget")
    return entry.make(MethodInputs(drafter, dict(exports or {}), policy, config, budget))


def components_used(names) -> list[str]:
    """The components eval.methods `names` use, the drafter first: what the eval stage's config hash covers."""
    return list(dict.fromkeys(c for m in names for c in method(m).components()))


def load_methods(cfg: DictConfig, drafter: DFlashDrafter, train_dir: Path, component_dirs: dict[str, Path],
                 drafter_dir: Path | None = None) -> dict:
    """{name: method} for eval.methods, each on the drafter with its component's trained export (refused when that
    export was trained on another drafter than the one of `drafter_dir`)."""
    methods, checked = {}, set()
    for name, (base, budget) in evaluated_names(cfg.eval.methods, cfg.eval.tree_budgets).items():
        exports = {}
        for component in method(base).components()[1:]:
            exports[component] = component_export(component, train_dir, component_dirs)
            if not (exports[component] / "config.json").is_file():
                raise EvalError(f"eval method {name} needs the trained {component} at {exports[component]}: run "
                                f"dflash-train trainer.component={component} (or add it to pipeline.components)")
            if drafter_dir is not None and component not in checked:
                differs = drafter_difference(exports[component], drafter_dir)
                if differs:
                    raise EvalError(f"eval method {name}: the {component} at {exports[component]} was trained on "
                                    f"another drafter than {drafter_dir} ({differs}); retrain it on this drafter or "
                                    f"set eval.drafter_dir to the drafter it was trained on")
                checked.add(component)
        try:
            owner = method(base).component
            methods[name] = make_method(base, drafter, exports, cfg.eval.policy, budget,
                                        cfg.get(owner) if COMPONENTS[owner].config else None)
        except ValueError as err:  # exports that do not fit together
            raise EvalError(f"eval method {name}: {err}") from err
    return methods


def drafter_difference(export: Path, drafter_dir: Path) -> str | None:
    """How a component's export differs from the drafter it should carry unchanged (None: it carries it). A DFlash2
    drafter's pass-through selector is not the drafter's: a trained selector replaces it."""
    from safetensors import safe_open

    from dflash_pipeline.models.selector import SELECTOR_PREFIX

    with safe_open(str(drafter_dir / "model.safetensors"), "pt") as base, \
            safe_open(str(export / "model.safetensors"), "pt") as comp:
        own = set(comp.keys())
        for key in base.keys():
            if key.startswith(SELECTOR_PREFIX):
                continue
            if key not in own:
                return f"no tensor {key}"
            if not torch.equal(base.get_tensor(key), comp.get_tensor(key)):
                return f"tensor {key} differs"
    return None


def runnable(methods: dict, block_size: int, temperature: float, model) -> tuple[dict, dict[str, str]]:
    """`methods` split into those this target family runs and those it cannot (trees on a recurrent target), the
    latter logged as {name: why} to be named in the results; a method that cannot run these settings (block size,
    temperature) is refused. The argument is left as it is."""
    run, not_run = {}, {}
    for name, m in methods.items():
        try:
            m.check(block_size, temperature)
        except ValueError as err:
            raise EvalError(f"eval method {name}: {err}") from err
        try:
            check_target(m, model)
            run[name] = m
        except ValueError as err:
            log.warning("eval method %s not run: %s", name, err)
            not_run[name] = str(err)
    return run, not_run

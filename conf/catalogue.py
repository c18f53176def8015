"""The catalogue of trainable components: the one place `trainer.component`, `pipeline.components` and `eval.methods`
are looked up.

A component is one module (train/<name>.py) that declares, at module level:
  CONFIG     its config dataclass, the config group conf/<name>/ (None: it is configured by drafter + trainer)
  SECTIONS   the config sections of its own that its stage's output depends on (the stage hash adds its inputs'), or
             a function of the config giving them (the drafter's: the selector's too when trained jointly)
  COMPONENT  its training component, a class following `train.component.TrainingComponent`
  METHODS    the eval methods it brings: {name: EvalMethod}, each made from MethodInputs (its component's config
             included; eval/protocol.py says what a method does)
  DECODE_ONLY  (optional) keys of its SECTIONS that only shape decoding (a tree's shape): left out of the training
             stages' hash, so changing one re-runs the eval and not the training; the eval's hash keeps them
  INPUTS     the stages it trains on: ("teacher",) for the drafter; ("teacher", "drafter") for a component trained on
             a frozen drafter, which gets a stage of its own, train/<name>/ in the run folder
Adding a component touches its module, its config group (conf/<name>/default.yaml and its line in conf/config.yaml's
defaults, both checked by tests/test_components.py), its tests, and this table; nothing in the training loop,
the stage code or the eval loop.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Callable

COMPONENTS = {
    "drafter": "dflash_pipeline.train.drafter",
    "selector": "dflash_pipeline.train.selector",
    "jump": "dflash_pipeline.train.jump",
    "jump_head": "dflash_pipeline.train.jump_head",
    "weaver": "dflash_pipeline.train.weaver",
}


@dataclass(frozen=True)
class MethodInputs:
    """What an eval method is made from."""

    drafter: object  # the frozen DFlashDrafter
    exports: dict[str, Path]  # the trained export folder of each component the method uses besides the drafter
    policy: object  # the eval.policy settings (conf/schema.py PolicyConfig)
    config: object = None  # the config section of the component that brings the method (its defaults if not given)
    budget: int | None = None  # a tree method's node budget


@dataclass(frozen=True)
class EvalMethod:
    """make(MethodInputs) -> the method; the exports hold the component that brings it (unless that is the drafter)
    and `also_needs`. A tree method (`tree`) is made once per node budget of eval.tree_budgets, evaluated as
    `<name>_<budget>`."""

    make: Callable[[MethodInputs], object]
    also_needs: tuple[str, ...] = ()
    tree: bool = False


def module(name: str) -> ModuleType:
    if name not in COMPONENTS:
        raise KeyError(f"unknown component {name!r}; available: {', '.join(COMPONENTS)}")
    return importlib.import_module(COMPONENTS[name])


def config_classes() -> dict[str, type]:
    """{component: its config dataclass} for the components that bring their own config group."""
    return {name: module(name).CONFIG for name in COMPONENTS if module(name).CONFIG is not None}


def sections(name: str, cfg) -> tuple[str, ...]:
    """The config sections of a component's own that its stage depends on, for this config."""
    own = module(name).SECTIONS
    return tuple(own(cfg) if callable(own) else own)


def decode_only() -> dict[str, tuple[str, ...]]:
    """{config section: its keys that only shape decoding}, over every component (DECODE_ONLY)."""
    out: dict[str, tuple[str, ...]] = {}
    for name in COMPONENTS:
        m = module(name)
        keys = tuple(getattr(m, "DECODE_ONLY", ()))
        if keys and not callable(m.SECTIONS):
            for section in m.SECTIONS:
                out[section] = out.get(section, ()) + keys
    return out


def on_frozen_drafter(name: str) -> bool:
    """Trained on a frozen drafter: a stage of its own under the drafter's train folder."""
    return "drafter" in module(name).INPUTS


def methods() -> dict[str, tuple[str, EvalMethod]]:
    """{eval method: (the component that brings it, the method)}."""
    return {method: (name, entry) for name in COMPONENTS for method, entry in module(name).METHODS.items()}


def method_components(name: str) -> tuple[str, ...]:
    """The trained components an eval method uses, the drafter always among them."""
    owner, entry = methods()[name]
    return tuple(dict.fromkeys(("drafter", owner, *entry.also_needs)))


def evaluated_names(names, budgets) -> dict[str, tuple[str, int | None]]:
    """{name as evaluated and reported: (catalogue method, node budget)}: a tree method once per budget."""
    out = {}
    for name in names:
        if methods()[name][1].tree:
            out.update({f"{name}_{n}": (name, int(n)) for n in budgets})
        else:
            out[name] = (name, None)
    return out

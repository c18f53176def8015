"""The catalogue of trainable components: the one place `trainer.component`, `pipeline.components` and `eval.methods`
are looked up.

A component is one module (train/<name>.py) that declares, at module level:
  CONFIG     its config dataclass, the config group conf/<name>/ (None: it is configured by drafter + trainer)
  COMPONENT  its training component, a class following `train.component.TrainingComponent`
  METHODS    the eval methods it brings: {name: factory(drafter, export_dir) -> method} (see eval/decode.py)
  INPUTS     the stages it trains on: ("teacher",) for the drafter; ("teacher", "drafter") for a component trained on
             a frozen drafter, which gets a stage of its own, train/<name>/ in the run folder
Adding a component touches its module, its config group, its tests, and this table; nothing in the training loop,
the stage code or the eval loop. Modules are imported only when a component or method is used.
"""
from __future__ import annotations

import importlib
from types import ModuleType

COMPONENTS = {
    "drafter": "dflash_pipeline.train.drafter",
    "selector": "dflash_pipeline.train.selector",
    "jump": "dflash_pipeline.train.jump",
}


def module(name: str) -> ModuleType:
    if name not in COMPONENTS:
        raise KeyError(f"unknown component {name!r}; available: {', '.join(COMPONENTS)}")
    return importlib.import_module(COMPONENTS[name])


def config_classes() -> dict[str, type]:
    """{component: its config dataclass} for the components that bring their own config group."""
    return {name: module(name).CONFIG for name in COMPONENTS if module(name).CONFIG is not None}


def on_frozen_drafter(name: str) -> bool:
    """Trained on a frozen drafter: a stage of its own under the drafter's train folder."""
    return "drafter" in module(name).INPUTS


def make_method(name: str, drafter, export_dir=None):
    """An eval method of the catalogue on `drafter`; export_dir: its component's trained export (None for the
    drafter's own methods)."""
    if name not in methods():
        raise KeyError(f"unknown eval method {name!r}; available: {', '.join(sorted(methods()))}")
    return methods()[name][1](drafter, export_dir)


def methods() -> dict[str, tuple[str, object]]:
    """{eval method: (the component that brings it, its factory)}."""
    out = {}
    for name in COMPONENTS:
        for method, factory in module(name).METHODS.items():
            out[method] = (name, factory)
    return out

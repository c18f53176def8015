"""The catalogue of trainable components: the one place `trainer.component` and `pipeline.components` are looked up,
and what the stage hashes (runtime/stages.py) know of each component.

An entry says, as configuration only:
  config       its config dataclass (conf/schema.py), the config group conf/<name>/ (None: the drafter, configured by
               the drafter and trainer sections)
  sections     the config sections of its own that its stage's output depends on (the stage hash adds its inputs'),
               or a function of the config giving them (the drafter's: the selector's too when trained jointly)
  inputs       the stages it trains on: ("teacher",) for the drafter; ("teacher", "drafter") for a component trained
               on a frozen drafter, which gets a stage of its own, train/<name>/ in the run folder
  decode_only  keys of its sections that only shape decoding (a tree's shape): left out of the training stages' hash,
               so changing one re-runs the eval and not the training; the eval's hash keeps them
Its training code is train/<name>.py (train/loop.py's COMPONENTS), its decoding methods are entries of
eval/methods.py. Adding a component touches its config class and group (conf/<name>/default.yaml and its line in
conf/config.yaml's defaults, both checked by tests/test_components.py), this table, its training module, its methods
and its tests; nothing in the training loop, the stage code or the eval loop.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from dflash_pipeline.conf.schema import COMPONENT_CONFIGS


def drafter_sections(cfg) -> tuple[str, ...]:
    """The drafter stage's own config sections; DFlash2 joint training (trainer.selector_loss_weight > 0) trains the
    selector in this stage too, so its settings enter the stage hash; so do the producer's (its engine and dtype:
    where it spools is left out) when it feeds the features."""
    return (("drafter", "trainer") + (("selector",) if cfg.trainer.get("selector_loss_weight", 0) > 0 else ())
            + (("producer",) if cfg.trainer.get("features", "dataset") == "producer" else ()))


@dataclass(frozen=True)
class Component:
    config: type | None
    sections: tuple[str, ...] | Callable[[object], tuple[str, ...]]
    inputs: tuple[str, ...]
    decode_only: tuple[str, ...] = ()

    @property
    def on_frozen_drafter(self) -> bool:
        """Trained on a frozen drafter: a stage of its own under the drafter's train folder."""
        return "drafter" in self.inputs


FROZEN = ("teacher", "drafter")
COMPONENTS: dict[str, Component] = {
    "drafter": Component(None, drafter_sections, ("teacher",)),
    "selector": Component(COMPONENT_CONFIGS["selector"], ("selector",), FROZEN),
    "jump": Component(COMPONENT_CONFIGS["jump"], ("jump",), FROZEN),
    "jump_head": Component(COMPONENT_CONFIGS["jump_head"], ("jump_head",), FROZEN),
    # the trees' shape at eval: the trained weights do not depend on them
    "weaver": Component(COMPONENT_CONFIGS["weaver"], ("weaver",), FROZEN,
                        decode_only=("children", "root_children", "expansions")),
}


def component(name: str) -> Component:
    if name not in COMPONENTS:
        raise KeyError(f"unknown component {name!r}; available: {', '.join(COMPONENTS)}")
    return COMPONENTS[name]


def sections(name: str, cfg) -> tuple[str, ...]:
    """The config sections of a component's own that its stage depends on, for this config."""
    own = component(name).sections
    return tuple(own(cfg) if callable(own) else own)


def decode_only() -> dict[str, tuple[str, ...]]:
    """{config section: its keys that only shape decoding}, over every component."""
    out: dict[str, tuple[str, ...]] = {}
    for c in COMPONENTS.values():
        if c.decode_only and not callable(c.sections):
            for section in c.sections:
                out[section] = out.get(section, ()) + c.decode_only
    return out

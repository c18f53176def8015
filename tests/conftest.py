"""Shared fixtures: the REAL config composed with Hydra (experiment=tiny) and a teacher dataset built once."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from conf.schema import register

os.environ.setdefault("WANDB_MODE", "offline")
register()


def make_config(*overrides: str, return_hydra_config: bool = False):
    """Compose conf/config.yaml with experiment=tiny and the given overrides, as the console scripts do."""
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="conf", version_base=None):
        return compose(config_name="config", overrides=["experiment=tiny", *overrides],
                       return_hydra_config=return_hydra_config)


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory) -> Path:
    """A finished tiny teacher dataset (8 samples, 2 shards, 2 turns, top-k log-probs)."""
    from data.teacher import run_teacher

    out = tmp_path_factory.mktemp("tiny") / "teacher"
    return run_teacher(make_config(), out)

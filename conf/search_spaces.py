"""Conditional Optuna search spaces for `hydra.sweeper.custom_search_space` (the sweeper's own `params` cannot
express "this key only when that one has this value")."""
from __future__ import annotations

from omegaconf import DictConfig


def recipe(cfg: DictConfig, trial) -> None:
    """What generalises at small data (conf/sweep/optuna_recipe.yaml): the drafter's MLP width is searched only for a
    randomly initialised drafter, because drafter.init=target copies the target's layers and needs their width."""
    init = trial.suggest_categorical("drafter.init", ["random", "target"])
    if init == "random":
        trial.suggest_categorical("drafter.intermediate_size", [768, 1536])

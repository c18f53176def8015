"""Console scripts: each is a Hydra app over conf/config.yaml that composes the config and calls one stage.

Every stage writes under the Hydra run directory (runs/<name> by default; `hydra.run.dir=...` moves it), so a stage
finds the output of the one before it without extra arguments.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from conf.schema import register

register()
log = logging.getLogger("dflash")

def _user_errors() -> tuple[type[Exception], ...]:
    """Errors that come from bad input: shown as one line, not a traceback."""
    from data.shards import DatasetError
    from data.sources import DataSourceError
    from models.target import TargetError
    from eval.stage import EvalError
    from train.loop import TrainError

    return (DatasetError, DataSourceError, TargetError, TrainError, EvalError)


def _run_dir() -> Path:
    return Path(HydraConfig.get().runtime.output_dir)


def _guard(fn):
    """Run a stage; a user error becomes one line on stderr and exit status 2."""

    def wrapped(cfg: DictConfig) -> None:
        try:
            fn(cfg)
        except _user_errors() as e:
            log.error("%s", e)
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)

    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = fn.__doc__
    return wrapped


def run_stages(cfg: DictConfig, run_dir: Path, stages: list[str]) -> dict[str, Path]:
    """Run the named stages in order; each skips itself when its output exists for the same config."""
    from conf.stages import stage_dir
    from data.teacher import run_teacher
    from eval.stage import run_eval
    from train.loop import run_train

    runners = {"teacher": run_teacher, "train": run_train, "eval": run_eval}
    outputs = {}
    for stage in stages:
        outputs[stage] = runners[stage](cfg, stage_dir(cfg, stage, run_dir))
    return outputs


@hydra.main(config_path=".", config_name="config", version_base=None)
@_guard
def teacher(cfg: DictConfig) -> None:
    """dflash-teacher: regenerate replies with the target and store its features."""
    run_stages(cfg, _run_dir(), ["teacher"])


@hydra.main(config_path=".", config_name="config", version_base=None)
@_guard
def train(cfg: DictConfig) -> None:
    """dflash-train: train a component on the teacher dataset."""
    run_stages(cfg, _run_dir(), ["train"])


@hydra.main(config_path=".", config_name="config", version_base=None)
@_guard
def evaluate(cfg: DictConfig) -> None:
    """dflash-eval: acceptance offline and with real verification."""
    run_stages(cfg, _run_dir(), ["eval"])


@hydra.main(config_path=".", config_name="config", version_base=None)
@_guard
def pipeline(cfg: DictConfig) -> None:
    """dflash-pipeline: teacher -> train -> eval for one experiment."""
    run_stages(cfg, _run_dir(), ["teacher", "train", "eval"])

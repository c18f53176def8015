"""Shared fixtures: the REAL config composed with Hydra (experiment=tiny) and a teacher dataset built once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from dflash_pipeline.conf.schema import register

os.environ.setdefault("WANDB_MODE", "offline")
register()


def make_config(*overrides: str, return_hydra_config: bool = False):
    """Compose conf/config.yaml with experiment=tiny and the given overrides, as the console scripts do."""
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="dflash_pipeline.conf", version_base=None):
        return compose(config_name="config", overrides=["experiment=tiny", *overrides],
                       return_hydra_config=return_hydra_config)


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory) -> Path:
    """A finished tiny teacher dataset (8 samples, 2 shards, 2 turns, top-k log-probs)."""
    from dflash_pipeline.data.teacher import run_teacher

    out = tmp_path_factory.mktemp("tiny") / "teacher"
    return run_teacher(make_config(), out)


ROOT = Path(__file__).parents[1]


def user_env() -> dict:
    """The environment of the commands tests run: wandb offline, one thread per process (several processes share
    the machine)."""
    return dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1")


def run_command(cmd: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    """Run a command from the repository root as a user would; fail the test with its stderr when it fails."""
    proc = subprocess.run(cmd, cwd=ROOT, env=user_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def accelerate_launch(n: int, *module_and_args: str) -> list[str]:
    """`accelerate launch` with n CPU processes (gloo when n > 1): e.g. accelerate_launch(2, "-m", "dflash_pipeline.train", ...)."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(n), "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no", *(["--multi_gpu"] if n > 1 else []),
            *module_and_args]


def metrics(train_dir: Path) -> list[dict]:
    """The rows a training run logged to metrics.jsonl."""
    return [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines()]

"""Run logging: always a metrics.jsonl in the stage folder (what dflash-compare and tests read), plus wandb unless
logger=none. wandb runs offline unless an API key is configured, so nothing ever waits on the network."""
from __future__ import annotations

import json
import os
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def flatten(metrics: dict, prefix: str = "") -> dict:
    """{"heldout": {"a_k": [..]}} -> {"heldout/a_1": ..}: lists of per-position values become one scalar each."""
    out = {}
    for k, v in metrics.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        elif isinstance(v, (list, tuple)):
            base = key[:-2] if key.endswith("_k") else key
            out.update({f"{base}_{i + 1}": x for i, x in enumerate(v)})
        else:
            out[key] = v
    return out


def run_name(cfg: DictConfig) -> str:
    """The experiment name, plus the job's overrides when it is one job of a sweep (its folder name)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return f"{cfg.name}/{HydraConfig.get().job.override_dirname}"
    return cfg.name


class RunLogger:
    def __init__(self, cfg: DictConfig, folder: Path, job: str, enabled: bool = True):
        self.enabled = enabled
        self.file = folder / "metrics.jsonl"
        self.wandb = None
        if not enabled:
            return
        folder.mkdir(parents=True, exist_ok=True)
        if cfg.logger.kind == "wandb":
            try:
                import wandb
            except ImportError as e:
                raise RuntimeError("logger=wandb needs the wandb package: pip install wandb (or logger=none)") from e
            mode = cfg.logger.mode or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
            self.wandb = wandb.init(project=cfg.logger.project, group=cfg.logger.group or cfg.name,
                                    name=f"{run_name(cfg)}-{job}", job_type=job, dir=str(folder), mode=mode,
                                    config=OmegaConf.to_container(cfg, resolve=True), reinit="finish_previous")
        elif cfg.logger.kind != "none":
            raise ValueError(f"unknown logger.kind {cfg.logger.kind!r}; use wandb or none")

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        with open(self.file, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.wandb is not None:
            self.wandb.log(flatten(metrics), step=step)

    def finish(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()

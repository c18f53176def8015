"""Which config sections each stage depends on, and the hash that says whether a stage's output is still valid.

A stage's output folder records the hash of the config it was made with; the pipeline skips a stage whose output is
complete for the same hash, resumes an unfinished one, and refuses to mix outputs of different configs.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

# Sections that change a stage's output. Paths where outputs go, logging and loop cadence are not among them.
STAGE_SECTIONS = {
    "teacher": ["seed", "target", "data", "teacher"],
    "train": ["seed", "target", "data", "teacher", "drafter", "trainer"],
    "eval": ["seed", "target", "data", "teacher", "drafter", "trainer", "eval"],
}
IGNORED = {"out_dir", "log_every", "save_every", "resume"}


def stage_config(cfg: DictConfig, stage: str) -> dict:
    """The resolved part of the config that determines the stage's output."""
    full = OmegaConf.to_container(cfg, resolve=True)

    def strip(node):
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k not in IGNORED}
        return node

    return {k: strip(full[k]) for k in STAGE_SECTIONS[stage]}


def config_hash(cfg: DictConfig, stage: str) -> str:
    blob = json.dumps(stage_config(cfg, stage), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def stage_dir(cfg: DictConfig, stage: str, run_dir: str | Path) -> Path:
    """Where a stage writes: <run_dir>/<stage>.out_dir unless out_dir is absolute."""
    section = {"teacher": cfg.teacher, "train": cfg.trainer, "eval": cfg.eval}[stage]
    return Path(run_dir) / section.out_dir


def recorded_hash(stage: str, folder: Path) -> str | None:
    """The config hash a stage's output folder was made with (the teacher: started with); None when there is none.
    The train and eval stages write their marker last, so for them a hash also says the stage is complete."""
    marker = {"teacher": "plan.json", "train": "done.json", "eval": "eval_results.json"}[stage]
    try:
        return json.loads((folder / marker).read_text()).get("config_hash")
    except (OSError, ValueError):
        return None


def stage_dirs(cfg: DictConfig, run_dir: str | Path, shared_dir: str | Path | None = None) -> dict[str, Path]:
    """The folder of every stage for a job in `run_dir`.

    `shared_dir` is the experiment's run directory when the job is one of a sweep: the jobs then share its teacher
    dataset (generated there by the first job that needs it) and its trained drafter (when one is finished there),
    as long as that output was made with the config the job asks for. Everything else stays in the job's folder,
    so jobs that differ in a stage's config never see each other's outputs.
    """
    dirs = {stage: stage_dir(cfg, stage, run_dir) for stage in STAGE_SECTIONS}
    if shared_dir is not None:
        teacher = stage_dir(cfg, "teacher", shared_dir)
        if recorded_hash("teacher", teacher) in (None, config_hash(cfg, "teacher")):
            dirs["teacher"] = teacher
        train = stage_dir(cfg, "train", shared_dir)
        if recorded_hash("train", dirs["train"]) is None and recorded_hash("train", train) == config_hash(cfg, "train"):
            dirs["train"] = train
    if cfg.trainer.data_dir:
        dirs["teacher"] = Path(cfg.trainer.data_dir)
    return dirs

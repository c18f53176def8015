"""The run folder: where each stage writes and reads, which config sections each stage depends on, and the hash that
says whether a stage's output is still valid. Every other module asks this one for a stage's folder.

A stage's output folder records the hash of the config it was made with; the pipeline skips a stage whose output is
complete for the same hash, resumes an unfinished one, and refuses to mix outputs of different configs.

Precedence, the same for every command: trainer.data_dir (a teacher dataset made elsewhere) beats the folder a caller
resolved (a sweep's shared teacher stage), which beats the run's own <run_dir>/<teacher.out_dir>.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

TEACHER_SECTIONS = ("seed", "target", "data", "teacher")
# Keys that never change a stage's output: where outputs go, logging and held-out cadence, how many checkpoints are
# kept, how a run is continued or launched, how a producer hands features over (producer.spool, capacity, wait_s,
# launch), and training's memory and speed settings (the logits' and the packed mask's slices, per-layer
# recomputation): changing one and starting again continues the run (docs/pipeline.md, 'Restarts').
IGNORED = {"out_dir", "log_every", "save_every", "resume", "component", "spool", "capacity", "wait_s", "launch",
           "eval_every", "keep_checkpoints", "logits_chunk_mb", "attention_chunk_mb", "activation_checkpointing"}
# Left out of the training stages' hash only: the attention kernel trains the same weights, but the eval decodes and
# times with it.
TRAINING_RUNTIME = {"drafter": ("attn_implementation",)}
# The keys hashes were made without before the memory and speed settings joined IGNORED: a record that holds only
# such a hash (a marker or checkpoint written by an earlier version) still matches its config.
LEGACY_IGNORED = frozenset({"out_dir", "log_every", "save_every", "resume", "component", "spool", "capacity",
                            "wait_s", "launch"})


def component_of(stage: str) -> str:
    """The component a training stage trains: "train" is the drafter's stage, "train/<name>" another's."""
    return stage.split("/", 1)[1] if "/" in stage else "drafter"


def train_stage(component: str) -> str:
    return "train" if component == "drafter" else f"train/{component}"


def stage_sections(cfg: DictConfig, stage: str, uses: Iterable[str] | None = None) -> list[str]:
    """The config sections a stage's output depends on, by construction: its own sections plus those of every stage
    it reads (conf/catalogue.py; the eval's: those of every component its methods use, `uses`, which eval/stage.py
    eval_hash reads from the method catalogue), so a stage is never reused for a config that differs anywhere
    upstream."""
    from dflash_pipeline.conf import catalogue

    if stage == "teacher":
        return list(TEACHER_SECTIONS)
    if stage == "eval":
        if uses is None:
            raise ValueError("the eval stage's sections include those of the components its methods use: pass uses= "
                             "(eval/stage.py eval_hash)")
        parts = [stage_sections(cfg, train_stage(c)) for c in sorted(set(uses))] + [["eval"]]
    else:
        name = component_of(stage)
        parts = [stage_sections(cfg, "teacher" if i == "teacher" else "train")
                 for i in catalogue.component(name).inputs]
        parts.append(catalogue.sections(name, cfg))
    return list(dict.fromkeys(s for part in parts for s in part))


def stage_config(cfg: DictConfig, stage: str, uses: Iterable[str] | None = None, legacy: bool = False) -> dict:
    """The resolved part of the config that determines the stage's output. A training stage leaves out its sections'
    decode-only keys (conf/catalogue.py: decode_only): they shape the eval's trees, not the weights. legacy: the
    config as an earlier version hashed it (LEGACY_IGNORED)."""
    full = OmegaConf.to_container(cfg, resolve=True)
    return strip_config({k: full[k] for k in stage_sections(cfg, stage, uses)}, stage, legacy)


def strip_config(config: dict, stage: str, legacy: bool = False) -> dict:
    """A stage's sections without the keys that change none of its output (IGNORED, decode-only and runtime keys):
    applied to today's config and to the config a record holds, so both are compared under today's rules."""
    from dflash_pipeline.conf import catalogue

    drop = dict(catalogue.decode_only()) if stage.startswith("train") else {}
    if stage != "eval":  # how a recurrent target rolls back changes the eval's timing, never data or weights
        drop["target"] = drop.get("target", ()) + ("rollback",)
    if stage.startswith("train") and not legacy:
        for section, keys in TRAINING_RUNTIME.items():
            drop[section] = drop.get(section, ()) + keys
    ignored = LEGACY_IGNORED if legacy else IGNORED

    def strip(node, dropped=()):
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k not in ignored and k not in dropped}
        return node

    return {k: strip(v, drop.get(k, ())) for k, v in config.items()}


def config_hash(cfg: DictConfig, stage: str, uses: Iterable[str] | None = None, legacy: bool = False) -> str:
    """uses: the eval stage's components (stage_sections); legacy: as stage_config."""
    blob = json.dumps(stage_config(cfg, stage, uses, legacy), sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def same_config(record: dict | None, cfg: DictConfig, stage: str, uses: Iterable[str] | None = None) -> bool:
    """Whether a stage output's record (its marker, or a checkpoint's step.json) was made with this config: the config
    it recorded equals today's under today's rules, or, where it recorded a hash alone, that hash is today's or the
    one an earlier version computed for this config (LEGACY_IGNORED)."""
    if not record:
        return False
    if isinstance(record.get("config"), dict):
        return strip_config(record["config"], stage) == stage_config(cfg, stage, uses)
    return record.get("config_hash") in (config_hash(cfg, stage, uses), config_hash(cfg, stage, uses, legacy=True))


def config_diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested config dicts."""
    keys = sorted(set(old) | set(new))
    out = []
    for k in keys:
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_diff(a, b, f"{prefix}{k}.")
        elif a != b:  # a config choice (an Enum of str) shown as its plain value, as the stored config has it
            out.append(f"{prefix}{k}: {getattr(a, 'value', a)!r} -> {getattr(b, 'value', b)!r}")
    return out


def differences(record: dict, cfg: DictConfig, stage: str, uses: Iterable[str] | None = None, most: int = 5) -> str:
    """What differs between the config a record was made with and this one, for a one-line refusal: the first
    `most` differing keys, or the recorded hash where the record holds no config."""
    if isinstance(record.get("config"), dict):
        diff = config_diff(strip_config(record["config"], stage), stage_config(cfg, stage, uses))
        if diff:
            return "; ".join(diff[:most]) + (f"; and {len(diff) - most} more" if len(diff) > most else "")
    return f"config hash {record.get('config_hash')}, now {config_hash(cfg, stage, uses)}"


SUPERSEDED = "superseded"  # inside a stage folder: the outputs of earlier configs, each in a folder of its own


def set_aside(folder: str | Path, record: dict) -> Path:
    """Move everything a stage's folder holds (but earlier set-asides) to <folder>/superseded/<its config hash>/: the
    outputs of another config are kept, never deleted, when a cheap stage (a component, the eval) is made again."""
    folder = Path(folder)
    dest = folder / SUPERSEDED / str(record.get("config_hash") or "unknown")
    n = 1
    while dest.exists():
        n += 1
        dest = dest.with_name(f"{dest.name.split('.')[0]}.{n}")
    dest.mkdir(parents=True)
    for entry in sorted(folder.iterdir()):
        if entry.name != SUPERSEDED:
            entry.rename(dest / entry.name)
    return dest


EXPORT = "export"  # a training stage's exported model, in its folder: what engines and later stages load


def stage_dir(cfg: DictConfig, stage: str, run_dir: str | Path) -> Path:
    """Where a stage writes: <run_dir>/<section>.out_dir unless out_dir is absolute; a component trained on a frozen
    drafter writes in <drafter's folder>/<component>."""
    if stage.startswith("train/"):
        return stage_dir(cfg, "train", run_dir) / component_of(stage)
    section = {"teacher": cfg.teacher, "train": cfg.trainer, "eval": cfg.eval}[stage]
    return Path(run_dir) / section.out_dir


def run_dir_of(stage: str, folder: str | Path) -> Path:
    """The run folder a stage's folder belongs to: the inverse of stage_dir for a one-level out_dir (the drafter's
    train/, a component's train/<component>/, eval/)."""
    return Path(folder).parent.parent if stage.startswith("train/") else Path(folder).parent


def given_teacher(cfg: DictConfig) -> Path | None:
    """The teacher dataset trainer.data_dir names (made elsewhere: no teacher stage runs); None when the run makes
    its own."""
    return Path(cfg.trainer.data_dir) if cfg.trainer.data_dir else None


def teacher_dir(cfg: DictConfig, run_dir: str | Path, resolved: str | Path | None = None) -> Path:
    """The teacher dataset the stages of `run_dir` read: trainer.data_dir, else `resolved` (the folder the pipeline
    chose: stage_dirs), else the run's own teacher stage."""
    return given_teacher(cfg) or Path(resolved or stage_dir(cfg, "teacher", run_dir))


def export_dir(stage_folder: str | Path) -> Path:
    """A training stage's export."""
    return Path(stage_folder) / EXPORT


def stage_of_export(export: str | Path) -> Path:
    """The training stage folder an export sits in (the inverse of export_dir)."""
    return Path(export).parent


def component_export(component: str, train_dir: str | Path, component_dirs: dict[str, Path] | None = None) -> Path:
    """A component's export: its stage's (component_dirs: the pipeline's resolved folders), else the one under the
    drafter's stage, <train_dir>/<component>/export (a component on a frozen drafter; a selector trained jointly)."""
    return export_dir((component_dirs or {}).get(component, Path(train_dir) / component))


def evaluated_drafter(cfg: DictConfig, train_dir: str | Path) -> Path:
    """The exported drafter the eval stage reads: eval.drafter_dir, else the train stage's export."""
    return Path(cfg.eval.drafter_dir) if cfg.eval.drafter_dir else export_dir(train_dir)


def frozen_drafter(section: DictConfig, stage_folder: str | Path, resolved: str | Path | None = None) -> Path:
    """The exported drafter a component trains on: its section's drafter_dir, else `resolved` (the pipeline's
    drafter stage), else the export of the drafter stage its folder sits in (train/<component>/ -> train/export)."""
    return Path(section.get("drafter_dir") or resolved or export_dir(Path(stage_folder).parent))


def spool_dir(cfg: DictConfig, run_dir: str | Path) -> Path:
    """Where a feature producer hands the drafter stage its features (trainer.features=producer): producer.spool,
    relative to the run folder unless absolute."""
    return Path(run_dir) / cfg.producer.spool


def recorded_stage_dir(run_folder: str | Path, stage: str) -> Path:
    """A finished run's stage folder as that run placed it: by the config it recorded (<run>/.hydra/config.yaml),
    else by the default names (dflash-compare and the scripts read runs of any config)."""
    from dflash_pipeline.conf.schema import EvalConfig, TeacherConfig, TrainerConfig

    section, default = {"teacher": ("teacher", TeacherConfig.out_dir), "train": ("trainer", TrainerConfig.out_dir),
                        "eval": ("eval", EvalConfig.out_dir)}[stage]
    recorded = Path(run_folder) / ".hydra" / "config.yaml"
    out = OmegaConf.select(OmegaConf.load(recorded), f"{section}.out_dir") if recorded.is_file() else None
    return Path(run_folder) / (out or default)


MARKERS = {"teacher": "plan.json", "eval": "eval_results.json"}  # a training stage's: done.json


def marker(stage: str, folder: str | Path) -> Path:
    """The file in a stage's folder that records its config hash: the teacher's plan (written when it starts), a
    training stage's done.json and the eval's results (written last: they also say the stage is complete)."""
    return Path(folder) / MARKERS.get(stage.split("/")[0], "done.json")


def recorded(stage: str, folder: str | Path) -> dict | None:
    """The record of the config a stage's output folder was made with (its marker: the teacher's plan, written when
    it starts; a training stage's done.json and the eval's results, written last, so for them a record also says the
    stage is complete); None when there is none."""
    try:
        return json.loads(marker(stage, folder).read_text())
    except (OSError, ValueError):
        return None


def stage_dirs(cfg: DictConfig, run_dir: str | Path, shared_dir: str | Path | None = None,
               components: tuple[str, ...] = ()) -> dict[str, Path]:
    """The folder of every stage for a job in `run_dir`: teacher, train (the drafter), train/<c> for each of
    `components` trained on a frozen drafter, eval.

    `shared_dir` is the experiment's run directory when the job is one of a sweep: the jobs then share its teacher
    dataset (generated there by the first job that needs it) and its trained drafter and components (when finished
    there), as long as that output was made with the config the job asks for. Everything else stays in the job's folder,
    so jobs that differ in a stage's config never see each other's outputs.
    """
    stages = ["teacher", "train", *[train_stage(c) for c in components], "eval"]
    dirs = {stage: stage_dir(cfg, stage, run_dir) for stage in stages}
    if shared_dir is not None:
        teacher = stage_dir(cfg, "teacher", shared_dir)
        record = recorded("teacher", teacher)
        if record is None or same_config(record, cfg, "teacher"):
            dirs["teacher"] = teacher
        for stage in stages[1:-1]:  # a trained stage finished there with this very config
            theirs = stage_dir(cfg, stage, shared_dir)
            if recorded(stage, dirs[stage]) is None and same_config(recorded(stage, theirs), cfg, stage):
                dirs[stage] = theirs
    dirs["teacher"] = teacher_dir(cfg, run_dir, dirs["teacher"])
    return dirs

"""Console scripts: each is a Hydra app over conf/config.yaml that composes the config and calls one stage.

Every stage writes under the Hydra run directory (runs/<name> by default; `hydra.run.dir=...` moves it), so a stage
finds the output of the one before it without extra arguments.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from dflash_pipeline.conf.schema import register

register()
log = logging.getLogger("dflash")

def measurement_parser(doc: str, *, prompts: int, threads: int, max_new_tokens: int = 96) -> argparse.ArgumentParser:
    """The command line the measurement scripts share (scripts/bench_*.py, scripts/profile_round.py): prompts, reply
    length, torch threads, and Hydra overrides naming the run; a script adds its own options."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=prompts)
    ap.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    ap.add_argument("--threads", type=int, default=threads, help="torch threads (median timings are per thread count)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides: experiment=... hydra.run.dir=<run folder>")
    return ap


def compose_run(overrides: list[str]) -> DictConfig:
    """The config the console scripts compose from these overrides, hydra's own settings (the run folder) included."""
    from hydra import compose, initialize_config_module

    register()
    with initialize_config_module(config_module="dflash_pipeline.conf", version_base=None):
        return compose("config", overrides=overrides, return_hydra_config=True)


def _user_errors() -> tuple[type[Exception], ...]:
    """Errors that come from bad input: shown as one line, not a traceback."""
    from dflash_pipeline.conf.schema import ConfigError
    from dflash_pipeline.data.shards import DatasetError
    from dflash_pipeline.data.sources import DataSourceError
    from dflash_pipeline.models.errors import TargetError
    from dflash_pipeline.eval.errors import EvalError
    from dflash_pipeline.train.loop import TrainError
    from dflash_pipeline.models.llamacpp_engine import LlamaCppError
    from dflash_pipeline.models.vllm_engine import VLLMError

    return (ConfigError, DatasetError, DataSourceError, TargetError, TrainError, EvalError, VLLMError, LlamaCppError)


def _job_dirs() -> tuple[Path, Path | None]:
    """(this job's run directory, the experiment's run directory when the job is one of a sweep)."""
    hc = HydraConfig.get()
    shared = Path(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None
    return Path(hc.runtime.output_dir), shared


def _guard(fn):
    """Run a stage; a user error becomes one line on stderr and exit status 2. Returns the job's objective (for
    sweepers such as Optuna), and leaves accelerate's per-process state clean for the next job of a sweep."""

    def wrapped(cfg: DictConfig):
        _export_slurm_distributed_env()
        try:
            return fn(cfg)
        except _user_errors() as e:
            _report(e)
            sys.exit(2)
        finally:
            _reset_accelerate()

    wrapped.__name__ = fn.__name__
    wrapped.__doc__ = fn.__doc__
    return wrapped


def _report(error: Exception) -> None:
    """One line on stderr, and the same line in the job's log file (not on the console: it would show twice)."""
    print(f"error: {error}", file=sys.stderr)
    record = log.makeRecord(log.name, logging.ERROR, __file__, 0, "%s", (error,), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _reset_accelerate() -> None:
    """A sweep runs its jobs in one process: forget this job's mixed precision etc., keep the process group."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def _export_slurm_distributed_env() -> None:
    """Under the submitit launcher with several tasks per job, give torch.distributed (and so accelerate) the
    RANK / WORLD_SIZE / MASTER_ADDR it reads; SLURM only sets its own variables."""
    import os

    if "SUBMITIT_EXECUTOR" not in os.environ or "RANK" in os.environ:
        return
    import submitit
    from submitit.helpers import TorchDistributedEnvironment

    if submitit.JobEnvironment().num_tasks > 1:  # accelerate picks cuda:LOCAL_RANK, so keep all GPUs visible
        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def run_stages(cfg: DictConfig, run_dir: Path, stages: list[str], shared_dir: Path | None = None) -> dict[str, Path]:
    """Run the named stages in order; each skips itself when its output exists for the same config.

    shared_dir: the experiment's run directory when this is a job of a sweep (see runtime.stages.stage_dirs).
    """
    from dflash_pipeline.runtime.stages import export_dir, stage_dirs, train_stage
    from dflash_pipeline.train.loop import run_train

    components = _trained_components(cfg, stages)
    _refuse_before_running(cfg, stages, components)
    dirs = stage_dirs(cfg, run_dir, shared_dir, tuple(dict.fromkeys(components)))
    outputs = {}

    def train(name: str) -> None:
        stage = train_stage(name)
        with _measured(stage):
            run_train(cfg, dirs[stage], data_dir=dirs["teacher"], component=name,
                      drafter_dir=None if name == "drafter" else export_dir(dirs["train"]))
        if cfg.export.gguf:
            export_gguf(cfg, name, dirs[stage])
        outputs[stage] = dirs[stage]

    for stage in stages:
        # "components" logs one line per component it trains (train()); every other stage one line here
        with nullcontext() if stage in ("train", "components") else _measured(stage):
            _run_stage(cfg, stage, dirs, shared_dir, train)
        if stage in dirs:
            outputs[stage] = dirs[stage]
    return outputs


def _trained_components(cfg: DictConfig, stages: list[str]) -> list[str]:
    """The components the stages train on a frozen drafter, whose folders stage_dirs names: each of
    pipeline.components ("components" trains the drafter, then these), and trainer.component when "train" trains one
    other than the drafter (dflash-train)."""
    components = [str(c) for c in cfg.pipeline.components]
    if "train" in stages and str(cfg.trainer.component) != "drafter":
        components.append(str(cfg.trainer.component))
    return components


def _refuse_before_running(cfg: DictConfig, stages: list[str], components: list[str]) -> None:
    """Settings the stages cannot run with, refused in one line before the teacher or training runs: a selector
    trained both jointly with the drafter and on its own, an eval's unknown methods or unservable setup, and an
    export.gguf that llama.cpp's converter cannot write."""
    if cfg.trainer.selector_loss_weight > 0 and "selector" in components:
        from dflash_pipeline.conf.schema import ConfigError

        raise ConfigError("trainer.selector_loss_weight > 0 trains the selector with the drafter (DFlash2 joint); "
                          "drop selector from pipeline.components, or set the weight to 0 for a frozen-drafter one")
    if "eval" in stages:
        from dflash_pipeline.eval.methods import check_names
        from dflash_pipeline.eval.stage import check_served

        check_names(cfg.eval.methods)
        check_served(cfg)
    if cfg.export.gguf and ("train" in stages or "components" in stages):
        check_gguf_export(cfg)


def _run_stage(cfg: DictConfig, stage: str, dirs: dict[str, Path], shared_dir: Path | None, train) -> None:
    """One stage in its folder of `dirs`; `train(name)` trains one component (run_stages' closure, which also records
    the component's output)."""
    from dflash_pipeline.runtime.stages import given_teacher
    from dflash_pipeline.data.teacher import run_teacher
    from dflash_pipeline.eval.stage import run_eval

    if stage == "teacher" and given_teacher(cfg):
        log.info("teacher: using the dataset given by trainer.data_dir=%s", given_teacher(cfg))
    elif stage == "teacher" and shared_dir is not None:
        with _sweep_lock(dirs["teacher"]):  # parallel jobs of a sweep: one generates, the others then skip
            run_teacher(cfg, dirs["teacher"])
    elif stage == "teacher":
        run_teacher(cfg, dirs["teacher"])
    elif stage == "train":
        train(str(cfg.trainer.component))
    elif stage == "components":
        for name in ["drafter", *[str(c) for c in cfg.pipeline.components]]:
            train(name)
    elif stage == "producer":  # the drafter stage's features, for trainer.features=producer (its run folder)
        from dflash_pipeline.data.producer import run_producer
        from dflash_pipeline.runtime.stages import run_dir_of

        run_producer(cfg, run_dir_of("train", dirs["train"]), dirs["teacher"])
    elif stage == "eval":
        run_eval(cfg, dirs["eval"], teacher_dir=dirs["teacher"], train_dir=dirs["train"],
                 component_dirs={k.split("/", 1)[1]: v for k, v in dirs.items() if k.startswith("train/")})
    else:
        raise ValueError(f"unknown stage {stage!r}")


def check_gguf_export(cfg: DictConfig) -> None:
    """What export.gguf needs, refused in one line before any stage runs: a drafter over the whole vocabulary
    (llama.cpp's converter maps no draft vocabulary for DFlash drafters), a target folder on this machine (the
    converter reads it) and llama.cpp's build."""
    from dflash_pipeline.models.llamacpp_engine import LlamaCppError, draft_vocabulary_refused, paths

    if cfg.trainer.draft_vocab_size is not None:
        raise LlamaCppError("export.gguf: " + draft_vocabulary_refused("the drafter", cfg.trainer.draft_vocab_size))
    if str(cfg.target.kind) == "hf" and not Path(str(cfg.target.path)).expanduser().is_dir():
        raise LlamaCppError(f"export.gguf converts the target's folder, and target.path={cfg.target.path} is not a "
                            "folder here: download it first (huggingface-cli download ... --local-dir DIR) and set "
                            "target.path=DIR")
    paths(cfg.cache_dir)


def export_gguf(cfg: DictConfig, component: str, stage_dir: Path) -> None:
    """export.gguf after a training stage, by the main process: the drafter's export and a DFlash2 selector's (the
    drafter stage's own when trained jointly, else the selector stage's) as GGUF files llama.cpp serves
    (models/llamacpp_engine.py write_gguf); llama.cpp runs no other component."""
    import torch
    from accelerate import PartialState

    from dflash_pipeline.models import llamacpp_engine
    from dflash_pipeline.models.target_sources import gguf_source, target_folder
    from dflash_pipeline.runtime.stages import component_export, export_dir

    joint = cfg.trainer.selector_loss_weight > 0
    folders = {"drafter": [export_dir(stage_dir), *([component_export("selector", stage_dir)] if joint else [])],
               "selector": [export_dir(stage_dir)]}.get(component)
    if folders is None:
        log.info("export.gguf: llama.cpp serves DFlash and DFlash2 drafters, not a %s: no GGUF for it", component)
        return
    state = PartialState(cpu=not torch.cuda.is_available())  # as data/teacher.py
    if state.is_main_process:
        target_dir = target_folder(cfg.target, cfg.cache_dir)
        source = gguf_source(cfg.target.path, cfg.target.gguf_file) if str(cfg.target.kind) == "gguf" else None
        for folder in folders:
            out = llamacpp_engine.write_gguf(cfg.cache_dir, folder, target_dir, [str(t) for t in cfg.export.gguf],
                                             source)
            log.info("export.gguf: %s (llama-server command in %s)", out, out / "serve.json")
    state.wait_for_everyone()


@contextmanager
def _measured(stage: str):
    """Log `<stage>: done in 123 s, peak 2.1 GB resident` when the stage returns: its own peak (runtime/memory.py),
    so a job's maximum RSS (GNU time's) can be traced to the stage that set it."""
    import time

    from dflash_pipeline.runtime.memory import StagePeak

    start = time.monotonic()
    with StagePeak() as peak:
        yield
    log.info("%s: done in %.0f s, %s", stage, time.monotonic() - start, peak.text())


@contextmanager
def _sweep_lock(folder: Path):
    """An exclusive file lock next to `folder`, held by the main process of the job only (its other processes
    wait at the barrier, so that all of them look at the folder after the lock holder does)."""
    import torch
    from accelerate import PartialState
    from filelock import FileLock

    state = PartialState(cpu=not torch.cuda.is_available())  # as data/teacher.py
    if state.is_main_process:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(folder) + ".lock"):
            state.wait_for_everyone()
            yield
            state.wait_for_everyone()
    else:
        state.wait_for_everyone()
        yield
        state.wait_for_everyone()


def objective(outputs: dict[str, Path]) -> float | None:
    """What a sweeper optimises: the held-out simulated tau (tau_offline on held-out teacher sequences), from the
    eval stage when it ran, else from the training run's last held-out evaluation (as dflash-compare reads it)."""
    from dflash_pipeline.eval.compare import read_stages

    return read_stages(outputs.get("eval"), outputs.get("train")).heldout_tau


def _run(cfg: DictConfig, stages: list[str]) -> float | None:
    run_dir, shared = _job_dirs()
    return objective(run_stages(cfg, run_dir, stages, shared))


def _command(name: str, stages: list[str], doc: str):
    """A console script: the Hydra app over conf/config.yaml that runs `stages`, known to Hydra (its --help, its job
    log file `<name>.log`) by the command's own name rather than this module's."""

    @hydra.main(config_path="pkg://dflash_pipeline.conf", config_name="config", version_base=None)
    @_guard
    def app(cfg: DictConfig) -> float | None:
        return _run(cfg, stages)

    def main() -> float | None:
        os.environ["DFLASH_COMMAND"] = name  # read by conf/config.yaml: hydra.job.name
        return app()

    main.__name__, main.__doc__ = name.replace("-", "_"), f"{name}: {doc}"
    return main


teacher = _command("dflash-teacher", ["teacher"], "regenerate replies with the target and store its features.")
train = _command("dflash-train", ["train"], "train a component on the teacher dataset.")
evaluate = _command("dflash-eval", ["eval"], "acceptance offline and with real verification.")
producer = _command("dflash-producer", ["producer"],
                    "compute the drafter's features in an engine and spool them to a trainer (trainer.features=producer).")
pipeline = _command("dflash-pipeline", ["teacher", "components", "eval"],
                    "teacher -> drafter -> pipeline.components -> eval for one experiment.")

"""The one training loop. A component (COMPONENTS below; its configuration in conf/catalogue.py) brings its model,
its batches, its loss and its metrics (the `train.component.TrainingComponent` protocol); the loop owns accelerate,
the optimizer and schedule, checkpoints, resume, logging, progress and the export call, and reads nothing of a
component's batches or metrics.

Determinism: the sequences and anchors of step s are a function of (seed, s) and of nothing else, and each
process takes its slice of the same global batch; the loss is normalised by the global normaliser. So a resumed
run repeats the losses of an uninterrupted one, and N processes follow the loss curve of one.
"""
from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from omegaconf import DictConfig

from dflash_pipeline.runtime.progress import Progress
from dflash_pipeline.conf.schema import check_config
from dflash_pipeline.runtime.stages import (config_hash, differences, export_dir, frozen_drafter, marker, recorded,
                                            run_dir_of, same_config, set_aside, stage_config, teacher_dir,
                                            train_stage)
from dflash_pipeline.runtime.files import follow_umask
from dflash_pipeline.data.splits import split_points
from dflash_pipeline.conf import catalogue
from dflash_pipeline.train.component import StageInputs, TrainingComponent
from dflash_pipeline.train.drafter import DrafterComponent
from dflash_pipeline.train.jump import JumpComponent
from dflash_pipeline.train.jump_head import JumpHeadComponent
from dflash_pipeline.train.selector import SelectorComponent
from dflash_pipeline.train.weaver import WeaverComponent
from dflash_pipeline.train.errors import TrainError
from dflash_pipeline.train.parallel import Accelerated, Sharded, fsdp_requested
from dflash_pipeline.runtime.logger import RunLogger

log = logging.getLogger(__name__)

# The training code of every component of conf/catalogue.py (tests/test_components.py checks both name the same).
COMPONENTS: dict[str, type] = {"drafter": DrafterComponent, "selector": SelectorComponent, "jump": JumpComponent,
                               "jump_head": JumpHeadComponent, "weaver": WeaverComponent}


def lr_lambda(step: int, warmup: int, total: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def autocast_dtype(device: torch.device) -> str:
    """The dtype the forward runs in under the current autocast context ("float32" when autocast is off)."""
    if not torch.is_autocast_enabled(device.type):
        return "float32"
    return str(torch.get_autocast_dtype(device.type)).removeprefix("torch.")


def loop_settings_of(cfg: DictConfig, name: str) -> DictConfig:
    """The loop settings of a component: trainer.*, overridden by its own section's values of the same name."""
    from dflash_pipeline.train.component import loop_settings

    return loop_settings(cfg, cfg.get(name) if catalogue.component(name).config is not None else None)


def brief(metrics: dict) -> str:
    """A log line's worth of metrics: scalars, and the first three entries of per-position lists."""
    parts = []
    for k, v in metrics.items():
        if isinstance(v, float):
            parts.append(f"{k} {v:.3g}")
        elif isinstance(v, list) and v and isinstance(v[0], float):
            parts.append(f"{k} {[round(x, 3) for x in v[:3]]}")
    return ", ".join(parts)


def checkpoints(folder: Path) -> list[Path]:
    """Completed checkpoints, oldest first (a checkpoint is complete once its step.json exists)."""
    return sorted(p for p in folder.glob("step-*") if (p / "step.json").is_file())


@dataclass
class Stage:
    """What a training stage is about to do: which component, on which inputs, under which config hash and loop
    settings, in which folder."""

    name: str
    out: Path
    inputs: StageInputs
    digest: str
    settings: DictConfig
    config: dict  # the stage's part of the config (runtime/stages.py stage_config), recorded beside its hash

    @property
    def record(self) -> dict:
        """What done.json and every checkpoint's step.json record of the config, for a restart to compare."""
        return {"config_hash": self.digest, "config": self.config}

    @property
    def label(self) -> str:  # what the bar and log lines are called
        return "train" if self.name == "drafter" else f"train {self.name}"


def plan_stage(cfg: DictConfig, out: Path, data_dir: Path | None, name: str, drafter_dir: Path | None
               ) -> Stage | None:
    """The stage to run in `out`, or None when it is already complete for this config. What an earlier run of another
    config left there (a finished run, or a killed one's checkpoints) is never deleted: the drafter's is refused in
    one line naming the differing keys (trainer.resume=true continues it), a component's (cheap, and a function of
    the drafter) is moved aside to <out>/superseded/<its hash>/ and the component trained again."""
    entry = catalogue.component(name)
    own = cfg.get(name) if entry.config is not None else None
    stage = train_stage(name)
    run_dir = run_dir_of(stage, out)
    inputs = StageInputs(teacher=teacher_dir(cfg, run_dir, data_dir), run_dir=run_dir)
    if entry.on_frozen_drafter:
        inputs.drafter = frozen_drafter(own, out, drafter_dir)
        if not (inputs.drafter / "config.json").is_file():
            raise TrainError(f"{name} trains on a frozen drafter, and there is no exported drafter at "
                             f"{inputs.drafter}: run dflash-train (the drafter) first or set {name}.drafter_dir")
    digest, t = config_hash(cfg, stage), loop_settings_of(cfg, name)
    finished = recorded(stage, out)
    if same_config(finished, cfg, stage) and not t.resume:
        log.info("%s: training already complete at %s (config %s): skipping", name, out, digest)
        return None
    last = next(reversed(checkpoints(out / "checkpoints")), None)
    earlier = finished or (step_record(last) if last is not None else None)
    if earlier is not None and not same_config(earlier, cfg, stage) and not t.resume:
        what = "a finished run" if finished else f"checkpoints (to step {step_record(last)['step']})"
        if not entry.on_frozen_drafter:
            raise TrainError(f"{out} holds {what} of another config ({differences(earlier, cfg, stage)}): set "
                             "trainer.resume=true to continue it with this config, or choose another hydra.run.dir")
        kept = set_aside(out, earlier)
        log.warning("%s held %s of another config (%s): moved to %s; training %s for config %s", out, what,
                    differences(earlier, cfg, stage), kept, name, digest)
    return Stage(name, out, inputs, digest, t, stage_config(cfg, stage))


def step_record(checkpoint: Path) -> dict:
    """A checkpoint's step.json: its step and the config it was saved under (config_hash, config)."""
    return json.loads((checkpoint / "step.json").read_text())


def make_accelerator(stage: Stage) -> Accelerator:
    """Accelerate as the launcher set it up (processes, mixed precision), checked against what the loop supports."""
    t = stage.settings
    # step_scheduler_with_optimizer=False: our schedule counts optimizer steps, whatever the number of processes.
    # mixed_precision None leaves the choice to the launcher (accelerate launch's flag or config file).
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # one INFO line per saved file otherwise
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), step_scheduler_with_optimizer=False,
                              mixed_precision=None if t.mixed_precision is None else str(t.mixed_precision))
    world = accelerator.num_processes
    log.info("%s: %d process(es) (%s), device %s, mixed precision %s", stage.label, world,
             "FSDP" if fsdp_requested(accelerator) else accelerator.distributed_type.value, accelerator.device,
             accelerator.mixed_precision)
    if t.batch_sequences % (world * t.grad_accum):
        raise TrainError(f"batch_sequences={t.batch_sequences} must be divisible by processes x grad_accum "
                         f"= {world} x {t.grad_accum}")
    return accelerator


def resume(accelerator: Accelerator, stage: Stage, parallel) -> int:
    """The step to start from: a checkpoint of this very config (a killed run started again, whatever memory or speed
    setting changed) is always continued, as batches are a function of (seed, step) and this equals the
    uninterrupted run; trainer.resume=true also continues another config's (plan_stage refused or set aside any
    other). A resumed run drops the metrics logged after its checkpoint; a fresh one starts its metrics anew."""
    out, ckpt_dir = stage.out, stage.out / "checkpoints"
    start = 0
    last = next(reversed(checkpoints(ckpt_dir)), None)
    if last is not None:
        parallel.load(last)
        start = step_record(last)["step"]
        log.info("resumed from %s at step %d", last, start)
    if accelerator.is_main_process and (out / "metrics.jsonl").is_file():
        lines = (out / "metrics.jsonl").read_text().splitlines()
        (out / "metrics.jsonl").write_text("".join(l + "\n" for l in lines if json.loads(l)["step"] <= start))
    accelerator.wait_for_everyone()
    return start


def run_train(cfg: DictConfig, out: Path, data_dir: Path | None = None, component: str | None = None,
              drafter_dir: Path | None = None) -> Path:
    """Train `component` (default: trainer.component) in stage folder `out`; returns `out` (export/ inside).

    data_dir: the teacher dataset (default: trainer.data_dir, else the run's teacher stage). drafter_dir: the
    run's drafter export that a component trained on a frozen drafter reads (<component>.drafter_dir, when set, wins;
    default: the drafter stage that holds `out`)."""
    check_config(cfg)
    name = str(component or cfg.trainer.component)
    stage = plan_stage(cfg, out, data_dir, name, drafter_dir)
    if stage is None:
        return out
    t = stage.settings
    accelerator = make_accelerator(stage)
    torch.manual_seed(cfg.seed)
    comp: TrainingComponent = COMPONENTS[name](cfg, stage.inputs, accelerator.device)

    def make_optimizer(params):
        optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))
        return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(s, t.warmup_steps, t.steps))

    if fsdp_requested(accelerator):  # the drafter sharded; a component on a frozen drafter replicated
        sharded = not catalogue.component(name).on_frozen_drafter
        parallel = Sharded(comp.model, make_optimizer, accelerator, sharded=sharded)
    else:
        parallel = Accelerated(comp.model, make_optimizer, accelerator)
    start = resume(accelerator, stage, parallel)
    logger = RunLogger(cfg, out, "train" if name == "drafter" else f"train-{name}", enabled=accelerator.is_main_process,
                       resume=start > 0)
    try:
        train_steps(accelerator, stage, comp, parallel, logger, start)
    finally:
        comp.close()  # what the component started (a feature producer) stops with it
    with parallel.unsharded() as trained:
        if accelerator.is_main_process:
            comp.export(trained, export_dir(out))
            done = {**stage.record, "steps": t.steps}
            marker(train_stage(name), out).write_text(json.dumps(done))
            log.info("exported the trained %s to %s", name, export_dir(out))
    accelerator.wait_for_everyone()
    logger.finish()
    return out


def train_steps(accelerator: Accelerator, stage: Stage, comp: TrainingComponent, parallel, logger: RunLogger,
                start: int) -> None:
    """Steps start .. settings.steps: each process takes its slice of the step's global batch in grad_accum
    micro-batches; logging, held-out evaluation and checkpoints at their cadence."""
    t, world, rank = stage.settings, accelerator.num_processes, accelerator.process_index
    model, optimizer, scheduler = parallel.model, parallel.optimizer, parallel.scheduler
    params = [p for p in model.parameters() if p.requires_grad]
    prefix = "" if stage.name == "drafter" else f"{stage.name} "
    parts = world * t.grad_accum  # micro-batches of a step over all processes
    model.train()
    clock, seen = time.perf_counter(), {}
    bar = Progress(stage.label, t.steps, "step", initial=start, enabled=accelerator.is_main_process)
    for step in range(start, t.steps):
        items = comp.step_items(step)
        runs = split_points(comp.item_sizes(items), parts)[rank * t.grad_accum: (rank + 1) * t.grad_accum]
        # a token-budget step may hold fewer sequences than micro-batches: an empty one runs the step's first
        # sequence at weight 0, so every process takes part in the gradient's reduction and adds nothing to it
        batches = [(comp.batch(items[a:b], step, a), 1.0) if b > a else (comp.batch(items[:1], step, 0), 0.0)
                   for a, b in runs]
        norm = accelerator.reduce(torch.tensor(sum(comp.normaliser(b) * w for b, w in batches),
                                               device=accelerator.device), "sum").item()
        loss_total, step_stats = 0.0, []
        for m, (batch, weight) in enumerate(batches):
            with parallel.sync(last=m == len(batches) - 1), accelerator.autocast():
                autocast = autocast_dtype(accelerator.device)
                loss_sum, stats = comp.loss(model, batch)
                # DDP averages gradients over processes; scaling by world makes the result sum / global norm.
                accelerator.backward(loss_sum * (weight * world / max(norm, 1e-9)))
            if weight:
                loss_total += loss_sum.item()
                step_stats.append(stats)
                for unit, n in comp.work(batch).items():
                    seen[unit] = seen.get(unit, 0) + n * world
        grad_norm = parallel.clip(params, t.grad_clip) if t.grad_clip > 0 else 0.0
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss = accelerator.reduce(torch.tensor(loss_total, device=accelerator.device), "sum").item() / max(norm, 1e-9)
        bar.update()

        metrics = {"loss": loss}
        if (step + 1) % t.log_every == 0 or step + 1 == t.steps:
            elapsed = time.perf_counter() - clock
            own_metrics = comp.train_metrics(step_stats) if step_stats else {}  # a process of empty runs: none
            rates = {f"{unit}_per_s": n / elapsed for unit, n in seen.items()}
            metrics.update({"lr": scheduler.get_last_lr()[0], "grad_norm": float(grad_norm), "autocast": autocast,
                            **own_metrics, **rates})
            clock, seen = time.perf_counter(), {}
            log.info("%sstep %d/%d loss %.4f lr %.2e grad %.2f %s, ETA %s", prefix, step + 1, t.steps, loss,
                     metrics["lr"], metrics["grad_norm"], brief({**own_metrics, **rates}), bar.eta_text())
        if (step + 1) % t.eval_every == 0 or step + 1 == t.steps:
            with parallel.unsharded() as trained:
                if accelerator.is_main_process:
                    metrics["heldout"] = comp.evaluate(trained)
                    log.info("%sheld-out %s", prefix, brief(metrics["heldout"]))
            clock = time.perf_counter()
        logger.log(metrics, step + 1)
        if (step + 1) % t.save_every == 0 or step + 1 == t.steps:
            save_checkpoint(accelerator, parallel, stage.out / "checkpoints", step + 1, t.keep_checkpoints,
                            stage.record)
            if accelerator.is_main_process:
                comp.checkpointed(step + 1)  # e.g. a feature producer may drop the steps before it
    bar.close()


def save_checkpoint(accelerator: Accelerator, parallel, folder: Path, step: int, keep: int, record: dict) -> None:
    """Model, optimizer and scheduler states (train/parallel.py: via accelerate, or full states under FSDP);
    step.json written last marks it complete."""
    path = folder / f"step-{step:07d}"
    parallel.save(path)
    accelerator.wait_for_everyone()  # every process's files are written before their modes are set
    if accelerator.is_main_process:
        follow_umask(path)
        (path / "step.json").write_text(json.dumps({"step": step, **record}))
        for old in checkpoints(folder)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()

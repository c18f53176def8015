"""The one training loop. A component (train/drafter.py, later the selector, jump heads and Weaver) brings its
model, its batches and its loss; the loop owns accelerate, the optimizer and schedule, checkpoints, resume,
logging and export.

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
from contextlib import nullcontext
from pathlib import Path

import torch
from accelerate import Accelerator, DistributedType
from omegaconf import DictConfig

from dflash_pipeline.conf.progress import Progress
from dflash_pipeline.conf.schema import check_config
from dflash_pipeline.conf.stages import config_hash, recorded_hash
from dflash_pipeline.data.files import follow_umask
from dflash_pipeline.eval.metrics import conditional_acceptance
from dflash_pipeline.train.errors import TrainError
from dflash_pipeline.train.logger import RunLogger

log = logging.getLogger(__name__)


def components() -> dict:
    from dflash_pipeline.train.drafter import DrafterComponent

    return {"drafter": DrafterComponent}


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


def checkpoints(folder: Path) -> list[Path]:
    """Completed checkpoints, oldest first (a checkpoint is complete once its step.json exists)."""
    return sorted(p for p in folder.glob("step-*") if (p / "step.json").is_file())


def run_train(cfg: DictConfig, out: Path, data_dir: Path | None = None) -> Path:
    """Train cfg.trainer.component on the teacher dataset; returns the stage folder (export/ inside)."""
    check_config(cfg)
    t = cfg.trainer
    registry = components()
    if t.component not in registry:
        raise TrainError(f"unknown trainer.component {t.component!r}; available: {', '.join(sorted(registry))}")
    digest, finished = config_hash(cfg, "train"), recorded_hash("train", out)
    if finished == digest and not t.resume:
        log.info("training already complete at %s (config %s): skipping", out, digest)
        return out
    if finished is not None and finished != digest and not t.resume:
        raise TrainError(f"{out} holds a finished run of a different config; choose another hydra.run.dir / name, "
                         "or set trainer.resume=true to continue from its last checkpoint (e.g. to train longer)")

    # step_scheduler_with_optimizer=False: our schedule counts optimizer steps, whatever the number of processes.
    # mixed_precision None leaves the choice to the launcher (accelerate launch's flag or config file).
    logging.getLogger("accelerate").setLevel(logging.WARNING)  # one INFO line per saved file otherwise
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), step_scheduler_with_optimizer=False,
                              mixed_precision=None if t.mixed_precision is None else str(t.mixed_precision))
    if accelerator.distributed_type == DistributedType.FSDP:
        raise TrainError("FSDP is not supported yet: the drafter shares the target's frozen embedding and LM head "
                         "modules, and held-out evaluation and export run on one process; use DDP "
                         "(scripts/accelerate/ddp_bf16.yaml)")
    world, rank = accelerator.num_processes, accelerator.process_index
    log.info("train: %d process(es) (%s), device %s, mixed precision %s", world, accelerator.distributed_type.value,
             accelerator.device, accelerator.mixed_precision)
    if t.batch_sequences % (world * t.grad_accum):
        raise TrainError(f"trainer.batch_sequences={t.batch_sequences} must be divisible by processes x grad_accum "
                         f"= {world} x {t.grad_accum}")
    torch.manual_seed(cfg.seed)
    comp = registry[t.component](cfg, Path(data_dir or t.data_dir or out.parent / cfg.teacher.out_dir),
                                 accelerator.device)
    params = [p for p in comp.model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_lambda(s, t.warmup_steps, t.steps))
    model, optimizer, scheduler = accelerator.prepare(comp.model, optimizer, scheduler)

    ckpt_dir = out / "checkpoints"
    start = 0
    last = next(reversed(checkpoints(ckpt_dir)), None)
    # A checkpoint of this very config (a killed run started again) is always continued: batches are a function of
    # (seed, step), so this equals the uninterrupted run. trainer.resume=true also continues another config's.
    same = last is not None and json.loads((last / "step.json").read_text()).get("config_hash") == digest
    if last is not None and (t.resume or same):
        accelerator.load_state(str(last))
        start = json.loads((last / "step.json").read_text())["step"]
        log.info("resumed from %s at step %d", last, start)
    elif accelerator.is_main_process and out.exists():
        shutil.rmtree(ckpt_dir, ignore_errors=True)  # a fresh run: old checkpoints would be misleading
        (out / "metrics.jsonl").unlink(missing_ok=True)
    if accelerator.is_main_process and (out / "metrics.jsonl").is_file():  # drop what was logged after the checkpoint
        lines = (out / "metrics.jsonl").read_text().splitlines()
        (out / "metrics.jsonl").write_text("".join(l + "\n" for l in lines if json.loads(l)["step"] <= start))
    accelerator.wait_for_everyone()
    logger = RunLogger(cfg, out, "train", enabled=accelerator.is_main_process, resume=start > 0)

    per_rank = t.batch_sequences // world
    micro = per_rank // t.grad_accum
    model.train()
    clock, blocks_seen, tokens_seen = time.perf_counter(), 0, 0
    bar = Progress("train", t.steps, "step", initial=start, enabled=accelerator.is_main_process)
    for step in range(start, t.steps):
        items = comp.step_items(step)
        mine = items[rank * per_rank: (rank + 1) * per_rank]
        batches = [comp.batch(mine[m * micro: (m + 1) * micro], step, rank * per_rank + m * micro)
                   for m in range(t.grad_accum)]
        norm = accelerator.reduce(torch.tensor(sum(comp.normaliser(b) for b in batches),
                                               device=accelerator.device), "sum").item()
        loss_total, corrects, valids = 0.0, [], []
        for m, batch in enumerate(batches):
            sync = accelerator.no_sync(model) if m < len(batches) - 1 else nullcontext()
            with sync, accelerator.autocast():
                autocast = autocast_dtype(accelerator.device)
                loss_sum, stats = comp.loss(model, batch)
                # DDP averages gradients over processes; scaling by world makes the result sum / global norm.
                accelerator.backward(loss_sum * world / max(norm, 1e-9))
            loss_total += loss_sum.item()
            corrects.append(stats["correct"])
            valids.append(stats["valid"])
            blocks_seen += int(batch["anchor_valid"].sum()) * world
            tokens_seen += int(batch["context_valid"].sum()) * world
        grad_norm = accelerator.clip_grad_norm_(params, t.grad_clip) if t.grad_clip > 0 else torch.tensor(0.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        loss = accelerator.reduce(torch.tensor(loss_total, device=accelerator.device), "sum").item() / max(norm, 1e-9)
        bar.update()

        metrics = {"loss": loss}
        if (step + 1) % t.log_every == 0 or step + 1 == t.steps:
            elapsed = time.perf_counter() - clock
            correct, valid = torch.cat(corrects), torch.cat(valids)
            a, _ = conditional_acceptance(correct, valid)
            acc = ((correct & valid).sum(0) / valid.sum(0).clamp(min=1)).tolist()  # unconditional, per position
            metrics.update({"lr": scheduler.get_last_lr()[0], "grad_norm": float(grad_norm), "train_a_k": a,
                            "autocast": autocast,
                            "train_acc_k": acc,
                            "anchor_blocks_per_s": blocks_seen / elapsed, "tokens_per_s": tokens_seen / elapsed})
            clock, blocks_seen, tokens_seen = time.perf_counter(), 0, 0
            log.info("step %d/%d loss %.4f a_1 %.3f lr %.2e grad %.2f %.1f blocks/s, ETA %s", step + 1, t.steps, loss,
                     a[0], metrics["lr"], metrics["grad_norm"], metrics["anchor_blocks_per_s"], bar.eta_text())
        if (step + 1) % t.eval_every == 0 or step + 1 == t.steps:
            if accelerator.is_main_process:
                metrics["heldout"] = comp.evaluate(model)
                h = metrics["heldout"]
                log.info("held-out a_k %s tau_offline %.3f", [round(x, 3) for x in h["a_k"]], h["tau_offline"])
            clock = time.perf_counter()
        logger.log(metrics, step + 1)
        if (step + 1) % t.save_every == 0 or step + 1 == t.steps:
            save_checkpoint(accelerator, ckpt_dir, step + 1, t.keep_checkpoints, digest)
    bar.close()

    if accelerator.is_main_process:
        comp.export(accelerator.unwrap_model(model), out / "export")
        (out / "done.json").write_text(json.dumps({"config_hash": digest, "steps": t.steps}))
        log.info("exported the trained %s to %s", t.component, out / "export")
    accelerator.wait_for_everyone()
    logger.finish()
    return out


def save_checkpoint(accelerator: Accelerator, folder: Path, step: int, keep: int, digest: str) -> None:
    """Model, optimizer, scheduler and RNG states via accelerate; step.json written last marks it complete."""
    path = folder / f"step-{step:07d}"
    accelerator.save_state(str(path))
    accelerator.wait_for_everyone()  # every process's files are written before their modes are set
    if accelerator.is_main_process:
        follow_umask(path)
        (path / "step.json").write_text(json.dumps({"step": step, "config_hash": digest}))
        for old in checkpoints(folder)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()

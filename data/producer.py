"""Feature producer: the target runs here, in an inference engine, and the trainer (trainer.features=producer) gets
its features through a spool (data/spool.py) without loading the target's body.

The producer reads the teacher dataset's tokens, works out the training run's sample order itself (the same
function of seed and step the trainer uses: data/splits.py step_batch), and writes, step after step, the tapped
layers' features of each step's sequences: vLLM's extract_hidden_states (producer.engine=vllm,
models/vllm_engine.py capture) or the transformers target's prefill capture (hf, the teacher's `separate` capture).
It keeps the producer.capacity steps from the slowest trainer rank's on and deletes the steps before it. Killed
and started again, it goes on from the slowest rank's step, skipping the steps already spooled; a trainer killed and
resumed marks its checkpoint's step as the one it reads, and the producer writes the steps from there again. It
ends once the trainer's last checkpoint is the last step.

Run it with the trainer's overrides (`dflash-producer experiment=... hydra.run.dir=<the trainer's run dir>`), on the
engine's machine with the spool on a shared filesystem; or let the trainer start it (producer.launch=true).
ProducerFeed is the trainer's side of the same spool.
"""
from __future__ import annotations

import contextlib
import logging
import subprocess
import sys
import time
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from dflash_pipeline.conf.schema import check_config
from dflash_pipeline.data.shards import FEATURE_DTYPES, DatasetError, TeacherDataset
from dflash_pipeline.data.splits import split_heldout, step_batch
from dflash_pipeline.data.spool import Spool, SpoolError
from dflash_pipeline.runtime.progress import Progress
from dflash_pipeline.runtime.stages import spool_dir

log = logging.getLogger(__name__)


def spool_of(cfg: DictConfig, run_dir: str | Path, data: TeacherDataset) -> Spool:
    """The run's spool, keyed by what fixes the sample order and the features: seed, global batch, steps, split,
    the dataset, its taps and the handed-over dtype (a producer of another config is refused, not trusted)."""
    t, p = cfg.trainer, cfg.producer
    if str(p.dtype) not in ("float32", "bfloat16", "float16"):
        raise DatasetError(f"producer.dtype={p.dtype}: the producer hands features over as float32, bfloat16 or "
                           "float16")
    if t.tokens_per_step:
        raise DatasetError(f"trainer.tokens_per_step={t.tokens_per_step} with trainer.features=producer: a producer "
                           "spools steps of trainer.batch_sequences sequences; set trainer.tokens_per_step=null")
    key = {"seed": cfg.seed, "batch_sequences": t.batch_sequences, "steps": t.steps,
           "heldout_samples": t.heldout_samples, "train_samples": t.train_samples,
           "dataset": data.manifest["config_hash"], "layer_ids": list(data.layer_ids), "dtype": str(p.dtype)}
    return Spool(spool_dir(cfg, run_dir), key, p.wait_s)


@contextlib.contextmanager
def feature_engine(cfg: DictConfig, layer_ids: list[int], log_file: Path):
    """A function sequences -> their features (T, taps*H) each: vLLM's capture, or the transformers target's."""
    from dflash_pipeline.models.target import load_target
    from dflash_pipeline.models.target_sources import target_folder

    if cfg.producer.engine == "vllm":
        from dflash_pipeline.models.vllm_engine import VLLMEngine, check_capture_layers

        head = load_target(cfg.target, cfg.cache_dir, body=False)
        check_capture_layers(layer_ids, head.num_layers)
        with VLLMEngine(cfg.cache_dir, target_folder(cfg.target, cfg.cache_dir), head.dtype,
                        head.config.max_position_embeddings, threads=torch.get_num_threads(),
                        max_num_seqs=cfg.trainer.batch_sequences, log_file=log_file,
                        capture_layers=layer_ids) as engine:
            yield lambda seqs: engine.capture(seqs)[0]
    else:
        from dflash_pipeline.models.generation import capture_batched

        target = load_target(cfg.target, cfg.cache_dir)
        pad = target.tokenizer.pad_token_id
        yield lambda seqs: [o["features"] for o in capture_batched(
            target.model, seqs, layer_ids, pad_id=pad, max_tokens=cfg.teacher.capture_batch_tokens)]


def run_producer(cfg: DictConfig, run_dir: str | Path, data_dir: str | Path) -> Path:
    """Spool the features of every training step of `cfg` (and of its held-out sequences) from the teacher dataset
    at `data_dir` (the one the drafter stage of `run_dir` reads); returns the spool."""
    check_config(cfg)
    data = TeacherDataset(data_dir)
    t = cfg.trainer
    train_idx, heldout_idx = split_heldout(data.ids, t.heldout_samples, t.train_samples)
    spool = spool_of(cfg, run_dir, data)
    dtype = FEATURE_DTYPES[str(cfg.producer.dtype)]
    start = spool.slowest_reader()
    spool.heartbeat(start)
    log.info("producer: %s features of %d steps x %d sequences (taps %s) -> %s, from step %d",
             cfg.producer.engine, t.steps, t.batch_sequences, data.layer_ids, spool.folder, start)

    def tokens(indices: list[int]) -> list[list[int]]:
        return [data[i]["input_ids"].tolist() for i in indices]

    with contextlib.ExitStack() as stack:
        features = stack.enter_context(feature_engine(cfg, data.layer_ids, spool.folder / "engine.log"))
        bar = stack.enter_context(Progress("producer", t.steps, "step", initial=start))
        if not spool.heldout_file.is_file():
            spool.write(spool.heldout_file, heldout_idx, [f.to(dtype) for f in features(tokens(heldout_idx))])
        while (step := spool.wait_for_room(cfg.producer.capacity, t.steps,
                                           on_wait=lambda: spool.heartbeat(spool.slowest_reader()))) is not None:
            indices = step_batch(train_idx, step, t.batch_sequences, cfg.seed)
            began = time.perf_counter()
            out = features(tokens(indices))
            spool.write(spool.step_file(step), indices, [f.to(dtype) for f in out])
            spool.heartbeat(step)
            bar.add("tok", sum(len(f) for f in out))
            bar.update(max(0, step + 1 - bar.n))  # the bar shows the furthest step written
            log.debug("producer: step %d in %.2f s", step, time.perf_counter() - began)
    spool.heartbeat(t.steps, done=True)
    log.info("producer: the trainer's last checkpoint is step %d: done (%s)", t.steps, spool.folder)
    return spool.folder


def launch(cfg: DictConfig, run_dir: str | Path, folder: Path, data_dir: Path) -> subprocess.Popen:
    """Start a producer for `cfg` in a process of its own on this machine (producer.launch=true), logging to
    <spool>/producer.log; the config goes to it as a resolved YAML file."""
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "producer-config.yaml"
    OmegaConf.save(cfg, config, resolve=True)
    with open(folder / "producer.log", "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "dflash_pipeline.cli.producer", str(config), str(run_dir),
                                 str(data_dir)],
                                stdout=out, stderr=subprocess.STDOUT)


class ProducerFeed:
    """The trainer's side: the drafter's features from the producer's spool (trainer.features=producer). Each
    process reads its own slots of each step's global batch and tells the producer which step it is at; the main
    process starts the producer itself with producer.launch=true."""

    def __init__(self, cfg: DictConfig, run_dir: Path, data, heldout: list[int]):
        from accelerate import PartialState

        state = PartialState()
        self.rank, self.reading, self.heldout, self.steps = state.process_index, None, heldout, cfg.trainer.steps
        self.spool = spool_of(cfg, run_dir, data)
        self.producer = None
        if cfg.producer.launch and state.is_main_process:
            self.producer = launch(cfg, run_dir, self.spool.folder, data.folder)
            log.info("started a %s feature producer (pid %d, log %s)", cfg.producer.engine, self.producer.pid,
                     self.spool.folder / "producer.log")
        else:
            log.info("features from the producer spooling to %s (start it with this run's overrides: dflash-producer)",
                     self.spool.folder)

    def features(self, indices: list[int], step: int | None, slot0: int) -> list[torch.Tensor]:
        if step is None:  # held-out: their slots in the held-out file
            return self.spool.read(self.spool.heldout_file, [self.heldout.index(i) for i in indices], indices,
                                   self._check_producer)
        if step != self.reading:
            self.spool.mark_read(self.rank, step)
            self.reading = step
        return self.spool.read(self.spool.step_file(step), list(range(slot0, slot0 + len(indices))), indices,
                               self._check_producer)

    def _check_producer(self) -> None:
        if self.producer is not None and self.producer.poll() not in (None, 0):
            raise SpoolError(f"the feature producer this trainer started exited with code {self.producer.returncode}: "
                             f"see {self.spool.folder / 'producer.log'}")

    def close(self) -> None:
        """Let the producer this process started end (it does once the last checkpoint is the last step; stopped
        otherwise), and drop the spooled steps the last checkpoint has passed (at the end: all of them)."""
        if self.producer is not None and self.producer.poll() is None:
            try:
                self.producer.wait(timeout=60 if self.spool.committed() >= self.steps else 0)
            except subprocess.TimeoutExpired:
                self.producer.terminate()
                self.producer.wait()
        if self.rank == 0:
            self.spool.drop_before(self.spool.committed())


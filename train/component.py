"""What the one training loop (train/loop.py) needs from a component, and nothing more.

The loop owns accelerate, the optimizer and schedule, checkpoints, resume, logging, progress and the export call. A
component owns its model, its data, its loss and its metrics: the loop never reads a key of a batch or a metric.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from omegaconf import DictConfig


@dataclass
class StageInputs:
    """Where a training stage reads from: the teacher dataset, for a component trained on a frozen drafter the
    drafter's export folder, and the run directory (where a feature producer's spool is, trainer.features=producer)."""

    teacher: Path
    drafter: Path | None = None
    run_dir: Path | None = None


@runtime_checkable
class TrainingComponent(Protocol):
    name: str
    model: torch.nn.Module  # what the optimizer trains (frozen parts are held outside its parameters)

    def step_items(self, step: int) -> list:
        """The global batch of `step` (every process computes it; each takes its slice): a function of (seed, step)
        alone, whatever the number of processes it is cut over."""

    def item_sizes(self, items: list) -> list[int]:
        """The cost of each item (tokens), for the loop to cut micro-batches of even cost (ComponentHooks: 1 each)."""

    def batch(self, items: list, step: int, slot0: int) -> Any:
        """One micro-batch of `items`, whose first item is slot `slot0` of the global batch."""

    def normaliser(self, batch: Any) -> float:
        """The batch's share of the loss normaliser, known before the forward (summed over processes)."""

    def loss(self, model: torch.nn.Module, batch: Any) -> tuple[torch.Tensor, dict]:
        """(loss SUM over the batch, stats): the loop divides by the global normaliser; stats go to train_metrics.
        `model` is what accelerate prepared (a DDP wrapper on several processes): call it, so gradients sync."""

    def work(self, batch: Any) -> dict[str, int]:
        """Units of work in the batch (e.g. anchor blocks, context tokens): logged as <unit>_per_s."""

    def train_metrics(self, stats: list[dict]) -> dict:
        """Loggable training metrics from the stats of one step's micro-batches."""

    def evaluate(self, model: torch.nn.Module) -> dict:
        """Held-out metrics (logged under "heldout"), with `tau_offline` for the path the component proposes;
        `model` is the component's own module (unwrapped by the loop), as in export."""

    def export(self, model: torch.nn.Module, folder: Path) -> Path:
        """Write the trained component where engines and the eval stage load it."""

    def checkpointed(self, step: int) -> None:
        """Called by the main process after each checkpoint of `step` (e.g. a feature producer may drop the steps
        before it; ComponentHooks: nothing)."""

    def close(self) -> None:
        """Stop what the component started (a feature producer) when training ends (ComponentHooks: nothing)."""


class ComponentHooks:
    """The defaults of TrainingComponent's optional hooks, for a component to inherit: items of equal cost, nothing
    to do at a checkpoint or at the end."""

    def item_sizes(self, items: list) -> list[int]:
        return [1] * len(items)

    def checkpointed(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def loop_settings(cfg: DictConfig, own: DictConfig | None) -> DictConfig:
    """trainer.*, with every value the component's own config section sets under the same name (steps, lr, ...)."""
    from omegaconf import OmegaConf

    base = OmegaConf.to_container(cfg.trainer, resolve=True)
    if own is not None:
        mine = OmegaConf.to_container(own, resolve=True)
        base.update({k: v for k, v in mine.items() if k in base and v is not None})
    return OmegaConf.create(base)

"""How the loop's model is spread over processes: `Accelerated` (accelerate's prepare: DDP, or one process) by
default, `Sharded` under an FSDP launch. Both give the loop the same things: the model, optimizer and schedule,
gradient sync per micro-batch, gradient clipping, an unsharded model on rank 0 (eval, export), and checkpoint
save / load.

FSDP for the drafter, when the launcher asks for it (`accelerate launch --use_fsdp` or a config file with
`distributed_type: FSDP`, e.g. scripts/accelerate/fsdp_bf16.yaml): PyTorch FSDP2 (`fully_shard`), applied here.

Why here and not in `accelerator.prepare`: accelerate builds FSDP on GPUs only (a CPU launch with --use_fsdp runs as
plain multi-process, which is how the tests run it on 2 gloo processes), and the loop needs three things its FSDP
path does not give: checkpoints that resume on another process count, held-out eval and export on one process, and
the frozen target modules left alone. So:
- the drafter stage is sharded: the modules the model names in `fsdp_units()` (each layer's MLP: most of the
  weights) are FSDP units of their own, gathered only while they run; the model's other own parameters (attention,
  fc, norms, a draft-vocabulary head, a jointly trained selector) form the root unit, gathered for the whole forward
  and backward (models/drafter.py: fsdp_units says why the attention stays there). Gradients are reduce-scattered
  and averaged as DDP averages them, so the loop's loss scaling is unchanged.
- the target's frozen embedding and LM head, which the drafter only refers to (outside its module tree), stay whole
  on every rank: the target itself runs with them (features in online training, eval), they have no gradient and
  no optimizer state, and sharding them would only add an all-gather to every forward.
- a component on a frozen drafter (selector, jump heads, Weaver: a few million parameters) is replicated (DDP): it
  does not need sharding, and its loss calls the model's methods outside `forward`, which FSDP does not gather for.
- checkpoints hold full (unsharded) states in safetensors + JSON, gathered to rank 0 and broadcast from it on load,
  so a run resumes on any process count and no pickle is read.
- held-out eval and export run on rank 0 on an unsharded replica loaded with the full state: FSDP2 reshards a module
  whenever its state_dict is read, so the sharded model itself cannot be evaluated or exported on one process.
"""
from __future__ import annotations

import copy
import json
import os
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from dflash_pipeline.runtime.files import save_safetensors, write_json

if TYPE_CHECKING:  # scripts/gpu_check.py uses `shard` without accelerate installed
    from accelerate import Accelerator


def fsdp_requested(accelerator: Accelerator) -> bool:
    """The launcher asked for FSDP: accelerate's own distributed type on GPUs, or the environment its launcher sets
    (ACCELERATE_USE_FSDP), which a CPU launch reports as MULTI_CPU."""
    from accelerate import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP or \
        os.environ.get("ACCELERATE_USE_FSDP", "false").lower() in ("true", "1")


def shard(model: nn.Module, mesh) -> nn.Module:
    """FSDP2 over `mesh`: the modules the model names in `fsdp_units()` as units of their own, the rest the root."""
    from torch.distributed.fsdp import fully_shard

    for unit in model.fsdp_units() if hasattr(model, "fsdp_units") else []:
        fully_shard(unit, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def external_modules(model: nn.Module) -> dict[int, nn.Module]:
    """Modules the model refers to outside its own module tree (the target's embedding and LM head, held in a plain
    tuple by the drafter), by id: a replica shares them instead of copying them."""
    own = set(model.modules())
    found = {}
    for m in own:
        for value in vars(m).values():
            for x in value if isinstance(value, (tuple, list)) else ():
                if isinstance(x, nn.Module) and x not in own:
                    found[id(x)] = x
    return found


class Accelerated:
    """accelerate's prepare (DDP over the launch's processes, or one process) and its checkpoints."""

    def __init__(self, model: nn.Module, make_optimizer, accelerator: Accelerator):
        self.accelerator = accelerator
        optimizer, scheduler = make_optimizer([p for p in model.parameters() if p.requires_grad])
        self.model, self.optimizer, self.scheduler = accelerator.prepare(model, optimizer, scheduler)

    def sync(self, last: bool):
        """Gradient sync off for all but the last micro-batch of a step."""
        return nullcontext() if last else self.accelerator.no_sync(self.model)

    def clip(self, params, max_norm: float) -> float:
        return float(self.accelerator.clip_grad_norm_(params, max_norm))

    @contextmanager
    def unsharded(self):
        """Rank 0: the trained model as a plain module (None elsewhere)."""
        yield self.accelerator.unwrap_model(self.model) if self.accelerator.is_main_process else None

    def save(self, path: Path) -> None:
        self.accelerator.save_state(str(path))

    def load(self, path: Path) -> None:
        self.accelerator.load_state(str(path))


class Sharded:
    """The model under an FSDP launch: sharded (sharded=True: the drafter stage) or replicated (DDP), with full-state
    checkpoints and a rank-0 replica for eval and export. The optimizer and schedule are made by `make_optimizer` once
    the parameters are sharded. Methods that gather are collective: every process calls them."""

    def __init__(self, model: nn.Module, make_optimizer, accelerator: Accelerator, sharded: bool):
        self.accelerator, self.sharded = accelerator, sharded and accelerator.num_processes > 1
        # rank 0's unsharded copy (host memory: one full set of weights, no optimizer state)
        self.replica = copy.deepcopy(model, external_modules(model)).cpu() if accelerator.is_main_process else None
        if self.sharded:
            from torch.distributed.device_mesh import init_device_mesh

            self.model = shard(model, init_device_mesh(accelerator.device.type, (accelerator.num_processes,)))
        elif accelerator.num_processes > 1:
            ids = [accelerator.device.index] if accelerator.device.type == "cuda" else None
            self.model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
        else:
            self.model = model
        self.optimizer, self.scheduler = make_optimizer([p for p in self.model.parameters() if p.requires_grad])
        self.options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        self.loading = StateDictOptions(full_state_dict=True, broadcast_from_rank0=accelerator.num_processes > 1)

    def sync(self, last: bool):
        if self.sharded:
            self.model.set_requires_gradient_sync(last)
        elif not last and isinstance(self.model, nn.parallel.DistributedDataParallel):
            return self.model.no_sync()
        return nullcontext()

    def clip(self, params, max_norm: float) -> float:
        norm = nn.utils.clip_grad_norm_(params, max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    @contextmanager
    def unsharded(self):
        """Rank 0: the replica holding the current weights, on the training device, moved back to host memory
        afterwards (None elsewhere). Collective."""
        state = get_model_state_dict(self.model, options=self.options)
        if self.replica is None:
            yield None
            return
        self.replica.load_state_dict(state)
        try:
            yield self.replica.to(self.accelerator.device)
        finally:
            self.replica.cpu()

    # -- checkpoints: full states, safetensors + JSON ---------------------------------------------------------
    def save(self, path: Path) -> None:
        model = get_model_state_dict(self.model, options=self.options)
        optim = get_optimizer_state_dict(self.model, self.optimizer, options=self.options)
        if self.accelerator.is_main_process:
            path.mkdir(parents=True, exist_ok=True)
            save_safetensors({k: v.contiguous() for k, v in model.items()}, path / "model.safetensors")
            tensors, scalars = {}, {}
            for name, state in optim["state"].items():
                for key, value in state.items():
                    if torch.is_tensor(value):
                        tensors[f"{name}/{key}"] = value.contiguous()
                    else:
                        scalars[f"{name}/{key}"] = value
            save_safetensors(tensors, path / "optimizer.safetensors")
            write_json(path / "optimizer.json", {"param_groups": optim["param_groups"], "scalars": scalars})
            write_json(path / "scheduler.json", self.scheduler.state_dict())

    def load(self, path: Path) -> None:
        model, optim = {}, {}
        if self.accelerator.is_main_process:
            model = load_file(str(path / "model.safetensors"))
            meta = json.loads((path / "optimizer.json").read_text())
            state: dict[str, dict] = {}
            for key, value in [*load_file(str(path / "optimizer.safetensors")).items(), *meta["scalars"].items()]:
                name, _, field = key.rpartition("/")
                state.setdefault(name, {})[field] = value
            optim = {"state": state, "param_groups": meta["param_groups"]}
        set_model_state_dict(self.model, model, options=self.loading)
        set_optimizer_state_dict(self.model, self.optimizer, optim, options=self.loading)
        self.scheduler.load_state_dict(json.loads((path / "scheduler.json").read_text()))

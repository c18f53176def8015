"""The eval stage's inputs: the eval sets' prompts, the exported drafter, and the sequences the teacher-forced
metrics run on.

Offline (teacher-forced, no generation; every anchor of every sequence; docs/metrics.md, 'Offline evaluation'):
- `teacher_heldout`: the held-out teacher sequences of the training run (DrafterComponent.heldout_idx), reported
  once: they come from teacher data, not from an eval set. Skipped (null) when the teacher data is absent or is not
  the data the drafter was trained on (then the held-out split is unknown).
- per eval set: the same metrics on [prompt + the target's own autoregressive reply] of that set's prompts. This is
  cheap (one feature-capture prefill per prompt) and puts offline and online numbers on the SAME tokens, so the
  gap between tau_offline and tau_online is measured, not guessed across data sets.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from omegaconf import DictConfig

from dflash_pipeline.data.shards import TeacherDataset
from dflash_pipeline.data.sources import load_conversations
from dflash_pipeline.data.splits import split_heldout
from dflash_pipeline.eval.errors import EvalError
from dflash_pipeline.eval.references import ReferenceCache, turn_prompts
from dflash_pipeline.models.drafter import DFlashDrafter
from dflash_pipeline.models.generation import recapture
from dflash_pipeline.models.target import Target
from dflash_pipeline.runtime.stages import evaluated_drafter

log = logging.getLogger(__name__)

BUILTIN = {  # benchmark sets are used whole; the ShareGPT train/held-out split applies only to "heldout"
    "mtbench": {"source": "mtbench", "split": "all"},
    "humaneval": {"source": "humaneval", "split": "all"},
    "heldout": {"source": "sharegpt", "split": "heldout"},
}
FILE_SUFFIXES = (".json", ".jsonl", ".parquet")


def dataset_source(name: str) -> tuple[str, dict]:
    """(label, load_conversations kwargs) of an eval set name."""
    if name in BUILTIN:
        return name, dict(BUILTIN[name])
    if name.startswith("hf:"):
        return name[3:].replace("/", "_"), {"source": "hf", "path": name[3:], "split": "all"}
    if name.lower().endswith(FILE_SUFFIXES):
        return Path(name).stem, {"source": "file", "path": name, "split": "all"}
    raise EvalError(f"unknown eval dataset {name!r}: use {', '.join(BUILTIN)}, a path ending in "
                    f"{'/'.join(FILE_SUFFIXES)}, or hf:<dataset id>")


def load_prompts(name: str, label: str, cfg: DictConfig, references: ReferenceCache, room: int
                 ) -> dict[str, list[dict]]:
    """The prompts of an eval set as chat-templated ids, per turn: {label: first turns, label_turn2: second turns
    (conditioned on the target's own first replies), ...} up to eval.turns. room: the most prompt tokens that still
    leave space for the reply in the target's context."""
    _, kwargs = dataset_source(name)
    tokenizer = references.target.tokenizer
    limit = cfg.eval.max_prompt_tokens or room
    convs = load_conversations(**kwargs, heldout_fraction=cfg.data.heldout_fraction, limit=cfg.eval.num_prompts,
                               tokenizer=tokenizer, max_prompt_tokens=limit, log=log.info)
    per_turn = turn_prompts(tokenizer, convs, cfg.eval.turns, references, cfg.eval.max_new_tokens, room)
    if len(per_turn[0]) < len(convs):  # the template adds tokens the filter did not count
        log.warning("%s: %d prompts over %d tokens with their template: skipped", name,
                    len(convs) - len(per_turn[0]), room)
    return {label if k == 0 else f"{label}_turn{k + 1}": prompts for k, prompts in enumerate(per_turn)}


def prompt_sets(cfg: DictConfig, labels: list[str], references: ReferenceCache, room: int) -> dict[str, list[dict]]:
    """{label: prompts} of every eval set and turn (load_prompts), each refused when no prompt fits the context."""
    sets = {}
    for name, label in zip(cfg.eval.datasets, labels):
        sets.update(load_prompts(name, label, cfg, references, room))
        if not sets[label]:
            raise EvalError(f"eval dataset {name!r} gave no prompt that fits the target's context")
    return sets


def load_drafter(cfg: DictConfig, train_dir: Path, target: Target) -> tuple[DFlashDrafter, Path]:
    folder = evaluated_drafter(cfg, train_dir)
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise EvalError(f"no exported drafter at {folder} (config.json + model.safetensors); run dflash-train "
                        "first or set eval.drafter_dir to an exported folder")
    model = target.model
    drafter = DFlashDrafter.from_pretrained(str(folder), model.get_input_embeddings(), model.get_output_embeddings())
    drafter.set_attn_implementation(str(cfg.drafter.attn_implementation))
    c = drafter.config
    if c.num_target_layers != target.num_layers or c.target_hidden_size != target.hidden_size:
        raise EvalError(f"drafter {folder} was trained for a target with {c.num_target_layers} layers and hidden size "
                        f"{c.target_hidden_size}; the configured target ({target.ref}) has {target.num_layers} and "
                        f"{target.hidden_size}")
    dtype = next(model.parameters()).dtype
    return drafter.to(device=next(model.parameters()).device, dtype=dtype).eval(), folder


def reply_items(target: Target, layer_ids: list[int], seqs: list[tuple[list[int], list[int]]],
                final: bool = False) -> list[dict]:
    """(prompt ids, reply ids) pairs as teacher-style items: features captured now, loss mask on the reply."""
    items = [{"input_ids": torch.tensor(prompt + reply),
              "loss_mask": torch.tensor([0] * len(prompt) + [1] * len(reply), dtype=torch.bool)}
             for prompt, reply in seqs]
    return recapture(target.model, items, layer_ids, pad_id=target.tokenizer.pad_token_id, final=final)


def teacher_heldout_items(cfg: DictConfig, data_dir: Path, drafter_dir: Path, target: Target,
                          layer_ids: list[int]) -> tuple[list[dict] | None, str]:
    """The training run's held-out teacher sequences, or (None, why not)."""
    if not (data_dir / "manifest.json").is_file():
        return None, f"no teacher dataset at {data_dir}"
    data = TeacherDataset(data_dir, verify=False)
    trained_on = json.loads((drafter_dir / "config.json").read_text()).get("dflash_pipeline", {})
    if trained_on.get("teacher_config_hash") not in (None, data.manifest["config_hash"]):
        return None, (f"the drafter was trained on teacher data {trained_on['teacher_config_hash']}, not on "
                      f"{data_dir} ({data.manifest['config_hash']}): its held-out split is unknown")
    if data.manifest["target"]["ref"] != target.ref:
        return None, f"teacher data of target {data.manifest['target']['ref']}, not {target.ref}"
    _, held = split_heldout(data.ids, cfg.trainer.heldout_samples)
    items = [data[i] for i in held]
    if data.layer_ids != layer_ids or not data.has_features:  # other taps stored, or none: capture the drafter's now
        recapture(target.model, items, layer_ids, pad_id=target.tokenizer.pad_token_id)
    return items, f"{len(items)} held-out sequences of {data_dir}"


def numerics(target: Target, teacher_dir: Path, tolerance: float) -> dict:
    """The target's dtype here (and why, on which machine) beside the teacher data's: a drafter trained on features
    of other numerics than it is evaluated with is reported as such (and logged), not refused: a GPU-made bf16
    teacher evaluated on a CPU without native bf16 is a normal case."""
    out = {**target.numerics, "near_tie_tolerance": tolerance if target.dtype != "float32" else None}
    manifest = teacher_dir / "manifest.json"
    if manifest.is_file():
        theirs = json.loads(manifest.read_text())["target"]
        out["teacher_dtype"] = theirs.get("dtype", "float32")  # datasets from before the field: float32 only
        out["teacher_machine"] = theirs.get("numerics", {}).get("machine")
        out["same_as_teacher"] = out["teacher_dtype"] == target.dtype
        if not out["same_as_teacher"]:
            log.warning("the teacher data was made with a %s target, this evaluation runs it in %s: offline metrics "
                        "on stored features and online decoding use different numerics", out["teacher_dtype"],
                        target.dtype)
    return out

"""What every component trained on a frozen drafter shares: the teacher data and target, the frozen exported drafter,
the same held-out split and step batches as the drafter's own training, and the drafter's outputs on packed blocks.

A subclass (train/selector.py, train/jump.py) brings its model, loss, metrics and export.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from omegaconf import DictConfig

from dflash_pipeline.data.splits import anchor_generators, split_heldout, step_batch
from dflash_pipeline.data.teacher import teacher_and_target
from dflash_pipeline.eval.protocol import drafter_blocks
from dflash_pipeline.eval.metrics import offline_metrics
from dflash_pipeline.models.drafter import DFlashDrafter
from dflash_pipeline.models.export import GGUF_FOLDER, identity_convolution
from dflash_pipeline.models.generation import CapturedFeatures
from dflash_pipeline.models.selector import SELECTOR_PREFIX
from dflash_pipeline.train.component import ComponentHooks, StageInputs, loop_settings
from dflash_pipeline.train.errors import TrainError
from dflash_pipeline.train.losses import decay_weights, default_gamma, dpace_weights

log = logging.getLogger(__name__)


class FrozenDrafterComponent(ComponentHooks):
    """Base of a component trained on a frozen drafter; `section` is its config section (conf/<section>/)."""

    section = ""

    def __init__(self, cfg: DictConfig, inputs: StageInputs, device: torch.device):
        self.cfg, self.own, self.device = cfg, cfg[self.section], device
        self.settings = loop_settings(cfg, self.own)
        self.data, self.target = teacher_and_target(cfg, inputs.teacher)
        self.drafter_dir = inputs.drafter
        self.target.model.to(device)
        model = self.target.model
        if not self.data.has_features:  # a tokens-only dataset: read through the target
            self.data = CapturedFeatures(self.data, model, self.target.tokenizer.pad_token_id)
        self.drafter = DFlashDrafter.from_pretrained(str(inputs.drafter), model.get_input_embeddings(),
                                                     model.get_output_embeddings()).to(device).eval()
        self.drafter.requires_grad_(False)
        if self.drafter.config.target_layer_ids != list(self.data.layer_ids):
            raise TrainError(f"the drafter at {inputs.drafter} taps layers {self.drafter.config.target_layer_ids}, "
                             f"the teacher data {list(self.data.layer_ids)}: train both on the same teacher data")
        self.block_size = self.drafter.config.block_size
        self.train_idx, self.heldout_idx = split_heldout(self.data.ids, cfg.trainer.heldout_samples,
                                                         cfg.trainer.train_samples)
        self.decay = decay_weights(self.block_size - 1, cfg.trainer.gamma or default_gamma(self.block_size),
                                   device=device)

    def position_weights(self, batch: dict) -> torch.Tensor:
        """(N, B-1) the weights the drafter was trained with, on this batch's blocks: decay weights, or for a D-PACE
        drafter its D-PACE weights from its own probability of each true token (batch["label_q"])."""
        valid = batch["valid"]
        if self.cfg.trainer.loss == "dpace":
            return dpace_weights(batch["label_q"], valid, self.cfg.trainer.dpace_alpha)
        return self.decay.expand(valid.shape[0], -1)

    # -- data ------------------------------------------------------------------------------------------------
    def step_items(self, step: int) -> list[int]:
        return step_batch(self.train_idx, step, self.settings.batch_sequences, self.cfg.seed)

    @torch.no_grad()
    def drafter_outputs(self, items: list[dict], top_k: int, anchors_per_sequence: int | None,
                        generators=None) -> dict:
        """The frozen drafter on packed blocks of `items`, real blocks only: hidden (N, B, H) post-norm (anchor
        first), cand_ids / U (N, B-1, K) its top-K target ids and logits, labels / valid (N, B-1), anchors (N,),
        prev_true (N, B-1) the true token before each position; topk_ids / topk_logprobs and verifier_hidden (N, H)
        when the items have them."""
        d = self.drafter
        hidden, b, keep = drafter_blocks(d, items, self.block_size, anchors_per_sequence, generators)
        hidden = hidden.float()  # (N, B, H)
        logits = d.logits(hidden[:, 1:]).float()
        U, idx = logits.topk(min(top_k, logits.shape[-1]), dim=-1)
        labels, anchors = b["labels"][keep], b["block_ids"][keep][:, 0]
        column = d.target_to_column()[labels.clamp(min=0)]  # -1: a label outside the draft vocabulary
        q = torch.softmax(logits, -1).gather(-1, column.clamp(min=0)[..., None])[..., 0]
        out = {"hidden": hidden, "cand_ids": d.to_target_ids(idx), "U": U, "labels": labels,
               "valid": b["label_valid"][keep], "anchors": anchors,
               "prev_true": torch.cat([anchors[:, None], labels[:, :-1]], dim=1),
               "label_q": torch.where(column >= 0, q, 0.0)}  # the drafter's probability of the true token
        if "topk_ids" in b:
            out["topk_ids"], out["topk_logprobs"] = b["topk_ids"][keep], b["topk_logprobs"][keep]
        if "verifier_hidden" in b:
            out["verifier_hidden"] = b["verifier_hidden"][keep]
        return out

    def batch(self, indices: list[int], step: int, slot0: int = 0) -> dict:
        """Drafter outputs on the step's anchors (the same anchors the drafter's training draws for this step)."""
        return self.drafter_outputs([self.data[i] for i in indices], self.own.top_k,
                                    self.settings.anchors_per_sequence,
                                    anchor_generators(self.cfg.seed, step, slot0, len(indices)))

    def work(self, batch: dict) -> dict[str, int]:
        return {"anchor_blocks": int(batch["anchors"].shape[0])}

    def heldout_items(self) -> list[dict]:
        return [self.data[i] for i in self.heldout_idx]

    # -- metrics ---------------------------------------------------------------------------------------------
    def heldout_metrics(self, model, methods_of) -> dict:
        """Teacher-forced metrics on the held-out sequences of the methods `methods_of(model in eval mode)`
        builds ({name: method}), beside the chain's; the model's train/eval mode is restored after."""
        was_training = model.training
        model.eval()
        try:
            return offline_metrics(self.drafter, self.heldout_items(), self.block_size, [1, self.own.top_k],
                                   methods=methods_of(model))
        finally:
            model.train(was_training)

    def method_summary(self, m: dict, name: str) -> dict:
        """What a component's held-out evaluation reports of its method `name`: a_k, tau_offline, and the chain's
        and the oracle's tau on the same blocks."""
        return {"a_k": m["methods"][name]["a_k"], "tau_offline": m["methods"][name]["tau_offline"],
                "chain_tau_offline": m["tau_offline"], "oracle_tau": m["oracle_tau"][str(self.own.top_k)]}

    # -- export ----------------------------------------------------------------------------------------------
    def export_with_drafter(self, folder: Path, tensors: dict[str, torch.Tensor], dflash_config: dict,
                            provenance: dict) -> Path:
        """The drafter's export plus this component's tensors (prefixed) and its dflash_config keys: one
        checkpoint an engine loads whole."""
        return export_with_drafter(self.drafter_dir, folder, tensors, dflash_config, self.section, provenance)


def export_with_drafter(drafter_dir: Path, folder: Path, tensors: dict[str, torch.Tensor], dflash_config: dict,
                        section: str, provenance: dict) -> Path:
    """The drafter export in `drafter_dir` plus a component's tensors (prefixed) and its dflash_config keys, in
    `folder`: one checkpoint an engine loads whole; config.json records `provenance` under dflash_pipeline.<section>."""
    from safetensors.torch import load_file

    from dflash_pipeline.runtime.files import save_safetensors, write_text

    folder.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(folder / GGUF_FOLDER, ignore_errors=True)  # derived from the export this replaces
    config = json.loads((drafter_dir / "config.json").read_text())
    config["dflash_config"].update(dflash_config)
    config.setdefault("dflash_pipeline", {})[section] = provenance
    weights = load_file(str(drafter_dir / "model.safetensors"))
    own_prefixes = {k.split(".", 1)[0] + "." for k in tensors}  # e.g. a trained selector replaces the pass-through
    weights = {k: v for k, v in weights.items() if k.split(".", 1)[0] + "." not in own_prefixes}
    if SELECTOR_PREFIX in own_prefixes and config["architectures"] == ["DFlashDraftModel"]:
        if config.get("draft_vocab_size", config["vocab_size"]) == config["vocab_size"]:  # servable as DFlash2
            conv, keys = identity_convolution(config)
            weights.update(conv)
            config["dflash_config"].update(keys)
            config["architectures"] = ["DFlash2DraftModel"]
        else:
            log.warning("%s: a draft-vocabulary drafter with a selector stays a DFlashDraftModel (vLLM's DFlash2 "
                        "scores candidates over the full vocabulary): engines serve it without the selector; "
                        "train over the full vocabulary to serve DFlash2 (docs/export.md)", folder)
    clash = set(weights) & set(tensors)
    if clash:
        raise TrainError(f"{section} tensors {sorted(clash)} collide with the drafter's")
    save_safetensors({**weights, **{k: v.detach().cpu().contiguous() for k, v in tensors.items()}},
                     folder / "model.safetensors", metadata={"format": "pt"})
    write_text(folder / "config.json", json.dumps(config, indent=2))
    return folder


def summed(stats: list[dict]) -> dict[str, float]:
    """The micro-batches' stats of a logging window added up (each component's train_metrics divides them)."""
    return {k: sum(float(s[k]) for s in stats) for k in stats[0]}


def scored_rates(stats: list[dict], coverage: str, **rates: str) -> dict[str, float]:
    """Train metrics of a loss that scores only some positions (stats "scored" / "skipped"): `coverage` the
    scored share of the positions seen, and each rate name = its stat's count over the scored positions."""
    total = summed(stats)
    scored = max(1.0, total["scored"])
    return {coverage: total["scored"] / max(1.0, total["scored"] + total["skipped"]),
            **{name: total[key] / scored for name, key in rates.items()}}


"""Drafters exported by the peer trainers (SpecForge 0.2, speculators 0.9) in this project's export layout.

Both peers write the same tensor names and shapes as docs/export.md (fc, hidden_norm, norm, layers.{i}.*; no
embedding, no head over the full vocabulary); what differs is config.json and the dtype:
- SpecForge (`specforge export --to hf`): this project's config keys plus transformers extras; rope_theta at the
  top level (and in rope_parameters); target_hidden_size only when its draft config had it; tensors in the
  training dtype while config.json says bfloat16. No draft-vocabulary variant.
- speculators (a checkpoint folder <save-path>/<epoch>/): the layer shape nested under transformer_layer_config,
  mask_token_id and aux_hidden_state_layer_ids (hidden_states indices: this project's layer ids + 1) at the top
  level, no num_target_layers; tensors always bf16; a draft vocabulary as lm_head.weight + d2t + t2d. Its default
  attention inside the block is causal (layer_types sliding_attention without sliding_window_non_causal), which
  this project's drafter does not run: such a checkpoint is refused.
`to_project` writes config.json + model.safetensors that DFlashDrafter.from_pretrained loads (float32 weights).
"""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file

from dflash_pipeline.runtime.files import save_safetensors, write_text
from dflash_pipeline.models.drafter import DFlashDrafterConfig


class PeerExportError(ValueError):
    """A peer's checkpoint this project cannot load as it was trained, with the reason."""


def _rope(layer: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from a transformers-style config's rope_theta / rope_parameters."""
    params = dict(layer.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", layer.get("rope_theta", 10000.0)))
    return theta, (None if params.get("rope_type", "default") == "default" and set(params) <= {"rope_type"}
                   else params)


def _shape(layer: dict, **rest) -> DFlashDrafterConfig:
    theta, scaling = _rope(layer)
    return DFlashDrafterConfig(
        hidden_size=layer["hidden_size"], intermediate_size=layer["intermediate_size"],
        num_hidden_layers=layer["num_hidden_layers"], num_attention_heads=layer["num_attention_heads"],
        num_key_value_heads=layer["num_key_value_heads"],
        head_dim=layer.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"],
        rms_norm_eps=layer["rms_norm_eps"], rope_theta=theta, rope_scaling=scaling,
        max_position_embeddings=layer["max_position_embeddings"], vocab_size=layer["vocab_size"], **rest)


def specforge_config(cfg: dict, num_target_layers: int) -> DFlashDrafterConfig:
    if cfg.get("draft_vocab_size", cfg["vocab_size"]) != cfg["vocab_size"]:
        raise PeerExportError(f"draft_vocab_size {cfg['draft_vocab_size']} != vocab_size {cfg['vocab_size']}, but "
                              "SpecForge exports no draft head: reset it to vocab_size")
    nested = cfg["dflash_config"]
    return _shape(cfg, block_size=cfg["block_size"],
                  target_hidden_size=cfg.get("target_hidden_size") or cfg["hidden_size"],
                  target_layer_ids=list(nested["target_layer_ids"]),
                  num_target_layers=cfg.get("num_target_layers") or num_target_layers,
                  mask_token_id=nested["mask_token_id"])


def speculators_config(cfg: dict, num_target_layers: int) -> DFlashDrafterConfig:
    if cfg.get("speculators_model_type") != "dflash":
        raise PeerExportError(f"not a speculators DFlash checkpoint (speculators_model_type "
                              f"{cfg.get('speculators_model_type')!r})")
    layer = cfg["transformer_layer_config"]
    causal = [i for i, t in enumerate(layer.get("layer_types") or ["full_attention"] * layer["num_hidden_layers"])
              if t != "full_attention"]
    if causal and not cfg.get("sliding_window_non_causal"):
        raise PeerExportError(f"layers {causal} attend causally inside the block (speculators' default); this "
                              "project's drafter attends bidirectionally: train with --full-attention-indices "
                              "listing every layer (or --sliding-window-non-causal)")
    return _shape(layer, block_size=cfg["block_size"],
                  target_hidden_size=cfg.get("target_hidden_size") or layer["hidden_size"],
                  target_layer_ids=[i - 1 for i in cfg["aux_hidden_state_layer_ids"]],
                  num_target_layers=num_target_layers, mask_token_id=cfg["mask_token_id"])


READERS = {"specforge": specforge_config, "speculators": speculators_config}


def to_project(peer: str, src: str | Path, out: str | Path, *, num_target_layers: int,
               extra_config: dict | None = None) -> Path:
    """Write a peer's exported drafter at `src` as this project's export in `out` (float32 weights, the
    draft-vocabulary keys d2t + lm_head.weight kept, speculators' t2d dropped)."""
    src, out = Path(src), Path(out)
    if peer not in READERS:
        raise PeerExportError(f"unknown peer {peer!r}; use one of {sorted(READERS)}")
    cfg = json.loads((src / "config.json").read_text())
    config = READERS[peer](cfg, num_target_layers)
    # the drafter's own weights in float32; d2t and a draft head as written (a bf16 head is checked against the
    # target's rows in bf16 by DFlashDrafter.from_pretrained)
    tensors = {k: (v if k in ("d2t", "lm_head.weight") else v.float()).contiguous()
               for k, v in load_file(str(src / "model.safetensors")).items() if k != "t2d"}
    top = config.to_dict()
    if "d2t" in tensors:
        top["draft_vocab_size"] = len(tensors["d2t"])
    top.update(extra_config or {})
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_text(out / "config.json", json.dumps(top, indent=2))
    return out

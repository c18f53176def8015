"""The exported drafter folder (config.json + model.safetensors): the format serving engines load (docs/export.md),
written in one place apart from the model: the config.json keys, the tensor names, the draft vocabulary's d2t table,
and the older formats that still load. It imports nothing from models/drafter.py (whose save_pretrained,
from_pretrained, to_dict and from_dict delegate here): the drafter and its config class come as arguments.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import fields

import torch
from safetensors.torch import load_file
from torch import nn

from dflash_pipeline.runtime.files import save_safetensors, write_text
from dflash_pipeline.models.selector import PASS_THROUGH, SELECTOR_PREFIX, pass_through_tensors

log = logging.getLogger(__name__)
# <export>/gguf/: files derived from an export (models/llamacpp_engine.py write_gguf), cleared whenever the export is
# written again, so that no GGUF of an earlier training outlives it
GGUF_FOLDER = "gguf"


def config_json(config) -> dict:
    """The config.json that serving engines load for a DFlashDrafterConfig (docs/export.md); a weight-tied stack is
    written unrolled, a convolution drafter as DFlash2 (its selector keys come with the selector's tensors:
    export_tensors)."""
    dflash_config = {"mask_token_id": config.mask_token_id, "target_layer_ids": list(config.target_layer_ids)}
    if config.conv_kernel_size:
        dflash_config.update(conv_kernel_size=config.conv_kernel_size, conv_group_size=config.conv_group_size,
                             **PASS_THROUGH)
    return {
        "architectures": ["DFlash2DraftModel" if config.conv_kernel_size else "DFlashDraftModel"],
        "model_type": "qwen3",
        "num_hidden_layers": config.num_hidden_layers * config.layer_repeats,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None if config.rope_scaling is None else dict(config.rope_scaling),
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "target_hidden_size": config.target_hidden_size,
        "dflash_config": dflash_config,
        "hidden_act": "silu",
        "attention_bias": False,
    }


def trained_scales(model: nn.Module) -> dict:
    """The dflash_config keys that say what the drafter's inputs and logits were trained with, which engines would
    otherwise default: the scale of its input embeddings (the target's embedding module's: Gemma's sqrt(hidden), 1
    elsewhere; llama.cpp defaults to sqrt(hidden) for a Gemma target, vLLM's DFlash2 to 1) and its logits as the LM
    head gives them (output multiplier 1, no soft-capping: the drafter never applies the target's)."""
    scale = getattr(model.embed_tokens, "embed_scale", 1.0)
    return {"input_embedding_scale": float(scale), "output_multiplier": 1.0}


def config_from_json(config_cls, d: dict):
    """Inverse of config_json, building a `config_cls` (DFlashDrafterConfig); keys it does not know (e.g. the
    exporter's "pipeline" section) are ignored."""
    nested = d["dflash_config"]
    values = {f.name: d[f.name] for f in fields(config_cls)
              if f.name not in ("target_layer_ids", "mask_token_id", "rope_scaling", "attn_implementation",
                                "attention_chunk_mb", "layer_repeats", "conv_kernel_size", "conv_group_size")}
    conv = {k: nested[k] for k in ("conv_kernel_size", "conv_group_size") if k in nested}
    return config_cls(**values, rope_scaling=d.get("rope_scaling"), target_layer_ids=list(nested["target_layer_ids"]),
                      mask_token_id=nested["mask_token_id"], **conv)


def identity_convolution(config: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """What turns a DFlash export (config.json `config`) into a DFlash2 one that drafts the same: a one-tap convolution
    of one group per layer at the identity (GroupedConv's init) -> (tensors, dflash_config keys). Engines load a
    selector only as DFlash2, whose layers always convolve."""
    H, tensors = config["hidden_size"], {}
    for i in range(config["num_hidden_layers"]):
        for side in ("attention_conv", "mlp_conv"):
            tensors[f"layers.{i}.{side}.base_kernel"] = torch.ones(2, 1, H)
            tensors[f"layers.{i}.{side}.kernel_projection.weight"] = torch.zeros(2, H)
    return tensors, {"conv_kernel_size": 1, "conv_group_size": H}


def export_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors of model.safetensors and the top-level config.json keys of the engine format (docs/export.md) for a
    DFlashDrafter.

    Full vocabulary: the drafter's own weights only; engines reuse the target's embed_tokens and lm_head.
    Draft vocabulary (Vd < V), the reduced-vocabulary convention of vLLM's DFlash / EAGLE-3 loaders: also
    `lm_head.weight` (Vd, H), the target's LM-head rows the drafter was trained against, in the head's dtype;
    `d2t` (Vd,) int64 offsets, target id = draft id + d2t[draft id]; and config.json `draft_vocab_size` = Vd.
    A draft vocabulary that covers the whole target vocabulary is exported as the full vocabulary.
    DFlash2 (the convolution): also the selector that scores nothing (models/selector.py PASS_THROUGH), which a
    trained selector's export replaces. With a draft vocabulary it is written with `lm_head` + `d2t` as above,
    but vLLM 0.32's DFlash2 picks candidates from its draft head without d2t (docs/export.md): warned.
    """
    tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if k != "draft_to_target"}
    L, stack = len(model.layers), [k.split(".", 2)[1:] for k in tensors if k.startswith("layers.")]
    for r in range(1, model.config.layer_repeats):  # weight-tied depth, unrolled: pass r is layers r*L .. r*L+L-1
        for i, rest in stack:
            tensors[f"layers.{r * L + int(i)}.{rest}"] = tensors[f"layers.{i}.{rest}"].clone()
    ids = model.draft_to_target
    if model.config.conv_kernel_size:
        if ids is not None and len(ids) != model.config.vocab_size:
            log.warning("a DFlash2 drafter with a draft vocabulary: vLLM's DFlash2 (0.32) takes its candidates "
                        "from the draft head without mapping them through d2t, so it would draft wrong ids; "
                        "train without trainer.draft_vocab_size to serve it there (docs/export.md)")
        tensors.update(pass_through_tensors(model.config.vocab_size, model.config.hidden_size))
    if ids is None or len(ids) == model.config.vocab_size:
        return tensors, {}
    if model.lm_head.bias is not None:
        raise ValueError("the target's LM head has a bias; the engines' draft-vocabulary lm_head has none")
    ids = ids.cpu()
    tensors["lm_head.weight"] = model.lm_head.weight.detach()[ids.to(model.lm_head.weight.device)].cpu().contiguous()
    tensors["d2t"] = ids - torch.arange(len(ids))
    return tensors, {"draft_vocab_size": len(ids)}


def save_export(model: nn.Module, path: str, extra_config: dict | None = None):
    """Write a DFlashDrafter's config.json and model.safetensors in the engine format of `export_tensors`, each
    atomically."""
    os.makedirs(path, exist_ok=True)
    shutil.rmtree(os.path.join(path, GGUF_FOLDER), ignore_errors=True)
    tensors, top_level = export_tensors(model)
    config = config_json(model.config)
    config["dflash_config"].update(trained_scales(model))
    config.update(top_level)
    config.update(extra_config or {})
    weights_file, config_file = os.path.join(path, "model.safetensors"), os.path.join(path, "config.json")
    save_safetensors(tensors, weights_file, metadata={"format": "pt"})
    write_text(config_file, json.dumps(config, indent=2))


def load_export(drafter_cls, config_cls, path: str, embed_tokens: nn.Embedding, lm_head: nn.Linear):
    """Load a save_export folder (safetensors only) as a `drafter_cls` (DFlashDrafter) of a `config_cls`
    (DFlashDrafterConfig); every key must match exactly. Weights are copied into a float32 model: cast with
    .to(dtype) afterwards.

    A draft-vocabulary export (`d2t` + `lm_head.weight`) restores the draft vocabulary; its lm_head must be the
    given target's rows (compared in the narrower of the two dtypes), else the drafter was trained against
    another target. Older exports that stored the ids as `draft_to_target` still load."""
    with open(os.path.join(path, "config.json")) as f:
        config_dict = json.load(f)
    model = drafter_cls(config_from_json(config_cls, config_dict), embed_tokens, lm_head)
    # a DFlash2 export's selector tensors are the selector's (load_selector), not the drafter's
    tensors = {k: v for k, v in load_file(os.path.join(path, "model.safetensors")).items()
               if not k.startswith(SELECTOR_PREFIX)}
    own = set(model.state_dict())
    vocab = model.config.vocab_size
    if config_dict.get("draft_vocab_size", vocab) != vocab:
        vocab_keys = {"d2t", "lm_head.weight"}
    elif config_dict["dflash_config"].get("draft_vocab_size") is not None:
        vocab_keys = {"draft_to_target"}  # the format before d2t
    else:
        vocab_keys = set()
    expected = own | vocab_keys
    missing, unexpected = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(f"{path}/model.safetensors does not match the drafter: missing keys {missing}, "
                         f"unexpected keys {unexpected}")
    if "d2t" in vocab_keys:
        d2t, head = tensors["d2t"], tensors["lm_head.weight"]
        if d2t.shape != (config_dict["draft_vocab_size"],) or head.shape != (len(d2t), model.config.hidden_size):
            raise ValueError(f"{path}: d2t {tuple(d2t.shape)} / lm_head.weight {tuple(head.shape)} do not match "
                             f"draft_vocab_size {config_dict['draft_vocab_size']}")
        ids = torch.arange(len(d2t)) + d2t.long()
        model.set_draft_vocab(ids)
        rows = lm_head.weight.detach()[ids.to(lm_head.weight.device)].cpu()
        dtype = head.dtype if head.element_size() <= rows.element_size() else rows.dtype
        if not torch.equal(head.to(dtype), rows.to(dtype)):
            raise ValueError(f"{path}: lm_head.weight is not the given target's LM-head rows of the draft "
                             "vocabulary; the drafter was exported for another target")
    elif vocab_keys:
        model.set_draft_vocab(tensors["draft_to_target"])
    state = {k: tensors[k] for k in own}
    if model.draft_to_target is not None:
        state["draft_to_target"] = model.draft_to_target
    model.load_state_dict(state, strict=True)
    return model

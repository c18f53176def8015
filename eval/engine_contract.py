"""The served drafter's contract: the keys an engine reads from an export (taps, MASK token, RoPE, shapes, the draft
vocabulary, the embedding scale), read from the export as each engine reads them and from the drafter the own loop
runs, and the keys that differ between the two: what a failed parity gate names (eval/gates.py)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from dflash_pipeline.models.export import trained_scales

# What the engine reads from an export, as dotted config.json keys; "d2t" is the draft-vocabulary map tensor.
CONTRACT = ("dflash_config.target_layer_ids", "dflash_config.mask_token_id", "rope_theta", "rope_scaling",
            "num_hidden_layers", "hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads",
            "draft_vocab_size", "d2t", "max_position_embeddings")
# Keys the engine honours and the own loop does not run (its drafter is non-causal full attention): any value that
# makes the engine's drafter causal or windowed is a mismatch by itself (a window size alone windows nothing).
ENGINE_ONLY = ("is_causal", "dflash_config.causal", "layer_types", "use_swa", "dflash_config.use_swa")
WHAT = {
    "dflash_config.target_layer_ids": "the tapped target layers (layer i = hidden_states[i + 1])",
    "dflash_config.mask_token_id": "the MASK token of the drafted slots",
    "rope_theta": "RoPE base", "rope_scaling": "RoPE scaling",
    "d2t": "the draft-vocabulary map (target id = draft id + d2t[draft id])",
    "draft_vocab_size": "the draft vocabulary size",
    "is_causal": "the causal flag (DFlash drafts attend bidirectionally)",
    "dflash_config.causal": "the causal flag (DFlash drafts attend bidirectionally)",
    "layer_types": "sliding-window layers", "use_swa": "sliding-window attention",
    "dflash_config.use_swa": "sliding-window attention",
    "input_embedding_scale": "the scale of the drafter's input embeddings (dflash_config; llama.cpp reads it for "
                             "DFlash and DFlash2, absent: sqrt(hidden) for a Gemma target, else 1; vLLM's DFlash2 "
                             "reads it, absent: 1; vLLM's DFlash reads none: 1)",
}
SCALE = "input_embedding_scale"  # the export's (dflash_config, top level, else 1); the own loop's embedding's


def _get(config: dict, dotted: str):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def export_contract(folder: Path, engine: str = "vllm") -> dict:
    """The contract keys of an exported drafter folder as `engine` (vllm, llamacpp) reads them (d2t as a digest of
    its values). vLLM's DFlash (not DFlash2) reads no embedding scale: it drafts from the target's unscaled
    embeddings, so a Gemma target's drafter (trained with sqrt(hidden)) differs there in this key."""
    config = json.loads((Path(folder) / "config.json").read_text())
    out = {k: _get(config, k) for k in CONTRACT + ENGINE_ONLY if k != "d2t"}
    scale = _get(config, f"dflash_config.{SCALE}")
    out[SCALE] = float(scale if scale is not None else config.get(SCALE, 1.0))
    if engine == "vllm" and config.get("architectures") == ["DFlashDraftModel"]:
        out[SCALE] = 1.0
    with safe_open(str(Path(folder) / "model.safetensors"), "pt") as f:
        out["d2t"] = (hashlib.sha256(f.get_tensor("d2t").long().numpy().tobytes()).hexdigest()[:16]
                      if "d2t" in f.keys() else None)
    return out


def drafter_contract(drafter) -> dict:
    """The same keys for the drafter the own loop runs (what it was trained as)."""
    config = drafter.config.to_dict()
    out = {k: _get(config, k) for k in CONTRACT + ENGINE_ONLY if k != "d2t"}
    out[SCALE] = trained_scales(drafter)[SCALE]  # Gemma's scaled embedding module: sqrt(hidden)
    ids = drafter.draft_to_target
    full = ids is None or len(ids) == drafter.config.vocab_size
    out["draft_vocab_size"] = None if full else len(ids)
    out["d2t"] = None if full else hashlib.sha256(
        (ids.cpu().long() - torch.arange(len(ids))).numpy().tobytes()).hexdigest()[:16]
    return out


def likely_keys(served: dict, own: dict) -> list[str]:
    """Contract keys that differ between the export the engine served and the drafter the own loop ran, then keys
    only the engine honours that make its drafter something the own loop is not (causal, windowed)."""
    differ = [k for k in CONTRACT + (SCALE,) if served.get(k) != own.get(k)]
    engine_only = [k for k in ENGINE_ONLY if served.get(k) not in (None, False, [], 0)
                   and not (k == "layer_types" and all(t == "full_attention" for t in served[k]))]
    return differ + engine_only

"""What differs between target families, read the same way everywhere, and the tap contract: the text decoder's
config (image-text wrappers), per-layer config values (Gemma 4), the final norm by the families' names, the output
transforms of the logits (Granite, Falcon-H1, Gemma), and which decoder layers are tapped and how they are counted.
"""
from __future__ import annotations

import torch

from dflash_pipeline.models.errors import TargetError

try:  # transformers' per-layer configurations (Gemma 4): a global read of a per-layer value raises this
    from transformers.integrations.heterogeneity.configuration_utils import AmbiguousGlobalPerLayerAttributeError
except ImportError:  # older transformers: no per-layer configurations
    AmbiguousGlobalPerLayerAttributeError = AttributeError


def text_config(model):
    """The config of the text decoder: the model's own, or an image-text wrapper's text_config."""
    return model.config.get_text_config(decoder=True)


def config_value(config, name: str, default=None):
    """A value of a target's config. Where it is per layer (Gemma 4's head_dim, ...), the first full-attention
    layer's: the drafter's attention is full attention."""
    try:
        return getattr(config, name, default)
    except AmbiguousGlobalPerLayerAttributeError:
        types = list(getattr(config, "layer_types", None) or [])
        layer = types.index("full_attention") if "full_attention" in types else 0
        return getattr(config.per_layer_config[layer], name, default)


FINAL_NORMS = ("norm", "norm_f", "final_layernorm", "embedding_norm")  # Llama-likes, Nemotron-H, Falcon-H1, LFM2


def final_norm(model) -> torch.nn.Module:
    """The target's final norm (its output is the last hidden state the LM head reads), by the families' names."""
    for name in FINAL_NORMS:
        norm = getattr(model.model, name, None)
        if norm is not None:
            return norm
    raise TargetError(f"{type(model).__name__}: no final norm among {', '.join(FINAL_NORMS)} of its decoder "
                      "(models/families.py FINAL_NORMS)")


def output_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The target's logits from its final hidden states as its own forward computes them: the LM head, then the
    family's output transforms (Granite's logits_scaling, Falcon-H1's lm_head_multiplier, Gemma's final soft-capping).
    Greedy choices do not change with them; distributions (stored top-k log-probs, sampling) do."""
    config = text_config(model)
    logits = model.lm_head(hidden)
    if getattr(config, "logits_scaling", None):
        logits = logits / config.logits_scaling
    multiplier = getattr(getattr(model, "model", None), "lm_head_multiplier", None)
    if multiplier is not None:
        logits = logits * multiplier
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def tapped(hidden_states, layer_ids: list[int]) -> torch.Tensor:
    """The tapped layers' outputs, concatenated in layer order: (..., T, n*H). Layer i is the output of decoder layer
    i, transformers' hidden_states[i + 1] (hidden_states[0] is the embeddings); no taps gives width 0. The one place
    this contract is written: datasets, the decoding loop and exports all count layers this way."""
    if not layer_ids:
        return hidden_states[-1][..., :0]
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def default_layer_ids(num_layers: int, num_taps: int) -> list[int]:
    """DFlash spacing: one tap in the middle, else evenly from layer 1 to layer L-3 (docs/methods.md,
    'Tapped layers')."""
    if num_taps == 1:
        return [num_layers // 2]
    ids = [round(1 + i * (num_layers - 4) / (num_taps - 1)) for i in range(num_taps)]
    if (len(set(ids)) < num_taps or min(ids) < 0) and num_taps <= num_layers:  # too shallow: spread over all layers
        ids = [round(i * (num_layers - 1) / (num_taps - 1)) for i in range(num_taps)]
    return ids


def resolve_layer_ids(layer_ids: list[int] | None, num_taps: int, num_layers: int) -> list[int]:
    """The tapped layers, validated against the target. Layer i is the output of decoder layer i."""
    ids = list(layer_ids) if layer_ids is not None else default_layer_ids(num_layers, num_taps)
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise TargetError(
            f"teacher.layer_ids {bad} out of range: the target has {num_layers} layers (valid ids 0..{num_layers - 1})"
        )
    if len(set(ids)) != len(ids) or ids != sorted(ids):
        raise TargetError(f"teacher.layer_ids {ids} must be strictly increasing")
    return ids

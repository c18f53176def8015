"""DFlash block drafter (docs/methods.md; its export format: models/export.py, docs/export.md), in reading order:
config, attention kernels, attention, layer, model. Norm, rotary embedding and MLP are transformers' Qwen3 modules;
only the attention over [context | block] is written here.

The drafter drafts a whole block of B tokens in one forward. Its queries are the block tokens
([anchor, MASK x (B-1)], embedded with the target's frozen table); every layer's keys/values are its own k_proj/v_proj
applied to the fused target context AND to the block, concatenated [context | block]. The block attends to itself
bidirectionally. The final hidden goes through the target's frozen LM head.

DFlash2 (`conv_kernel_size` > 0) wraps each layer's attention and MLP in a `GroupedConv`: a convolution over the
block's positions, causal within the block, that gives a drafted position the block tokens before it in a fixed
order (the serial dependence a bidirectional block lacks). Exported as `DFlash2DraftModel` (docs/export.md).

Two paths share the same layers:
- `forward_packed`: training; all anchor blocks of a sequence in one forward, separated by a `PackedMask` (who sees
  what, never built as one dense matrix unless a kernel asks for it).
- `forward_step`: inference; the projected context K/V live in a `DrafterCache`, the block's own K/V are not kept.

Shapes: Bc/Bt batch, Tc context length, Nb blocks per sequence, B block size, H hidden, Ht target hidden,
n tapped target layers, h heads, hk kv heads, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, repeat_kv,
                                                      rotate_half)

from dflash_pipeline.models import export


@dataclass
class DFlashDrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's
    block_size: int
    target_hidden_size: int
    target_layer_ids: list[int]  # tapped target layers (n = len); layer i = transformers' hidden_states[i + 1]
    num_target_layers: int  # the target's total layer count
    mask_token_id: int
    rope_scaling: dict | None = None  # the target's rope parameters besides rope_theta (rope_type, factor, ...)
    attn_implementation: str = "sdpa"  # a key of ATTENTION_FUNCTIONS; a runtime choice, not exported
    # sdpa in training: the packed mask is built this many MB at a time (rows of blocks), each slice's attention
    # recomputed in the backward instead of keeping its mask; 0 = the whole dense mask at once. Not exported.
    attention_chunk_mb: float = field(default=64.0, compare=False)  # a runtime choice: not part of what is equal
    # Weight-tied depth: the block passes through the layer stack this many times (the same weights each time; the
    # context K/V of a layer are the same on every pass, so they are projected and cached once). Exported unrolled,
    # as num_hidden_layers x layer_repeats layers of copied weights: engines load an ordinary deeper drafter.
    layer_repeats: int = 1
    # DFlash2's grouped dynamic convolution (GroupedConv): taps over the block's positions, 0 = off (plain DFlash);
    # channels share a per-token coefficient in groups of conv_group_size
    conv_kernel_size: int = 0
    conv_group_size: int = 32

    def __post_init__(self):
        attention_function(self.attn_implementation)
        if self.attention_chunk_mb < 0:
            raise ValueError(f"attention_chunk_mb must be >= 0 (0: the whole mask at once), got {self.attention_chunk_mb}")
        if self.conv_kernel_size < 0:
            raise ValueError(f"conv_kernel_size must be 0 (off) or a number of taps, got {self.conv_kernel_size}")
        if self.conv_kernel_size and (self.conv_group_size < 1 or self.hidden_size % self.conv_group_size):
            raise ValueError(f"conv_group_size {self.conv_group_size} must divide the drafter's hidden_size "
                             f"{self.hidden_size} (drafter.conv_group_size)")
        if self.layer_repeats < 1:
            raise ValueError(f"layer_repeats must be at least 1, got {self.layer_repeats}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one tapped target layer")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads {self.num_key_value_heads}")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise ValueError(f"target_layer_ids {bad} outside the target's {self.num_target_layers} layers")

    def to_dict(self) -> dict:
        """The config.json keys serving engines load that the config holds (models/export.py config_json,
        docs/export.md); save_pretrained adds those of the model (the trained embedding scale, a draft vocabulary)."""
        return export.config_json(self)

    @classmethod
    def from_dict(cls, d: dict) -> DFlashDrafterConfig:
        """Inverse of to_dict (models/export.py config_from_json)."""
        return export.config_from_json(cls, d)

    def qwen3_config(self) -> Qwen3Config:
        """The transformers config that builds the Qwen3 modules (MLP, rotary with the target's rope parameters)."""
        return Qwen3Config(
            hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings, vocab_size=self.vocab_size, hidden_act="silu",
            rope_parameters={"rope_type": "default", **(self.rope_scaling or {}), "rope_theta": self.rope_theta})


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on one tensor x (Bt, heads, T, D) with cos/sin (Bt, T, D): transformers' apply_rotary_pos_emb, which
    rotates a (q, k) pair, for the context keys that have no queries beside them."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class PackedMask:
    """Who sees what in a packed training forward (docs/methods.md, 'Packed training'), kept as the anchors rather
    than as a (Nb*B) x (Tc + Nb*B) matrix: a block token sees context t iff t < its anchor (and t is valid), sees its
    whole block, and never another block; a padded block sees only itself, so no row is empty (an empty row would
    make SDPA return NaN). Kernels ask for what they run on: `dense` rows (eager, sdpa) or a flex `block_mask`.

    anchor_pos (Bc, Nb); context_valid (Bc, Tc) marks real (not padded) context tokens; anchor_valid (Bc, Nb) marks
    real blocks; chunk_mb: the most MB of dense mask the sdpa kernel builds at a time (0: all at once).
    """

    def __init__(self, anchor_pos: torch.Tensor, num_context: int, block_size: int,
                 context_valid: torch.Tensor | None = None, anchor_valid: torch.Tensor | None = None,
                 chunk_mb: float = 0.0):
        self.anchor_pos, self.num_context, self.block_size = anchor_pos, num_context, block_size
        self.context_valid, self.anchor_valid, self.chunk_mb = context_valid, anchor_valid, chunk_mb
        self._block_mask = None

    @property
    def num_blocks(self) -> int:
        return self.anchor_pos.shape[1]

    @property
    def num_keys(self) -> int:
        return self.num_context + self.num_blocks * self.block_size

    def dense(self, first: int = 0, last: int | None = None, context: int | None = None) -> torch.Tensor:
        """The rows of blocks first..last-1 over all keys: (Bc, 1, (last-first)*B, Tc + Nb*B) bool, True = may attend.
        With `context`: over the first `context` context keys and these blocks' own keys only,
        (Bc, 1, (last-first)*B, context + (last-first)*B): all a slice of blocks can see, when context >= its
        largest anchor."""
        last = self.num_blocks if last is None else last
        anchor, device = self.anchor_pos[:, first:last], self.anchor_pos.device
        width = self.num_context if context is None else context
        sees_context = torch.arange(width, device=device) < anchor[..., None]  # (Bc, n, width)
        if self.context_valid is not None:
            sees_context = sees_context & self.context_valid[:, None, :width].bool()
        if self.anchor_valid is not None:
            sees_context = sees_context & self.anchor_valid[:, first:last, None].bool()
        sees_context = sees_context.repeat_interleave(self.block_size, dim=1)  # (Bc, n*B, width)
        query_block = torch.arange(first, last, device=device).repeat_interleave(self.block_size)
        key_block = query_block if context is not None else \
            torch.arange(self.num_blocks, device=device).repeat_interleave(self.block_size)
        sees_block = (query_block[:, None] == key_block[None, :]).expand(anchor.shape[0], -1, -1)
        return torch.cat([sees_context, sees_block], dim=-1)[:, None]

    def row_chunks(self) -> list[tuple[int, int]]:
        """(first, last) block ranges whose own mask (bool + the float copy SDPA makes, over the context and their
        own blocks) fits chunk_mb; one range, all blocks, when the whole mask does."""
        Bc, B, Tc, Nb = self.anchor_pos.shape[0], self.block_size, self.num_context, self.num_blocks
        budget = self.chunk_mb * 2**20
        if budget <= 0 or 5 * Bc * Nb * B * self.num_keys <= budget:
            return [(0, Nb)]
        a, b = 5 * Bc * B * B, 5 * Bc * B * Tc  # bytes of n blocks' rows: a n^2 + b n
        step = max(1, int((-b + (b * b + 4 * a * budget) ** 0.5) / (2 * a)))
        return [(j, min(j + step, Nb)) for j in range(0, Nb, step)]

    def sees(self, b, q, kv):
        """The same rule as `dense`, for one (query, key) index pair of sequence b (flex_attention's mask_mod)."""
        Tc, B = self.num_context, self.block_size
        block = q // B
        sees = kv < self.anchor_pos[b, block]
        if self.context_valid is not None:
            sees = sees & self.context_valid[b, kv.clamp(max=Tc - 1)].bool()
        if self.anchor_valid is not None:
            sees = sees & self.anchor_valid[b, block].bool()
        return torch.where(kv < Tc, sees, (kv - Tc) // B == block)

    def block_mask(self):
        """flex_attention's BlockMask (built once per forward, shared by every layer): the kernel skips the tiles no
        query sees. Built uncompiled, so `sees` runs once over every (query, key) pair: dense (Bc, 1, Nb*B, Tc + Nb*B)
        bools on the device, freed once the block mask is made (sdpa's whole-mask path builds that matrix, and SDPA a
        float copy, in every layer). Compiled (torch.compile(create_block_mask); `_compile=True` is deprecated in
        torch 2.13) they would not exist, but `sees` reads Tc and B as Python ints, so every new context length
        recompiles (2.5-37 s each on a CPU)."""
        if self._block_mask is None:
            from torch.nn.attention.flex_attention import create_block_mask

            Bc = self.anchor_pos.shape[0]
            self._block_mask = create_block_mask(lambda b, h, q, kv: self.sees(b, q, kv), Bc, None,
                                                 self.num_blocks * self.block_size, self.num_keys,
                                                 device=self.anchor_pos.device)
        return self._block_mask


def packed_attention_mask(anchor_pos: torch.Tensor, num_context: int, block_size: int,
                          context_valid: torch.Tensor | None = None,
                          anchor_valid: torch.Tensor | None = None) -> torch.Tensor:
    """The whole training mask of Nb packed blocks at once: (Bc, Nb*B, Tc + Nb*B) bool (PackedMask.dense)."""
    return PackedMask(anchor_pos, num_context, block_size, context_valid, anchor_valid).dense()[:, 0]


def eager_attention(q, k, v, mask: PackedMask | None):
    """The plain path the kernels are tested against: q (Bt, h, Q, D); k, v (Bt, hk, S, D); mask a PackedMask, or
    None = all visible. Softmax in float32. Returns (Bt, h, Q, D)."""
    groups = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, groups), repeat_kv(v, groups)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5  # (Bt, h, Q, S)
    if mask is not None:
        scores = scores.masked_fill(~mask.dense(), torch.finfo(scores.dtype).min)
    return scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v


def sdpa_attention(q, k, v, mask: PackedMask | None):
    """torch's fused kernels, same arguments. K/V heads are repeated here: SDPA's own GQA (enable_gqa) falls back to
    the math kernel on CUDA when a mask is given.

    A packed mask larger than its budget (PackedMask.row_chunks) goes slice by slice of blocks, each slice attending
    to the context up to its largest anchor and to its own blocks only, so time and memory grow with anchors x
    context instead of anchors x (context + anchors); with gradients, each slice is recomputed in the backward
    (torch.utils.checkpoint), so no slice's mask, keys or float mask copy outlive its own forward."""
    groups = q.shape[1] // k.shape[1]
    chunks = [(0, 0)] if mask is None else mask.row_chunks()
    if len(chunks) == 1:
        return F.scaled_dot_product_attention(q, repeat_kv(k, groups), repeat_kv(v, groups),
                                              attn_mask=None if mask is None else mask.dense())
    B, Tc = mask.block_size, mask.num_context

    def rows(first, last, q_rows, k, v):
        seen = int(mask.anchor_pos[:, first:last].max().clamp(min=0, max=Tc))  # no block sees context past it
        keys = torch.cat([k[:, :, :seen], k[:, :, Tc + first * B:Tc + last * B]], dim=2)
        values = torch.cat([v[:, :, :seen], v[:, :, Tc + first * B:Tc + last * B]], dim=2)
        return F.scaled_dot_product_attention(q_rows, repeat_kv(keys, groups), repeat_kv(values, groups),
                                              attn_mask=mask.dense(first, last, context=seen))

    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    outs = []
    for first, last in chunks:
        args = (first, last, q[:, :, first * B:last * B], k, v)
        outs.append(checkpoint(rows, *args, use_reentrant=False) if grad else rows(*args))
    return torch.cat(outs, dim=2)


_compiled_flex = None


def flex_attention(q, k, v, mask: PackedMask | None):
    """torch's flex_attention with the packed BlockMask: fused and block-sparse where torch compiles it (CUDA),
    forward and backward. On a CPU torch runs it forward only (no gradients), so training there takes sdpa. The
    cached inference step (no mask) is sdpa's."""
    if mask is None:
        return sdpa_attention(q, k, v, None)
    from torch.nn.attention import flex_attention as flex

    if q.device.type == "cpu" and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        raise ValueError("attn_implementation=flex has no backward on a CPU in this torch; train with "
                         "drafter.attn_implementation=sdpa there")
    global _compiled_flex
    run = flex.flex_attention
    if q.device.type == "cuda":
        _compiled_flex = _compiled_flex or torch.compile(flex.flex_attention, dynamic=True)
        run = _compiled_flex
    return run(q, k, v, block_mask=mask.block_mask(), enable_gqa=True)


# The one lookup of the attention kernel (config.attn_implementation). A new kernel must equal eager on the packed
# mask, the cached step and the gradients (tests/test_drafter_modules.py; flex's gradients on a GPU only:
# scripts/gpu_check.py).
ATTENTION_FUNCTIONS = {"eager": eager_attention, "sdpa": sdpa_attention, "flex": flex_attention}


def attention_function(name: str):
    if name not in ATTENTION_FUNCTIONS:
        raise ValueError(f"unknown attn_implementation {name!r}; use one of {sorted(ATTENTION_FUNCTIONS)}")
    return ATTENTION_FUNCTIONS[name]


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys/values are [context | block]: the same k_proj/v_proj serve both."""

    def __init__(self, config: DFlashDrafterConfig):
        super().__init__()
        self.config = config
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                            config.head_dim)
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, config.rms_norm_eps)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Keys (k_norm, then RoPE) and values of x (Bt, T, H) -> two (Bt, hk, T, D). Used for context and block."""
        Bt, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(Bt, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(Bt, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return rotate(k, cos, sin), v

    def forward(self, x, context_k, context_v, cos, sin, mask=None) -> torch.Tensor:
        """x (Bt, Q, H) normed block hidden; context_k/v (Bt, hk, Tc, D); cos/sin (Bt, Q, D) at the block positions;
        mask a PackedMask over [context | block], or None = all visible. Returns (Bt, Q, H)."""
        Bt, Q, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(Bt, Q, self.num_heads, self.head_dim)).transpose(1, 2)
        q = rotate(q, cos, sin)  # (Bt, h, Q, D)
        block_k, block_v = self.project_kv(x, cos, sin)
        k = torch.cat([context_k, block_k], dim=2)  # (Bt, hk, Tc + Q, D)
        v = torch.cat([context_v, block_v], dim=2)
        out = attention_function(self.config.attn_implementation)(q, k, v, mask)  # (Bt, h, Q, D)
        return self.o_proj(out.transpose(1, 2).reshape(Bt, Q, self.num_heads * self.head_dim))


class GroupedConv(nn.Module):
    """DFlash2's grouped dynamic convolution around one sublayer, over the positions of each block (the DFlash2
    checkpoint's `attention_conv` / `mlp_conv`). Output at block position p, channel c in group g:

        sum over taps t with t <= p of (base_kernel[side, t, c] + delta[p, side, t, g]) * x[p - t, c]

    tap 0 the position itself; a position never sees a later one or another block. The per-token deltas are
    `kernel_projection` of the sublayer's input, both sides' from that one input: side 0 convolves the input
    (`prepare`), side 1 the sublayer's output (`finish`). Starts as the identity (base tap 0 = 1, the rest and the
    projection 0), so a convolution drafter begins as the DFlash drafter it wraps.

    Blocks are laid out one after another along the sequence axis, starting at 0: position = index % block_size.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.num_groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.num_groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def convolve(self, x: torch.Tensor, delta: torch.Tensor, side: int) -> torch.Tensor:
        """x (..., T, H) blocks in a row; delta (..., T, taps, G) -> (..., T, H)."""
        T = x.shape[-2]
        xs = x.unflatten(-1, (self.num_groups, self.group_size))  # (..., T, G, gs)
        base = self.base_kernel[side].view(self.kernel_size, self.num_groups, self.group_size)
        out = (base[0] + delta[..., 0, :, None]) * xs
        position = torch.arange(T, device=x.device) % self.block_size
        for t in range(1, min(self.kernel_size, T)):
            shifted = F.pad(xs[..., :-t, :, :], (0, 0, 0, 0, t, 0))  # x[p - t] at p (zeros before the row's start)
            seen = (position >= t).view(T, 1, 1).to(x.dtype)  # not across a block's start
            out = out + (base[t] + delta[..., t, :, None]) * shifted * seen
        return out.flatten(-2)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's input x (..., T, H) -> (x convolved, the output side's deltas (..., T, taps, G))."""
        delta = self.kernel_projection(x).unflatten(-1, (2, self.kernel_size, self.num_groups))
        return self.convolve(x, delta[..., 0, :, :], 0), delta[..., 1, :, :]

    def finish(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return self.convolve(y, delta, 1)


class DFlashDecoderLayer(nn.Module):
    """Pre-norm layer. The context is not normed here: it was normed once by hidden_norm and enters as K/V only.
    DFlash2: the block's hidden goes through a GroupedConv before and after each sublayer (the context does not)."""

    def __init__(self, config: DFlashDrafterConfig):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Qwen3MLP(config.qwen3_config())
        if config.conv_kernel_size:
            conv = (config.hidden_size, config.conv_kernel_size, config.conv_group_size, config.block_size)
            self.attention_conv, self.mlp_conv = GroupedConv(*conv), GroupedConv(*conv)
        else:
            self.attention_conv = self.mlp_conv = None

    def forward(self, x, context_k, context_v, cos, sin, mask=None) -> torch.Tensor:
        if self.attention_conv is None:
            x = x + self.self_attn(self.input_layernorm(x), context_k, context_v, cos, sin, mask)
            return x + self.mlp(self.post_attention_layernorm(x))  # (Bt, Q, H)
        h, delta = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, context_k, context_v, cos, sin, mask), delta)
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), delta)


class DrafterCache:
    """Per-layer context K/V (after k_norm and RoPE), each (Bt, hk, Tc, D). Holds context only, never a block."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def num_tokens(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Add the new context K/V of one layer; returns the layer's whole cached K/V."""
        if self.keys[layer] is not None:
            k, v = torch.cat([self.keys[layer], k], dim=2), torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def crop(self, n: int):
        """Keep the first n context tokens (rollback)."""
        for i, k in enumerate(self.keys):
            if k is not None:
                self.keys[i], self.values[i] = k[:, :, :n], self.values[i][:, :, :n]


class DFlashDrafter(nn.Module):
    """The drafter. embed_tokens and lm_head are the target's own modules: frozen, shared, and held outside the
    module tree (a plain tuple), so they are not in parameters() or state_dict() and are never saved.

    Device moves (.to(device), .cuda(), ...) carry them along, since target and drafter must share a device; dtype
    casts do not touch them (the target keeps its dtype): embeddings are cast to the drafter's dtype on the way in,
    hidden states to the LM head's dtype on the way out.
    """

    def __init__(self, config: DFlashDrafterConfig, embed_tokens: nn.Embedding, lm_head: nn.Linear):
        super().__init__()
        if embed_tokens.embedding_dim != config.hidden_size or lm_head.in_features != config.hidden_size:
            raise ValueError("the target's embed_tokens/lm_head width must equal the drafter hidden_size "
                             f"{config.hidden_size}")
        if lm_head.out_features != config.vocab_size:
            raise ValueError(f"lm_head has {lm_head.out_features} rows, config.vocab_size is {config.vocab_size}")
        self.config = config
        embed_tokens.requires_grad_(False)
        lm_head.requires_grad_(False)
        self._target_modules = (embed_tokens, lm_head)
        # Outside the module tree as well: a dtype cast must not round its float32 frequencies (bf16 inv_freq would
        # shift positions); device moves carry it along (_apply).
        self._rotary = (Qwen3RotaryEmbedding(config.qwen3_config()),)
        n = len(config.target_layer_ids)
        self.fc = nn.Linear(n * config.target_hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.register_buffer("draft_to_target", None)  # (Vd,) target ids of the draft vocabulary; exported as d2t
        # training memory (trainer.activation_checkpointing): each layer keeps its input only, recomputing the rest in
        # the backward (about one more forward of the layers)
        self.activation_checkpointing = False
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module):  # apply() visits children first: a GroupedConv resets its projection after
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, Qwen3RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, GroupedConv):
            module.reset_parameters()

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._target_modules[0]

    @property
    def lm_head(self) -> nn.Linear:
        return self._target_modules[1]

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        device = self.norm.weight.device
        for module in (*self._target_modules, *self._rotary):
            module.to(device)
        return self

    # ---- vocabulary ----

    def set_draft_vocab(self, token_ids: torch.Tensor):
        """Restrict logits to these target token ids (Vd,), distinct: fewer LM-head rows, the main training cost."""
        ids = token_ids.detach().to(device=self.norm.weight.device, dtype=torch.long).clone()
        if ids.ndim != 1 or ids.numel() == 0 or ids.unique().numel() != ids.numel():
            raise ValueError("the draft vocabulary must be a non-empty 1-D tensor of distinct target token ids")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise ValueError(f"draft vocabulary ids must lie in 0 .. {self.config.vocab_size - 1}")

        self.draft_to_target = ids

    def to_target_ids(self, idx: torch.Tensor) -> torch.Tensor:
        """Map logit column indices to target token ids (identity with the full vocabulary)."""
        return idx if self.draft_to_target is None else self.draft_to_target[idx]

    def target_to_column(self) -> torch.Tensor:
        """(V,) logit column of each target id; -1 for ids outside the draft vocabulary (identity without one)."""
        device = self.norm.weight.device
        if self.draft_to_target is None:
            return torch.arange(self.config.vocab_size, device=device)
        col = torch.full((self.config.vocab_size,), -1, dtype=torch.long, device=device)
        col[self.draft_to_target] = torch.arange(len(self.draft_to_target), device=device)
        return col

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (..., H), as returned by forward_* (final norm applied) -> logits (..., V) or (..., Vd)."""
        weight, bias = self.lm_head.weight, self.lm_head.bias
        if self.draft_to_target is not None:
            weight = weight[self.draft_to_target]
            bias = None if bias is None else bias[self.draft_to_target]
        # one (rows, H) @ (H, V) product: a strided 3-D input (training's hidden[keep][:, 1:]) would make F.linear
        # broadcast the head into a batched matmul, several times slower forward + backward on a CPU
        # (docs/results/peers.md)
        flat = hidden.reshape(-1, hidden.shape[-1]).to(weight.dtype)
        return F.linear(flat, weight, bias).view(*hidden.shape[:-1], weight.shape[0])

    # ---- forward paths ----

    def set_attn_implementation(self, name: str):
        """Switch the attention kernel (a key of ATTENTION_FUNCTIONS), e.g. after from_pretrained; weights unchanged."""
        attention_function(name)
        self.config.attn_implementation = name

    def fuse_context(self, features: torch.Tensor) -> torch.Tensor:
        """Tapped target features (..., T, n*Ht) -> fused context (..., T, H)."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(ids).to(self.fc.weight.dtype)

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (Bt, T, D) in the drafter's dtype for integer positions (Bt, T): the target's RoPE, scaling
        included, from float32 frequencies."""
        return self._rotary[0](self.fc.weight, positions)

    def forward_packed(self, features: torch.Tensor, block_ids: torch.Tensor, anchor_pos: torch.Tensor,
                       context_valid: torch.Tensor | None = None,
                       anchor_valid: torch.Tensor | None = None) -> torch.Tensor:
        """Training: all Nb blocks of each sequence in ONE forward.

        features (Bc, Tc, n*Ht), context token t at position t; block_ids (Bc, Nb, B); anchor_pos (Bc, Nb), block token
        k at position anchor + k; context_valid (Bc, Tc) and anchor_valid (Bc, Nb) bool for padding (outputs of padded
        blocks are meaningless). Returns the post-final-norm hidden (Bc, Nb, B, H); apply `logits` to it.
        """
        Bc, Nb, B = block_ids.shape
        Tc = features.shape[1]
        context = self.fuse_context(features)  # (Bc, Tc, H)
        context_pos = torch.arange(Tc, device=features.device).expand(Bc, Tc)
        block_pos = (anchor_pos[..., None] + torch.arange(B, device=anchor_pos.device)).reshape(Bc, Nb * B)
        context_cos, context_sin = self.rotary(context_pos)
        cos, sin = self.rotary(block_pos)
        mask = PackedMask(anchor_pos, Tc, B, context_valid, anchor_valid, self.config.attention_chunk_mb)
        x = self._embed(block_ids).reshape(Bc, Nb * B, -1)  # (Bc, Nb*B, H)
        context_kv = [layer.self_attn.project_kv(context, context_cos, context_sin) for layer in self.layers]
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for i in self.layer_order():
            if recompute:  # keep only each layer's input; its activations are recomputed in the backward
                x = checkpoint(self.layers[i], x, *context_kv[i], cos, sin, mask, use_reentrant=False)
            else:
                x = self.layers[i](x, *context_kv[i], cos, sin, mask)
        return self.norm(x).view(Bc, Nb, B, -1)

    def fsdp_units(self) -> list[nn.Module]:
        """The submodules FSDP shards as units of their own (train/parallel.py), gathered only while they run: each
        layer's MLP (most of a layer's weights). The attention projections stay in the root unit, because
        forward_packed also calls them outside the layer's forward (the context K/V of every layer first)."""
        return [layer.mlp for layer in self.layers]

    def layer_order(self) -> list[int]:
        """The layers a block passes through, in order: the stack, layer_repeats times (weight-tied depth)."""
        return list(range(len(self.layers))) * self.config.layer_repeats

    forward = forward_packed  # the training path; DDP/FSDP wrappers call forward

    def new_cache(self) -> DrafterCache:
        return DrafterCache(len(self.layers))

    def extend_cache(self, new_features: torch.Tensor, new_positions: torch.Tensor, cache: DrafterCache):
        """Append newly committed context to the cache. new_features (Bt, Tn, n*Ht); new_positions (Bt, Tn) or (Tn,)."""
        context = self.fuse_context(new_features)  # (Bt, Tn, H)
        cos, sin = self.rotary(new_positions.expand(context.shape[0], -1))
        for i, layer in enumerate(self.layers):
            cache.append(i, *layer.self_attn.project_kv(context, cos, sin))

    def forward_step(self, new_features: torch.Tensor, new_positions: torch.Tensor, block_ids: torch.Tensor,
                     block_positions: torch.Tensor, cache: DrafterCache) -> torch.Tensor:
        """Inference: extend the cache with the new context, then draft one block against all cached context.

        block_ids (Bt, B), block_positions (Bt, B) or (B,). All rows share the cached length (no mask). The block's
        own K/V are not cached, as if the reference loop cropped them. Returns post-final-norm hidden (Bt, B, H).
        """
        self.extend_cache(new_features, new_positions, cache)
        x = self._embed(block_ids)  # (Bt, B, H)
        cos, sin = self.rotary(block_positions.expand(x.shape[0], -1))
        for i in self.layer_order():
            x = self.layers[i](x, cache.keys[i], cache.values[i], cos, sin)
        return self.norm(x)

    # ---- checkpoint: the engine format of docs/export.md, written and read by models/export.py ----

    def save_pretrained(self, path: str, extra_config: dict | None = None):
        """Write config.json and model.safetensors in the engine format (models/export.py save_export)."""
        export.save_export(self, path, extra_config)

    @classmethod
    def from_pretrained(cls, path: str, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> DFlashDrafter:
        """Load a save_pretrained folder (models/export.py load_export): every key must match exactly; float32
        weights, cast with .to(dtype) afterwards."""
        return export.load_export(cls, DFlashDrafterConfig, path, embed_tokens, lm_head)

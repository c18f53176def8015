"""The target's cache, for every target family in one place: created, carried per row, merged, rolled back to a
length and cut to a tree path. The teacher's continuous batch (models/generation.py), the exact decoding loop
(eval/decode.py), tree verification (eval/tree.py), the cost curves (eval/policies.py) and the benchmarks all go
through here, so that a new family is added in this one module.

Two kinds of layer, as transformers' DynamicCache holds them:
- attention layers (`DynamicLayer`: keys and values of shape (rows, heads, T, d); MLA keys and values may differ in
  d): every token's entry is kept, sliding windows included (the attention mask applies the window, so a crop or a
  tree path can always go back to any length);
- recurrent layers (transformers' linear-attention layers: Gated DeltaNet, Mamba2, short convolutions): a state per
  row with no sequence axis, updated in place. There is nothing to crop; a rollback restores the state after the
  accepted tokens (`Rollback`), and rows are merged by concatenation.
A layer may be both (a Mamba and an attention block in parallel, as in Falcon-H1).
"""
from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DummyLayer, DynamicLayer, DynamicSlidingWindowLayer, \
    LinearAttentionAndFullAttentionLayer, LinearAttentionCacheLayerMixin, LinearAttentionLayer

# The cache layers this module knows how to merge, roll back and cut (a sliding-window layer is made full length; a
# dummy layer belongs to a layer that reuses another's keys and values). Any other is refused when the target loads.
HANDLED = (DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer, LinearAttentionAndFullAttentionLayer,
           DummyLayer)


class CacheError(ValueError):
    """A cache operation a target family cannot do, with what to use instead."""


def _attention(layer) -> bool:
    return isinstance(layer, DynamicLayer) and getattr(layer, "is_initialized", False) and layer.keys is not None


def _recurrent(layer) -> bool:
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def check_supported(model) -> None:
    """Raise CacheError, naming the architecture and the cache layers, when the target's cache holds a kind of layer
    this module does not handle (an indexer cache, a compressed one, ...): refused at load, never a wrong output."""
    odd = sorted({type(layer).__name__ for layer in DynamicCache(config=model.config).layers
                  if type(layer) not in HANDLED})
    if odd:
        raise CacheError(f"{type(model).__name__}: its cache layers {', '.join(odd)} are not handled by "
                         f"models/cache.py (handled: {', '.join(c.__name__ for c in HANDLED)})")


def is_recurrent(model) -> bool:
    """True when the target has recurrent layers (linear attention or SSM): no crop, no tree of shared states.
    Read from the layers transformers' own cache builds for the config (once per model)."""
    known = getattr(model, "_dflash_recurrent", None)
    if known is None:
        known = any(_recurrent(layer) for layer in DynamicCache(config=model.config).layers)
        model._dflash_recurrent = known
    return known


def new_cache(model) -> DynamicCache:
    """An empty cache for `model`: plain full-length attention layers for attention targets (as transformers builds
    lazily), and for recurrent targets the family's own layers from its config, with any sliding-window layer made
    full length (the mask applies the window; a crop must be able to go back)."""
    if not is_recurrent(model):
        return DynamicCache()
    cache = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicSlidingWindowLayer:
            cache.layers[i] = DynamicLayer()
    return cache


def seq_length(cache: DynamicCache) -> int:
    """Tokens the cache has seen (the same for every layer that counts them)."""
    for layer in cache.layers:
        if _attention(layer):
            return layer.keys.shape[-2]
    for layer in cache.layers:
        if _recurrent(layer):
            return int(layer.get_seq_length())
    return 0


# -- rows: the teacher's continuous batch -------------------------------------------------------------------------
def _pad_left(x: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - x.shape[-2]
    if not missing:
        return x
    shape = list(x.shape)
    shape[-2] = missing
    return torch.cat([x.new_zeros(shape), x], dim=-2)


def merge_rows(cache: DynamicCache, mask: torch.Tensor, other: DynamicCache, other_mask: torch.Tensor
               ) -> torch.Tensor:
    """Append the rows of `other` (a separately prefilled batch) to `cache`, left-padding the narrower attention
    entries so every row's next token stays in the last column; returns the merged attention mask. Keys are stored
    already rotated and positions are passed explicitly, so padding columns change nothing but the mask. Recurrent
    states have no sequence axis: their rows are concatenated."""
    width = max(mask.shape[1], other_mask.shape[1])
    for mine, theirs in zip(cache.layers, other.layers):
        if _attention(mine):
            mine.keys = torch.cat([_pad_left(mine.keys, width), _pad_left(theirs.keys, width)])
            mine.values = torch.cat([_pad_left(mine.values, width), _pad_left(theirs.values, width)])
        if _recurrent(mine):
            for states, flags in (("conv_states", "is_conv_states_initialized"),
                                  ("recurrent_states", "is_recurrent_states_initialized")):
                ours, new = getattr(mine, states), getattr(theirs, states)
                for i in ours:
                    if getattr(mine, flags)[i]:
                        ours[i] = torch.cat([ours[i], new[i]])
    pad = lambda m: torch.cat([m.new_zeros((m.shape[0], width - m.shape[1])), m], dim=1)  # noqa: E731
    return torch.cat([pad(mask), pad(other_mask)])


def select_rows(cache: DynamicCache, rows: torch.Tensor) -> None:
    """Keep the batch rows at `rows` in every layer (finished rows leave the batch)."""
    for layer in cache.layers:
        if _attention(layer):
            layer.batch_select_indices(rows)
        if _recurrent(layer):
            layer.reorder_cache(rows)  # index_select on dim 0 of every state: the same selection


def trim_padding(cache: DynamicCache, mask: torch.Tensor) -> torch.Tensor:
    """Drop leading columns that are padding in every row (left behind by rows that finished)."""
    used = mask.any(0).nonzero()
    first = int(used[0]) if len(used) else mask.shape[1]
    if first:
        for layer in cache.layers:
            if _attention(layer):
                layer.keys, layer.values = layer.keys[..., first:, :], layer.values[..., first:, :]
        mask = mask[:, first:]
    return mask


# -- length: the exact decoding loop ----------------------------------------------------------------------------------
def crop(cache: DynamicCache, length: int) -> None:
    """Keep the first `length` tokens of an attention target's cache. (transformers 5: crop(-n) REMOVES n tokens.)
    A recurrent target goes back through its Rollback instead."""
    if any(_recurrent(layer) for layer in cache.layers):
        raise CacheError("a recurrent target's cache cannot be cropped: roll it back with models/cache.py Rollback")
    extra = seq_length(cache) - length
    if extra > 0:
        cache.crop(-extra)


def snapshot(cache: DynamicCache) -> list[dict]:
    """What `restore` needs to bring the cache back to now: each attention layer's length, copies of each recurrent
    layer's states."""
    snap = []
    for layer in cache.layers:
        entry = {}
        if _attention(layer):
            entry["length"] = layer.keys.shape[-2]
        if _recurrent(layer):
            entry["conv"] = {i: s.clone() for i, s in layer.conv_states.items() if s is not None}
            entry["recurrent"] = {i: s.clone() for i, s in layer.recurrent_states.items() if s is not None}
            entry["count"] = layer.cumulative_length_linear.clone()
        snap.append(entry)
    return snap


def restore(cache: DynamicCache, snap: list[dict]) -> None:
    """Back to the cache `snapshot` saw (the snapshot stays usable)."""
    for layer, entry in zip(cache.layers, snap):
        if "length" in entry and _attention(layer):
            n = entry["length"]
            layer.keys, layer.values = layer.keys[..., :n, :], layer.values[..., :n, :]
        if "conv" in entry:
            for i, s in entry["conv"].items():
                layer.conv_states[i] = s.clone()
            for i, s in entry["recurrent"].items():
                layer.recurrent_states[i] = s.clone()
            layer.cumulative_length_linear.copy_(entry["count"])
            if getattr(layer, "record_past", False):
                layer.recurrent_states_history = {i: [] for i in range(layer.number_of_states)}


ROLLBACKS = ("record", "replay")


class Rollback:
    """Brings the target's cache back to the committed tokens after a verify forward, for every family.

    Attention targets: a crop. Recurrent targets (docs/targets.md, 'Rollback'), one of:
    - "record": the verify forward also keeps the state after each of its last `block` positions (transformers'
      past recording: those positions run step by step instead of chunked), and the rollback picks the one after
      the accepted tokens. No extra forward; memory for `block` states per layer.
    - "replay": the states are snapshotted before the verify; after it they are restored, the attention entries
      cropped to the committed prefix, and the kept tokens (anchor + accepted drafts) forwarded again: one more
      target forward of m + 1 tokens per round that rejects a draft.
    Use: `start(cache, block)` once after the prefill; per round `before(cache)`, the verify forward, then
    `after(cache, length, keep, positions)`.
    """

    def __init__(self, model, strategy: str = "record"):
        if strategy not in ROLLBACKS:
            raise CacheError(f"unknown rollback {strategy!r}; use one of {', '.join(ROLLBACKS)}")
        self.model, self.strategy = model, strategy
        self.recurrent = is_recurrent(model)
        self.saved: list[dict] | None = None
        self.replays = 0  # extra target forwards the rollbacks took (replay)

    def start(self, cache: DynamicCache, block: int) -> None:
        if self.recurrent and self.strategy == "record":
            cache.activate_past_recording(recurrent_states_to_keep=block)

    def before(self, cache: DynamicCache) -> None:
        if self.recurrent and self.strategy == "replay":
            self.saved = snapshot(cache)

    def after(self, cache: DynamicCache, length: int, keep: torch.Tensor, positions: torch.Tensor) -> None:
        """Back to the first `length` tokens, the last of which are `keep` (1, m + 1: the anchor and the accepted
        drafts, fed by the verify) at `positions` (1, m + 1)."""
        if not self.recurrent:
            crop(cache, length)
            return
        extra = seq_length(cache) - length
        if self.strategy == "record":
            cache.crop(-extra)  # also when 0: trims the recorded history back to the working size
            return
        if extra == 0:
            return
        restore(cache, self.saved)
        self.model(input_ids=keep, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1)
        self.replays += 1


# -- trees ---------------------------------------------------------------------------------------------------------
def keep_path(cache: DynamicCache, L: int, rows: torch.Tensor) -> None:
    """Keep the first L tokens of every attention layer plus the new tokens at `rows` (indices relative to L,
    ascending): the KV of the accepted tree path, computed under the tree mask, equals a chain forward over that
    path. Recurrent layers have one state for the whole tree, so they cannot be cut to a path: refused."""
    for layer in cache.layers:
        if _recurrent(layer):
            raise CacheError(f"cannot cut a {type(layer).__name__} to a tree path: tree methods need per-branch "
                             "states, which recurrent targets do not have; use a chain method")
        if not _attention(layer):
            continue
        if type(layer) is not DynamicLayer:
            raise CacheError(f"cannot cut a {type(layer).__name__} to a tree path: only full-length attention layers")
        idx = rows.to(layer.keys.device) + L
        for name in ("keys", "values"):
            t = getattr(layer, name)
            t[..., L: L + len(idx), :] = t.index_select(-2, idx)
            setattr(layer, name, t[..., : L + len(idx), :])

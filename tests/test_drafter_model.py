"""Tiny-drafter tests: the packed training mask, no leakage between blocks, packed == one block at a time,
KV cache == recompute, export -> reload identical, frozen shared target modules."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dflash_pipeline.models.drafter import DFlashDrafter, DFlashDrafterConfig, packed_attention_mask
from dflash_pipeline.models.families import default_layer_ids

H, V, B, N_TAPS = 32, 99, 4, 2


def tiny_config(**changes) -> DFlashDrafterConfig:
    values = dict(hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
                  max_position_embeddings=128, vocab_size=V, block_size=B, target_hidden_size=H,
                  target_layer_ids=[1, 3], num_target_layers=6, mask_token_id=V - 1)
    values.update(changes)
    return DFlashDrafterConfig(**values)


def target_modules(seed=0):
    torch.manual_seed(seed)
    embed, head = nn.Embedding(V, H), nn.Linear(H, V, bias=False)
    nn.init.normal_(embed.weight, std=1.0)
    return embed, head


def tiny_drafter(seed=0, **changes) -> DFlashDrafter:
    embed, head = target_modules(seed)
    torch.manual_seed(seed + 1)
    model = DFlashDrafter(tiny_config(**changes), embed, head).eval()
    # Larger weights than the 0.02 init so that every dependency shows up clearly in the outputs (the convolution's
    # base kernel too: at its identity init it would hide a wrong tap).
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim >= 2:
                p.normal_(std=0.3)
    return model


# DFlash2's grouped convolution (3 taps, groups of 8 channels) on and off: every drafter property holds for both
CONV = {"dflash": {}, "dflash2_conv": {"conv_kernel_size": 3, "conv_group_size": 8}}


def inputs(Bc=1, Tc=12, anchors=((2, 6, 9),), seed=3):
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(Bc, Tc, N_TAPS * H, generator=g)
    anchor_pos = torch.tensor(anchors).expand(Bc, -1)
    Nb = anchor_pos.shape[1]
    block_ids = torch.randint(0, V, (Bc, Nb, B), generator=g)
    block_ids[:, :, 1:] = V - 1  # [anchor, MASK x (B-1)]
    return features, block_ids, anchor_pos


SECTION9_KEYS = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.{i}.{name}.weight" for i in range(2) for name in (
        "input_layernorm", "post_attention_layernorm",
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
        "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}


def test_packed_attention_mask_by_hand():
    mask = packed_attention_mask(torch.tensor([[1, 3]]), num_context=5, block_size=2)
    T, F_ = True, False
    expected = torch.tensor([[
        # context 0..4          block 0   block 1
        [T, F_, F_, F_, F_,     T, T,     F_, F_],  # block 0 (anchor 1), token 0
        [T, F_, F_, F_, F_,     T, T,     F_, F_],  # block 0, token 1
        [T, T, T, F_, F_,       F_, F_,   T, T],    # block 1 (anchor 3), token 0
        [T, T, T, F_, F_,       F_, F_,   T, T],    # block 1, token 1
    ]])
    assert mask.dtype == torch.bool and torch.equal(mask, expected)


def test_packed_attention_mask_padding():
    context_valid = torch.tensor([[True, True, False, False, False]])
    anchor_valid = torch.tensor([[True, False]])
    mask = packed_attention_mask(torch.tensor([[4, 3]]), 5, 2, context_valid, anchor_valid)
    T, F_ = True, False
    expected = torch.tensor([[
        [T, T, F_, F_, F_,      T, T,     F_, F_],  # padded context hidden although before the anchor
        [T, T, F_, F_, F_,      T, T,     F_, F_],
        [F_, F_, F_, F_, F_,    F_, F_,   T, T],    # padded block sees only itself
        [F_, F_, F_, F_, F_,    F_, F_,   T, T],
    ]])
    assert torch.equal(mask, expected)


def test_default_layer_ids():
    assert default_layer_ids(30, 1) == [15]
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]


def test_config_round_trip_ignores_extra_keys():
    config = tiny_config()
    d = config.to_dict()
    assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
    assert d["dflash_config"] == {"mask_token_id": V - 1, "target_layer_ids": [1, 3]}
    assert d["rope_scaling"] is None and d["tie_word_embeddings"] is False
    assert DFlashDrafterConfig.from_dict({**d, "pipeline": {"anything": 1}}) == config


@pytest.mark.parametrize("conv", sorted(CONV))
@torch.no_grad()
def test_no_leakage_between_blocks_or_from_the_future(conv):
    model = tiny_drafter(**CONV[conv])
    features, block_ids, anchor_pos = inputs()  # anchors 2, 6, 9
    out = model.forward_packed(features, block_ids, anchor_pos)

    other_ids = block_ids.clone()
    other_ids[0, 1] = (other_ids[0, 1] + 7) % V  # change block 1 only
    changed = model.forward_packed(features, other_ids, anchor_pos)
    assert torch.equal(changed[0, 0], out[0, 0]) and torch.equal(changed[0, 2], out[0, 2])
    assert not torch.allclose(changed[0, 1], out[0, 1])

    future = features.clone()
    future[0, 6:] += 5.0  # at and after block 1's anchor
    changed = model.forward_packed(future, block_ids, anchor_pos)
    assert torch.equal(changed[0, :2], out[0, :2])  # blocks 0 and 1 see context < 2 and < 6 only
    assert not torch.allclose(changed[0, 2], out[0, 2])  # block 2 (anchor 9) sees positions 6..8

    past = features.clone()
    past[0, 5] += 5.0  # just before block 1's anchor
    changed = model.forward_packed(past, block_ids, anchor_pos)
    assert torch.equal(changed[0, 0], out[0, 0])
    assert not torch.allclose(changed[0, 1], out[0, 1])


@pytest.mark.parametrize("conv", sorted(CONV))
@torch.no_grad()
def test_packed_equals_one_block_at_a_time(conv):
    model = tiny_drafter(**CONV[conv])
    features, block_ids, anchor_pos = inputs(Bc=2)
    packed = model.forward_packed(features, block_ids, anchor_pos)
    for j in range(anchor_pos.shape[1]):
        alone = model.forward_packed(features, block_ids[:, j:j + 1], anchor_pos[:, j:j + 1])
        torch.testing.assert_close(packed[:, j:j + 1], alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("conv", sorted(CONV))
@torch.no_grad()
def test_padding_does_not_change_real_blocks(conv):
    model = tiny_drafter(**CONV[conv])
    features, block_ids, anchor_pos = inputs(anchors=((2, 6),))
    out = model.forward_packed(features[:, :8], block_ids, anchor_pos)
    padded_features = torch.cat([features[:, :8], torch.randn(1, 4, N_TAPS * H)], dim=1)
    padded_anchors = torch.tensor([[2, 6, 10]])
    padded_ids = torch.cat([block_ids, torch.zeros(1, 1, B, dtype=torch.long)], dim=1)
    context_valid = torch.arange(12)[None] < 8
    anchor_valid = torch.tensor([[True, True, False]])
    padded = model.forward_packed(padded_features, padded_ids, padded_anchors, context_valid, anchor_valid)
    torch.testing.assert_close(padded[:, :2], out, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(padded).all()


@pytest.mark.parametrize("conv", sorted(CONV))
@torch.no_grad()
def test_cache_step_equals_packed_recompute(conv):
    model = tiny_drafter(**CONV[conv])
    Bc = 2
    features, block_ids, _ = inputs(Bc=Bc, Tc=12, anchors=((0,),))
    cache = model.new_cache()
    for start, end in [(0, 4), (4, 7), (7, 10)]:  # context appended in three chunks
        positions = torch.arange(start, end).expand(Bc, -1)
        block_positions = torch.arange(end, end + B)
        step = model.forward_step(features[:, start:end], positions, block_ids[:, 0], block_positions, cache)
        assert cache.num_tokens == end  # the block's own K/V were not kept
        packed = model.forward_packed(features, block_ids, torch.full((Bc, 1), end))
        torch.testing.assert_close(step, packed[:, 0], atol=1e-5, rtol=1e-5)

    cache.crop(5)  # rollback, then re-extend with different tokens
    assert cache.num_tokens == 5
    new = features.clone()
    new[:, 5:8] = torch.randn(Bc, 3, N_TAPS * H)
    step = model.forward_step(new[:, 5:8], torch.arange(5, 8), block_ids[:, 0], torch.arange(8, 8 + B), cache)
    packed = model.forward_packed(new, block_ids, torch.full((Bc, 1), 8))
    torch.testing.assert_close(step, packed[:, 0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("draft_vocab", [False, True])
def test_save_load_round_trip(tmp_path, draft_vocab):
    model = tiny_drafter()
    token_ids = torch.tensor([5, 0, 17, 42, 98, 3])
    if draft_vocab:
        model.set_draft_vocab(token_ids)
    model.save_pretrained(str(tmp_path), extra_config={"pipeline": {"target": "tiny"}})

    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert keys == SECTION9_KEYS | ({"d2t", "lm_head.weight"} if draft_vocab else set())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]  # no .tmp left
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ["architectures", "model_type", "num_hidden_layers", "hidden_size", "intermediate_size",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                "rope_scaling", "max_position_embeddings", "vocab_size", "tie_word_embeddings", "block_size",
                "num_target_layers", "target_hidden_size", "dflash_config", "hidden_act", "attention_bias"]:
        assert key in config, key
    assert config["pipeline"] == {"target": "tiny"}
    assert config.get("draft_vocab_size") == (6 if draft_vocab else None)  # top level, where vLLM reads it
    assert "draft_vocab_size" not in config["dflash_config"]

    loaded = DFlashDrafter.from_pretrained(str(tmp_path), model.embed_tokens, model.lm_head).eval()
    features, block_ids, anchor_pos = inputs()
    with torch.no_grad():
        expected = model.logits(model.forward_packed(features, block_ids, anchor_pos))
        got = loaded.logits(loaded.forward_packed(features, block_ids, anchor_pos))
    assert torch.equal(expected, got)
    assert got.shape[-1] == (6 if draft_vocab else V)
    if draft_vocab:
        full = torch.nn.functional.linear(model.forward_packed(features, block_ids, anchor_pos), model.lm_head.weight)
        torch.testing.assert_close(got, full[..., token_ids])
        assert torch.equal(loaded.to_target_ids(torch.tensor([1, 4])), torch.tensor([0, 98]))


@torch.no_grad()
def test_weight_tied_depth_equals_its_unrolled_export(tmp_path):
    """drafter.layer_repeats=2: the block passes through the same layers twice, in training and in the cached step;
    the export is an ordinary drafter of twice the layers (copied weights) that decodes the same, so engines load
    it without knowing about the tie."""
    embed, head = target_modules()
    torch.manual_seed(1)
    tied = DFlashDrafter(tiny_config(num_hidden_layers=1, layer_repeats=2), embed, head).eval()
    for p in tied.parameters():
        if p.ndim == 2:
            p.normal_(std=0.3)
    assert len(tied.layers) == 1 and tied.layer_order() == [0, 0]
    once = DFlashDrafter(tiny_config(num_hidden_layers=1), embed, head).eval()
    once.load_state_dict(tied.state_dict())
    features, block_ids, anchor_pos = inputs()
    packed = tied.forward_packed(features, block_ids, anchor_pos)
    assert not torch.allclose(packed, once.forward_packed(features, block_ids, anchor_pos))  # the second pass counts

    cache = tied.new_cache()
    step = tied.forward_step(features[:, :6], torch.arange(6), block_ids[:, 1], torch.arange(6, 6 + B), cache)
    torch.testing.assert_close(step, packed[:, 1], atol=1e-5, rtol=1e-5)

    tied.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and "layer_repeats" not in config
    unrolled = DFlashDrafter.from_pretrained(str(tmp_path), embed, head).eval()
    assert len(unrolled.layers) == 2 and unrolled.layer_order() == [0, 1]
    assert torch.equal(unrolled.layers[1].mlp.down_proj.weight, tied.layers[0].mlp.down_proj.weight)
    torch.testing.assert_close(unrolled.forward_packed(features, block_ids, anchor_pos), packed, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="layer_repeats must be at least 1"):
        tiny_config(layer_repeats=0)


def test_load_with_missing_or_unexpected_key_fails_clearly(tmp_path):
    model = tiny_drafter()
    model.save_pretrained(str(tmp_path))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["layers.1.self_attn.k_norm.weight"]
    tensors["embed_tokens.weight"] = torch.zeros(V, H)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing keys \['layers.1.self_attn.k_norm.weight'\].*"
                                         r"unexpected keys \['embed_tokens.weight'\]"):
        DFlashDrafter.from_pretrained(str(tmp_path), model.embed_tokens, model.lm_head)


def test_target_modules_are_frozen_shared_and_not_saved():
    model = tiny_drafter()
    embed, head = model.embed_tokens, model.lm_head
    assert not any(p is embed.weight or p is head.weight for p in model.parameters())
    assert set(model.state_dict()) == SECTION9_KEYS
    assert not embed.weight.requires_grad and not head.weight.requires_grad

    model.train()
    features, block_ids, anchor_pos = inputs()
    model.logits(model.forward_packed(features, block_ids, anchor_pos))[..., 1:, :].logsumexp(-1).sum().backward()
    assert embed.weight.grad is None and head.weight.grad is None
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_device_and_dtype_moves():
    model = tiny_drafter()
    model.to(torch.float64)  # the drafter's own weights only; the target keeps its dtype
    assert model.fc.weight.dtype == torch.float64 and model.lm_head.weight.dtype == torch.float32
    features, block_ids, anchor_pos = inputs()
    with torch.no_grad():
        hidden = model.forward_packed(features, block_ids, anchor_pos)
    assert hidden.dtype == torch.float64 and torch.isfinite(model.logits(hidden)).all()
    model.to("meta")  # device moves carry the shared target modules along
    assert model.embed_tokens.weight.is_meta and model.lm_head.weight.is_meta


# ---- DFlash2's grouped convolution ----

def direct_conv(x, base, delta, block_size, group_size):
    """The convolution written position by position: out[p, c] = sum over taps t <= p (within p's block) of
    (base[t, c] + delta[p, t, c // group_size]) * x[p - t, c]."""
    T, H = x.shape
    out = torch.zeros_like(x)
    for p in range(T):
        for t in range(base.shape[0]):
            if p % block_size >= t:
                for c in range(H):
                    out[p, c] += (base[t, c] + delta[p, t, c // group_size]) * x[p - t, c]
    return out


@torch.no_grad()
def test_grouped_conv_is_causal_within_each_block_and_equals_the_direct_sum():
    from dflash_pipeline.models.drafter import GroupedConv

    torch.manual_seed(0)
    conv = GroupedConv(hidden_size=8, kernel_size=3, group_size=4, block_size=4)
    conv.base_kernel.normal_()
    conv.kernel_projection.weight.normal_()
    x, y = torch.randn(2, 12, 8), torch.randn(2, 12, 8)  # three blocks of 4 per row
    h, delta = conv.prepare(x)
    out = conv.finish(y, delta)
    full = conv.kernel_projection(x).view(2, 12, 2, 3, 2)
    for row in range(2):
        torch.testing.assert_close(h[row], direct_conv(x[row], conv.base_kernel[0], full[row, :, 0], 4, 4))
        torch.testing.assert_close(out[row], direct_conv(y[row], conv.base_kernel[1], full[row, :, 1], 4, 4))
    later = y.clone()
    later[:, 6] += 3.0  # block 1, position 2
    changed = conv.finish(later, delta)
    assert torch.equal(changed[:, :6], out[:, :6])  # earlier positions and the block before
    assert not torch.allclose(changed[:, 6:8], out[:, 6:8])  # itself and the position after it in its block
    assert torch.equal(changed[:, 8:], out[:, 8:])  # never the next block


@torch.no_grad()
def test_a_new_convolution_drafter_is_the_dflash_drafter_it_wraps():
    plain = tiny_drafter()
    embed, head = plain.embed_tokens, plain.lm_head
    conv = DFlashDrafter(tiny_config(conv_kernel_size=3, conv_group_size=8), embed, head).eval()
    missing, unexpected = conv.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all("_conv." in k for k in missing)
    features, block_ids, anchor_pos = inputs()
    assert torch.equal(conv.forward_packed(features, block_ids, anchor_pos),
                       plain.forward_packed(features, block_ids, anchor_pos))


def test_convolution_drafter_exports_as_dflash2_with_a_pass_through_selector(tmp_path, caplog):
    model = tiny_drafter(conv_kernel_size=3, conv_group_size=8)
    model.save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    dc = config["dflash_config"]
    assert (dc["conv_kernel_size"], dc["conv_group_size"], dc["selector_rank"], dc["selector_top_k"]) == (3, 8, 1, 2)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    conv_keys = {f"layers.{i}.{side}.{name}" for i in range(2) for side in ("attention_conv", "mlp_conv")
                 for name in ("base_kernel", "kernel_projection.weight")}
    selector_keys = {f"candidate_selector.{k}" for k in ("hidden_projection.weight", "predecessor_codebook",
                                                          "successor_codebook")}
    assert set(tensors) == SECTION9_KEYS | conv_keys | selector_keys
    assert tensors["layers.0.attention_conv.base_kernel"].shape == (2, 3, H)
    assert tensors["layers.0.mlp_conv.kernel_projection.weight"].shape == (2 * 3 * (H // 8), H)
    assert all(not tensors[k].any() for k in selector_keys)  # scores nothing: the engine's walk is the chain
    loaded = DFlashDrafter.from_pretrained(str(tmp_path), model.embed_tokens, model.lm_head).eval()
    features, block_ids, anchor_pos = inputs()
    with torch.no_grad():
        assert torch.equal(loaded.forward_packed(features, block_ids, anchor_pos),
                           model.forward_packed(features, block_ids, anchor_pos))
    model.set_draft_vocab(torch.tensor([0, 5, 17]))  # trains and exports (lm_head + d2t), with a warning: vLLM's
    with caplog.at_level("WARNING"):  # DFlash2 picks candidates from its draft head without d2t
        model.save_pretrained(str(tmp_path / "draft"))
    assert "without mapping them through d2t" in caplog.text
    assert {"d2t", "lm_head.weight"} <= set(load_file(str(tmp_path / "draft" / "model.safetensors")))
    with pytest.raises(ValueError, match="must divide"):
        tiny_config(conv_kernel_size=3, conv_group_size=5)

"""The drafter's building blocks (transformers' Qwen3 norm, MLP and rotary; one lookup of attention kernels):
a stored export of the `tiny` drafter reloads and drafts the same tokens; the target's rope scaling reaches the drafter
and its export; every attention kernel equals the plain (eager) path.

tests/fixtures/tiny_drafter/ holds an export (config.json + model.safetensors) of a drafter built on the tiny target
of experiment=tiny, and expected.safetensors: its inputs and the outputs the code that wrote it produced (post-norm
hidden, top-5 logits, draft tokens) on the packed training path and the cached inference path. Regenerate with
`python tests/test_drafter_modules.py --write-fixture` only when the drafter's outputs are meant to change.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from dflash_pipeline.models.drafter import ATTENTION_FUNCTIONS, PackedMask, DFlashDrafter
from dflash_pipeline.models.families import resolve_layer_ids
from dflash_pipeline.models.target import load_target
from dflash_pipeline.train.drafter import drafter_config

from conftest import make_config
from test_drafter_model import B, V, inputs, tiny_drafter

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_drafter"
TOPK = 5
INPUTS = ("features", "block_ids", "anchor_pos", "context_valid", "anchor_valid", "step_block_ids")


def tiny_target():
    cfg = make_config()
    return cfg, load_target(cfg.target, cfg.cache_dir)


def target_fingerprint(target) -> torch.Tensor:
    """Identifies the tiny target's embedding (= its tied LM head), the frozen half of every logit."""
    w = target.model.get_input_embeddings().weight.detach()
    return torch.stack([w.sum(), w.abs().sum(), w[0].sum(), w[-1].sum(), (w * torch.arange(w.shape[1])).sum()])


def fixture_inputs(vocab: int, mask_token_id: int, features_width: int) -> dict[str, torch.Tensor]:
    """Two sequences, the second with padded context and a padded block; a cached step in two chunks."""
    g = torch.Generator().manual_seed(1234)
    Bc, Tc, B = 2, 16, 4
    anchor_pos = torch.tensor([[2, 7, 11], [3, 9, 0]])
    block_ids = torch.full((Bc, 3, B), mask_token_id)
    block_ids[:, :, 0] = torch.randint(0, vocab, (Bc, 3), generator=g)
    return {
        "features": torch.randn(Bc, Tc, features_width, generator=g),
        "block_ids": block_ids,
        "anchor_pos": anchor_pos,
        "context_valid": torch.arange(Tc)[None] < torch.tensor([[Tc], [13]]),
        "anchor_valid": torch.tensor([[True, True, True], [True, True, False]]),
        "step_block_ids": block_ids[:, 1].clone(),  # drafted at position 10 after context chunks [0, 6) and [6, 10)
    }


@torch.no_grad()
def fixture_outputs(drafter: DFlashDrafter, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    packed = drafter.forward_packed(x["features"], x["block_ids"], x["anchor_pos"], x["context_valid"],
                                    x["anchor_valid"])  # (Bc, Nb, B, H)
    cache = drafter.new_cache()
    drafter.extend_cache(x["features"][:, :6], torch.arange(6), cache)
    step = drafter.forward_step(x["features"][:, 6:10], torch.arange(6, 10), x["step_block_ids"],
                                torch.arange(10, 14), cache)  # (Bc, B, H)
    out = {}
    for name, hidden in [("packed", packed), ("step", step)]:
        logits = drafter.logits(hidden[..., 1:, :])
        top = logits.topk(TOPK, dim=-1)
        out |= {f"{name}_hidden": hidden, f"{name}_top_logits": top.values, f"{name}_top_ids": top.indices,
                f"{name}_tokens": logits.argmax(-1)}
    return out


def write_fixture():
    """A random drafter with large weights (std 0.3, norms near 1) so every weight shows in the outputs."""
    cfg, target = tiny_target()
    layer_ids = resolve_layer_ids(cfg.teacher.layer_ids, cfg.teacher.num_taps, target.num_layers)
    m = target.model
    torch.manual_seed(0)
    drafter = DFlashDrafter(drafter_config(cfg, target, layer_ids), m.get_input_embeddings(),
                            m.get_output_embeddings()).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in drafter.parameters():
            if p.ndim == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            else:  # RMSNorm weights
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.1)
    FIXTURE.mkdir(parents=True, exist_ok=True)
    drafter.save_pretrained(str(FIXTURE), extra_config={"dflash_pipeline": {"target": target.ref}})
    x = fixture_inputs(drafter.config.vocab_size, drafter.config.mask_token_id,
                       len(layer_ids) * drafter.config.target_hidden_size)
    out = fixture_outputs(drafter, x)
    for name in ("packed", "step"):  # the draft tokens must not hinge on rounding
        top = out[f"{name}_top_logits"]
        assert (top[..., 0] - top[..., 1]).min() > 1e-3, f"{name}: a near tie in the fixture; change the inputs"
    tensors = {**x, **out, "target_fingerprint": target_fingerprint(target)}
    save_file({k: v.contiguous().clone() for k, v in tensors.items()}, str(FIXTURE / "expected.safetensors"))


def test_stored_tiny_export_drafts_the_same_tokens(tmp_path):
    expected = load_file(str(FIXTURE / "expected.safetensors"))
    _, target = tiny_target()
    torch.testing.assert_close(target_fingerprint(target), expected["target_fingerprint"], rtol=1e-5, atol=1e-4,
                               msg="the tiny target's weights changed (not the drafter): regenerate the fixture")
    m = target.model
    drafter = DFlashDrafter.from_pretrained(str(FIXTURE), m.get_input_embeddings(), m.get_output_embeddings()).eval()
    got = fixture_outputs(drafter, {k: expected[k] for k in INPUTS})
    valid = expected["anchor_valid"]  # outputs of padded blocks are meaningless
    for name, keep in [("packed", valid), ("step", ...)]:
        assert torch.equal(got[f"{name}_tokens"][keep], expected[f"{name}_tokens"][keep]), name
        assert torch.equal(got[f"{name}_top_ids"][keep], expected[f"{name}_top_ids"][keep]), name
        for key in (f"{name}_hidden", f"{name}_top_logits"):
            torch.testing.assert_close(got[key][keep], expected[key][keep], rtol=1e-5, atol=1e-5, msg=key)

    # Saved again, the export is byte for byte the stored one.
    drafter.save_pretrained(str(tmp_path), extra_config={"dflash_pipeline": {"target": target.ref}})
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / name).read_bytes() == (FIXTURE / name).read_bytes(), name
    assert json.loads((FIXTURE / "config.json").read_text())["rope_scaling"] is None



# -- rope: the target's parameters, scaling included ----------------------------------------------------------------
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 500000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 1024,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 500000.0},
}


def drafter_for(target_config) -> DFlashDrafter:
    """A drafter built by the training code (drafter_config) for a tiny Llama target config."""
    target = SimpleNamespace(model=SimpleNamespace(config=target_config), tokenizer=None)
    conf = drafter_config(make_config("drafter.mask_token_id=5"), target, [1, 3])
    H, V_ = target_config.hidden_size, target_config.vocab_size
    return DFlashDrafter(conf, nn.Embedding(V_, H), nn.Linear(H, V_, bias=False))


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_drafter_rotary_is_the_targets_and_survives_export(tmp_path, rope):
    tc = LlamaConfig(vocab_size=99, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=4096, rope_parameters=dict(ROPES[rope]))
    drafter = drafter_for(tc)
    positions = torch.tensor([[0, 1, 7, 100, 1023, 1024, 2000, 4095]])
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = drafter.rotary(positions)
    want_cos, want_sin = LlamaRotaryEmbedding(tc)(x, positions)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    plain, _ = LlamaRotaryEmbedding(LlamaConfig(**{**tc.to_dict(), "rope_parameters": ROPES["default"]}))(x, positions)
    assert torch.equal(cos, plain) == (rope == "default")  # scaling really changes the positions

    drafter.save_pretrained(str(tmp_path))
    exported = json.loads((tmp_path / "config.json").read_text())
    scaling = {k: v for k, v in ROPES[rope].items() if k != "rope_theta"}
    assert exported["rope_theta"] == ROPES[rope]["rope_theta"]
    assert exported["rope_scaling"] == (None if rope == "default" else scaling)
    assert Qwen3Config(**exported).rope_parameters == tc.rope_parameters  # as an engine's transformers reads it
    loaded = DFlashDrafter.from_pretrained(str(tmp_path), drafter.embed_tokens, drafter.lm_head)
    assert loaded.config == drafter.config
    assert all(torch.equal(a, b) for a, b in zip(loaded.rotary(positions), (cos, sin)))


def test_rotary_frequencies_stay_float32_under_a_dtype_cast():
    drafter = drafter_for(LlamaConfig(vocab_size=99, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096))
    positions = torch.tensor([[5, 1000, 4000]])
    cos, sin = drafter.rotary(positions)
    drafter.to(torch.bfloat16)
    assert drafter._rotary[0].inv_freq.dtype == torch.float32
    bf_cos, bf_sin = drafter.rotary(positions)
    assert bf_cos.dtype == torch.bfloat16
    assert torch.equal(bf_cos, cos.to(torch.bfloat16)) and torch.equal(bf_sin, sin.to(torch.bfloat16))


# -- attention kernels: each one equals the plain path ---------------------------------------------------------------
# sdpa-sliced: sdpa with the packed mask built one block's rows at a time (attention_chunk_mb), each slice
# recomputed in the backward
KERNELS = sorted(set(ATTENTION_FUNCTIONS) - {"eager"}) + ["sdpa-sliced"]


def padded_inputs():
    """Two sequences with padded context (the second from position 9) and a padded block each."""
    features, block_ids, anchor_pos = inputs(Bc=2, Tc=12, anchors=((2, 6, 10),))
    context_valid = torch.arange(12)[None] < torch.tensor([[12], [9]])
    anchor_valid = torch.tensor([[True, True, False], [True, False, False]])
    return features, block_ids, anchor_pos, context_valid, anchor_valid


def with_kernel(model: DFlashDrafter, name: str) -> DFlashDrafter:
    model.set_attn_implementation(name.removesuffix("-sliced"))
    if name.endswith("-sliced"):
        model.config.attention_chunk_mb = 1e-9  # one block's rows at a time
        assert len(PackedMask(torch.ones(1, 3, dtype=torch.long), 12, B, chunk_mb=1e-9).row_chunks()) == 3
    return model


@pytest.mark.parametrize("kernel", KERNELS)
@torch.no_grad()
def test_kernel_equals_eager_on_the_packed_mask_and_the_cached_step(kernel):
    eager, other = with_kernel(tiny_drafter(), "eager"), with_kernel(tiny_drafter(), kernel)
    x = padded_inputs()
    want, got = eager.forward_packed(*x), other.forward_packed(*x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # padded blocks too: they see only themselves

    features, block_ids = x[0], x[1]
    caches = eager.new_cache(), other.new_cache()
    for start, end in [(0, 5), (5, 9)]:
        steps = [m.forward_step(features[:, start:end], torch.arange(start, end), block_ids[:, 0],
                                torch.arange(end, end + B), c) for m, c in zip((eager, other), caches)]
        torch.testing.assert_close(steps[1], steps[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_kernel_gradients_equal_eager(kernel):
    if kernel == "flex":  # torch runs flex forward only on a CPU; its gradients are checked on a GPU (gpu_check.py)
        model = with_kernel(tiny_drafter(), "flex").train()
        with pytest.raises(ValueError, match="flex has no backward on a CPU.*attn_implementation=sdpa"):
            model.forward_packed(*padded_inputs())
        return
    grads = []
    for name in ("eager", kernel):
        model = with_kernel(tiny_drafter(), name).train()
        features, block_ids, anchor_pos, context_valid, anchor_valid = padded_inputs()
        features.requires_grad_(True)
        hidden = model.forward_packed(features, block_ids, anchor_pos, context_valid, anchor_valid)
        model.logits(hidden[anchor_valid][:, 1:]).logsumexp(-1).sum().backward()
        grads.append({"features": features.grad, **{n: p.grad for n, p in model.named_parameters()}})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-5, msg=name)


def test_attn_implementation_is_chosen_by_config_and_checked():
    cfg = make_config("drafter.attn_implementation=eager", "drafter.mask_token_id=5")
    target = SimpleNamespace(model=SimpleNamespace(config=LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2)), tokenizer=None)
    assert drafter_config(cfg, target, [1, 3]).attn_implementation == "eager"
    assert make_config().drafter.attn_implementation == "sdpa"
    with pytest.raises(ValueError, match=r"unknown attn_implementation 'flash'; use one of \['eager', 'flex', 'sdpa'\]"):
        tiny_drafter().set_attn_implementation("flash")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-fixture"]:
        sys.exit(f"usage: python {sys.argv[0]} --write-fixture")
    write_fixture()

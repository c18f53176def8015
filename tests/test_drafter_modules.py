"""The drafter's building blocks: a stored export of the `tiny` drafter reloads and drafts the same tokens.

tests/fixtures/tiny_drafter/ holds an export (config.json + model.safetensors) of a drafter built on the tiny target
of experiment=tiny, and expected.safetensors: its inputs and the outputs the code that wrote it produced (post-norm
hidden, top-5 logits, draft tokens) on the packed training path and the cached inference path. Regenerate with
`python tests/test_drafter_modules.py --write-fixture` only when the drafter's outputs are meant to change.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash_pipeline.models.drafter import DFlashDrafter
from dflash_pipeline.models.target import load_target, resolve_layer_ids
from dflash_pipeline.train.drafter import drafter_config

from conftest import make_config

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
    torch.testing.assert_close(target_fingerprint(target), expected["target_fingerprint"], rtol=0, atol=0,
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


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-fixture"]:
        sys.exit(f"usage: python {sys.argv[0]} --write-fixture")
    write_fixture()

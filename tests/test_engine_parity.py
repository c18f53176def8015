"""DFlash2 exports against vLLM's own modules (eval/engine_parity.py, vLLM's venv): the grouped convolutions and
the selector's edge scores equal the engine's within float32 rounding, the engine's greedy walk picks the project's
tokens, and each planted mistake (taps reversed, sides swapped, group size doubled, a convolution across block
boundaries, the codebooks swapped) is caught."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from dflash_pipeline.eval.engine_parity import load_modules, parity
from dflash_pipeline.models.drafter import DFlashDrafter, DFlashDrafterConfig
from dflash_pipeline.models.selector import SELECTOR_PREFIX, PairSelector
from dflash_pipeline.train.frozen import export_with_drafter

from conftest import make_config
from test_served import needs_vllm

H, V, B = 64, 211, 5


def dflash2_export(tmp_path: Path, conv_kernel_size: int) -> Path:
    """A 2-layer drafter (with the convolution, or a DFlash one) plus a selector, every weight random and large
    enough to matter, exported as the pipeline exports a trained selector."""
    torch.manual_seed(0)
    config = DFlashDrafterConfig(
        hidden_size=H, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=256, vocab_size=V,
        block_size=B, target_hidden_size=H, target_layer_ids=[0, 2], num_target_layers=4, mask_token_id=V - 1,
        conv_kernel_size=conv_kernel_size, conv_group_size=16)
    drafter = DFlashDrafter(config, nn.Embedding(V, H), nn.Linear(H, V, bias=False))
    selector = PairSelector(V, H, rank=8, top_k=6)
    with torch.no_grad():
        for p in [*drafter.parameters(), *selector.parameters()]:
            p.normal_(std=0.5)
    drafter.save_pretrained(str(tmp_path / "drafter"))
    return export_with_drafter(tmp_path / "drafter", tmp_path / "selector",
                               {SELECTOR_PREFIX + k: v for k, v in selector.state_dict().items()},
                               selector.config_dict(), "selector", {})


@pytest.mark.slow
@needs_vllm
def test_convolution_and_selector_equal_vllms_modules_and_plants_are_caught(tmp_path):
    export = dflash2_export(tmp_path, conv_kernel_size=3)
    assert json.loads((export / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    result = parity(export, make_config().cache_dir)
    assert result["agrees"], result["engine"]
    assert result["engine"]["walk_equal"]
    assert set(result["caught"]) == {"taps reversed", "sides swapped", "across block boundaries", "codebooks swapped",
                                     "group size doubled"}
    assert all(result["caught"].values()), result["plants"]


@pytest.mark.slow
@needs_vllm
def test_a_selector_on_a_dflash_drafter_is_served_as_dflash2_with_an_identity_convolution(tmp_path):
    export = dflash2_export(tmp_path, conv_kernel_size=0)
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert (config["dflash_config"]["conv_kernel_size"], config["dflash_config"]["conv_group_size"]) == (1, H)
    result = parity(export, make_config().cache_dir)
    assert result["agrees"], result["engine"]
    x = torch.randn(2 * B, H)
    for conv in load_modules(export)[1].values():  # the one-tap convolution passes the hidden states through
        h, delta = conv.prepare(x)
        assert torch.equal(h, x) and torch.equal(conv.finish(x, delta), x)


def test_parity_refuses_a_dflash_export(tmp_path):
    torch.manual_seed(0)
    folder = dflash2_export(tmp_path, conv_kernel_size=0).parent / "drafter"
    with pytest.raises(ValueError, match="not a DFlash2DraftModel"):
        parity(folder, make_config().cache_dir)

"""Exports read back as an engine reads them: each variant (full vocabulary; draft vocabulary with `lm_head` +
`d2t`; DFlash2 with its grouped convolution) is loaded by an independent reader (json + safetensors + plain torch, no project model code), whose forward
reproduces the drafts of the project's speculative decoding on the tiny target token for token (docs/export.md)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dflash_pipeline.eval.decode import speculative
from dflash_pipeline.eval.protocol import ChainMethod
from dflash_pipeline.models.drafter import DFlashDrafter
from dflash_pipeline.train.drafter import drafter_config

from conftest import chat_prompt_ids, make_config

TAPS = [1, 3]
DRAFT_VOCAB = 300
TEXTS = ["Write a haiku about the sea.", "What is 12 times 7?"]


# -- the independent reader: what an engine does with config.json + model.safetensors ---------------------------
def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return weight.float() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding (rotate halves) of x (T, heads, D) at integer positions (T,)."""
    D = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, D, 2, dtype=torch.float32) / D)
    angles = positions.float()[:, None] * inv_freq  # (T, D/2)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]  # broadcast over heads
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class ExportReader:
    """An export folder seen as an engine sees it. The target supplies the embedding table (never exported) and,
    without a draft-vocabulary head in the file, the LM head. `use_draft_head=False` reads a draft-vocabulary export
    as a loader that ignores `lm_head`/`d2t` does (SGLang, the reference code); `d2t_as_ids` misreads d2t."""

    def __init__(self, folder: Path, target_model, use_draft_head: bool = True, d2t_as_ids: bool = False,
                 skip_convolution: bool = False):
        self.c = json.loads((folder / "config.json").read_text())
        self.skip_convolution = skip_convolution  # reads a DFlash2 file as a DFlash loader would
        self.w = load_file(str(folder / "model.safetensors"))
        self.target = target_model
        self.embed = target_model.get_input_embeddings().weight.detach().float()
        c = self.c
        self.V = c["vocab_size"]
        rope_settings = c.get("rope_scaling") or c.get("rope_parameters") or {}
        assert rope_settings.get("rope_type", "default") == "default", "this reader implements plain RoPE only"
        self.theta = float(c.get("rope_theta") or rope_settings["rope_theta"])
        if use_draft_head and c.get("draft_vocab_size", self.V) != self.V:
            self.head = self.w["lm_head.weight"].float()  # (Vd, H)
            d2t = self.w["d2t"]
            base = torch.arange(c["draft_vocab_size"])
            self.targets = d2t.long() if d2t_as_ids else base + d2t  # vLLM: target id = draft id + d2t[draft id]
        else:
            self.head = target_model.get_output_embeddings().weight.detach().float()  # (V, H)
            self.targets = torch.arange(self.V)

    @torch.no_grad()
    def features(self, token_ids: list[int]) -> torch.Tensor:
        """Tapped target features of the committed tokens (T, n*H): hidden_states[i + 1] for each tapped layer i."""
        out = self.target(input_ids=torch.tensor([token_ids]), output_hidden_states=True)
        return torch.cat([out.hidden_states[i + 1][0] for i in self.c["dflash_config"]["target_layer_ids"]], dim=-1)

    def convolve(self, layer: int, name: str, x: torch.Tensor, source: torch.Tensor, side: int) -> torch.Tensor:
        """DFlash2's grouped convolution as the file defines it, one position and tap at a time: the output at block
        position p is the sum over taps t <= p of (base_kernel[side, t] + its group's delta) * x[p - t], the deltas
        being kernel_projection(source) at p, laid out (side, tap, group)."""
        if self.skip_convolution or f"layers.{layer}.{name}.base_kernel" not in self.w:
            return x
        base = self.w[f"layers.{layer}.{name}.base_kernel"].float()  # (2, taps, H)
        taps, gs = base.shape[1], self.c["dflash_config"]["conv_group_size"]
        delta = (source @ self.w[f"layers.{layer}.{name}.kernel_projection.weight"].float().T).view(
            len(x), 2, taps, -1)
        out = torch.zeros_like(x)
        for p in range(len(x)):
            for t in range(min(taps, p + 1)):
                out[p] += (base[side, t] + delta[p, side, t].repeat_interleave(gs)) * x[p - t]
        return out

    @torch.no_grad()
    def draft(self, context: list[int], anchor: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts for the block [anchor, MASK x (B-1)] at positions len(context) ..: (target ids (B-1,),
        logits (B-1, Vd or V) in the file's head order)."""
        c, w, eps = self.c, self.w, self.c["rms_norm_eps"]
        nh, nkv, D = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        B, L = c["block_size"], len(context)
        ctx = rms(self.features(context) @ w["fc.weight"].float().T, w["hidden_norm.weight"], eps)  # (L, H)
        block = torch.tensor([anchor] + [c["dflash_config"]["mask_token_id"]] * (B - 1))
        x = self.embed[block]  # (B, H)
        pos_block = torch.arange(L, L + B)
        pos_kv = torch.arange(L + B)  # [context | block]
        for i in range(c["num_hidden_layers"]):
            p = lambda name: w[f"layers.{i}.{name}.weight"].float()  # noqa: E731
            normed = rms(x, p("input_layernorm"), eps)
            h = self.convolve(i, "attention_conv", normed, normed, 0)
            q = rope(rms((h @ p("self_attn.q_proj").T).view(B, nh, D), p("self_attn.q_norm"), eps), pos_block, theta=self.theta)
            kv_in = torch.cat([ctx, h])  # (L + B, H): the layer's own k/v projections of context and block
            k = rms((kv_in @ p("self_attn.k_proj").T).view(L + B, nkv, D), p("self_attn.k_norm"), eps)
            k = rope(k, pos_kv, theta=self.theta).repeat_interleave(nh // nkv, dim=1)  # (L + B, nh, D)
            v = (kv_in @ p("self_attn.v_proj").T).view(L + B, nkv, D).repeat_interleave(nh // nkv, dim=1)
            att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D), dim=-1)  # no mask: bidirectional
            attended = torch.einsum("hqk,khd->qhd", att, v).reshape(B, nh * D) @ p("self_attn.o_proj").T
            x = x + self.convolve(i, "attention_conv", attended, normed, 1)
            normed = rms(x, p("post_attention_layernorm"), eps)
            h = self.convolve(i, "mlp_conv", normed, normed, 0)
            mlp = (F.silu(h @ p("mlp.gate_proj").T) * (h @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
            x = x + self.convolve(i, "mlp_conv", mlp, normed, 1)
        logits = rms(x, w["norm.weight"], eps)[1:] @ self.head.T  # (B-1, Vd or V)
        full = logits.new_full((B - 1, self.V), float("-inf"))  # vLLM's compute_logits: scatter to target ids
        full[:, self.targets] = logits
        return full.argmax(-1), logits


# -- the project's side -------------------------------------------------------------------------------------------
class Recorder(ChainMethod):
    """The eval's chain method, keeping (committed tokens before the anchor, anchor, drafts) of every round."""

    def __init__(self, drafter, prompt_ids: list[int]):
        super().__init__(drafter)
        self.prompt_ids, self.rounds = prompt_ids, []

    def propose(self, state, block_size, temperature=0.0, generator=None):
        proposal = super().propose(state, block_size, temperature, generator)
        context = self.prompt_ids + state.output[:-1]
        assert len(context) == state.anchor_pos
        self.rounds.append((context, state.anchor, proposal.tokens.clone()))
        return proposal


@pytest.fixture(scope="module")
def prompt_ids(target):
    return chat_prompt_ids(target.tokenizer, TEXTS)


def make_drafter(target, draft_vocab: bool, conv: bool = False) -> DFlashDrafter:
    """A 2-layer drafter on the tiny target with weights large enough that every tensor moves the drafts (norm
    weights too, so a reader that skipped one would be caught); conv: DFlash2's convolution, 3 taps."""
    torch.manual_seed(0)
    m = target.model
    config = make_config("drafter.num_layers=2", f"drafter.conv_kernel_size={3 if conv else 0}")
    drafter = DFlashDrafter(drafter_config(config, target, TAPS), m.get_input_embeddings(), m.get_output_embeddings())
    with torch.no_grad():
        for p in drafter.parameters():
            p.normal_(std=0.3) if p.ndim >= 2 else p.uniform_(0.5, 1.5)
    if draft_vocab:
        g = torch.Generator().manual_seed(1)
        drafter.set_draft_vocab(torch.randperm(drafter.config.vocab_size, generator=g)[:DRAFT_VOCAB].sort().values)
    return drafter.eval()


def project_rounds(target, drafter, prompt_ids) -> list[tuple[list[int], int, torch.Tensor]]:
    rounds = []
    for ids in prompt_ids:
        method = Recorder(drafter, ids)
        speculative(target, method, ids, max_new_tokens=12)
        rounds += method.rounds
    return rounds


@pytest.mark.parametrize("draft_vocab,conv", [(False, False), (True, False), (False, True)],
                         ids=["full-vocab", "draft-vocab", "dflash2-conv"])
def test_independent_reader_reproduces_the_project_drafts(tmp_path, target, prompt_ids, draft_vocab, conv):
    drafter = make_drafter(target, draft_vocab, conv)
    drafter.save_pretrained(str(tmp_path), extra_config={"dflash_pipeline": {"target": target.ref}})
    reader = ExportReader(tmp_path, target.model)
    rounds = project_rounds(target, drafter, prompt_ids)
    assert len(rounds) >= 10
    for context, anchor, drafts in rounds:
        got, logits = reader.draft(context, anchor)
        assert torch.equal(got, drafts), (context, anchor)
        # the project's logits for the same context, in its column order (the file's head order)
        feats = reader.features(context)[None]
        block = torch.tensor([[[anchor] + [drafter.config.mask_token_id] * (drafter.config.block_size - 1)]])
        with torch.no_grad():
            expected = drafter.logits(drafter.forward_packed(feats, block, torch.tensor([[len(context)]])))[0, 0, 1:]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)

    if draft_vocab:
        # What a loader that ignores lm_head/d2t drafts (full vocabulary, target head), and a d2t misread as
        # absolute ids: both differ from the project's drafts, so the comparison above can fail.
        ignoring = ExportReader(tmp_path, target.model, use_draft_head=False)
        misread = ExportReader(tmp_path, target.model, d2t_as_ids=True)
        context, anchor, drafts = rounds[0]
        assert not torch.equal(ignoring.draft(context, anchor)[0], drafts)
        assert not torch.equal(misread.draft(context, anchor)[0], drafts)
    if conv:  # a DFlash loader (no convolution) drafts otherwise: the comparison above sees the convolution
        plain = ExportReader(tmp_path, target.model, skip_convolution=True)
        assert any(not torch.equal(plain.draft(c, a)[0], d) for c, a, d in rounds[:4])


def test_export_contents(tmp_path, target):
    own_keys = None
    for draft_vocab in (False, True):
        drafter = make_drafter(target, draft_vocab)
        folder = tmp_path / str(draft_vocab)
        extra = {"dflash_pipeline": {"target": target.ref}}
        drafter.save_pretrained(str(folder), extra_config=extra)
        config = json.loads((folder / "config.json").read_text())
        tensors = load_file(str(folder / "model.safetensors"))
        H, V = drafter.config.hidden_size, drafter.config.vocab_size
        assert config["vocab_size"] == V == target.model.config.vocab_size
        assert not {"embed_tokens.weight", "draft_to_target", "t2d"} & set(tensors)
        # the config's keys, and in dflash_config what the inputs and logits trained with (a Llama target: unscaled)
        assert config.pop("dflash_config") == {**drafter.config.to_dict()["dflash_config"],
                                               "input_embedding_scale": 1.0, "output_multiplier": 1.0}
        config["dflash_config"] = drafter.config.to_dict()["dflash_config"]
        if not draft_vocab:
            own_keys = set(tensors)
            assert config == {**drafter.config.to_dict(), **extra}  # the full-vocabulary format, nothing added
            assert "lm_head.weight" not in tensors and "d2t" not in tensors
            continue
        assert config == {**drafter.config.to_dict(), "draft_vocab_size": DRAFT_VOCAB, **extra}
        assert set(tensors) == own_keys | {"lm_head.weight", "d2t"}
        d2t, head = tensors["d2t"], tensors["lm_head.weight"]
        assert d2t.dtype == torch.int64 and d2t.shape == (DRAFT_VOCAB,)
        assert torch.equal(torch.arange(DRAFT_VOCAB) + d2t, drafter.draft_to_target)
        target_head = target.model.get_output_embeddings().weight
        assert head.shape == (DRAFT_VOCAB, H) and head.dtype == target_head.dtype
        assert torch.equal(head, target_head.detach()[drafter.draft_to_target])


def test_project_loader_reloads_each_variant_and_older_exports(tmp_path, target):
    embed, head = target.model.get_input_embeddings(), target.model.get_output_embeddings()
    feats = torch.randn(1, 10, len(TAPS) * target.model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    for draft_vocab in (False, True):
        drafter = make_drafter(target, draft_vocab)
        B, mask = drafter.config.block_size, drafter.config.mask_token_id
        block = torch.tensor([[[7] + [mask] * (B - 1), [9] + [mask] * (B - 1)]])
        anchors = torch.tensor([[3, 8]])
        folder = tmp_path / str(draft_vocab)
        drafter.save_pretrained(str(folder))
        folders = [folder]
        if draft_vocab:  # the format before d2t: ids as draft_to_target, the size under dflash_config
            old = tmp_path / "old"
            old.mkdir()
            tensors = {k: v.contiguous() for k, v in drafter.state_dict().items()}
            save_file(tensors, str(old / "model.safetensors"))
            config = drafter.config.to_dict()
            config["dflash_config"]["draft_vocab_size"] = DRAFT_VOCAB
            (old / "config.json").write_text(json.dumps(config))
            folders.append(old)
        with torch.no_grad():
            expected = drafter.logits(drafter.forward_packed(feats, block, anchors))
            for f in folders:
                loaded = DFlashDrafter.from_pretrained(str(f), embed, head).eval()
                assert torch.equal(loaded.logits(loaded.forward_packed(feats, block, anchors)), expected)
                if draft_vocab:
                    assert torch.equal(loaded.draft_to_target, drafter.draft_to_target)


def test_draft_head_of_another_target_is_refused(tmp_path, target):
    drafter = make_drafter(target, draft_vocab=True)
    drafter.save_pretrained(str(tmp_path))
    other = torch.nn.Linear(drafter.config.hidden_size, drafter.config.vocab_size, bias=False)
    with pytest.raises(ValueError, match="not the given target's LM-head rows"):
        DFlashDrafter.from_pretrained(str(tmp_path), target.model.get_input_embeddings(), other)

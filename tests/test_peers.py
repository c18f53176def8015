"""The converters of scripts/bench_peers.py: teacher data into SpecForge's and speculators' formats (data/peers.py)
and their exported drafters into this project's layout (models/peers.py), checked against the formats the peers'
code reads (SpecForge 0.2.0, speculators 0.9.0; the config files under fixtures/peers/ were written by them)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_pipeline.data.blocks import anchor_candidates
from dflash_pipeline.data.peers import (peer_samples, prenorm_final_hidden, write_specforge,
                                        write_speculators)
from dflash_pipeline.data.shards import DatasetError, TeacherDataset
from dflash_pipeline.models.drafter import DFlashDrafter, DFlashDrafterConfig
from dflash_pipeline.models.peers import READERS, PeerExportError, to_project

FIXTURES = Path(__file__).parent / "fixtures" / "peers"
BLOCK = 4


@pytest.fixture(scope="module")
def samples(tiny_teacher):
    data = TeacherDataset(tiny_teacher)
    converted, dropped = peer_samples(data, list(range(len(data))))
    return data, converted, dropped


def test_peer_loss_mask_gives_the_peers_exactly_our_anchors(samples):
    data, converted, dropped = samples
    assert dropped == 0 and len(converted) == len(data)
    assert max(int(s["loss_mask"].sum()) - int(data[i]["loss_mask"].sum()) for i, s in enumerate(converted)) >= 2
    for i, s in enumerate(converted):
        ours = set(anchor_candidates(data[i]["loss_mask"]).tolist())
        pm = s["loss_mask"].tolist()
        # SpecForge anchors at a when loss_mask[a] and loss_mask[a + 1] are set
        assert {a for a in range(len(pm) - 1) if pm[a] and pm[a + 1]} == ours
        # speculators at every a with loss_mask[a]; the extra ones (a reply's last token) draft no reply token next
        extra = {a for a in range(len(pm)) if pm[a]} - ours
        assert all(a + 1 >= len(pm) or not data[i]["loss_mask"][a + 1] for a in extra)
        assert torch.equal(s["input_ids"], data[i]["input_ids"].long())


def test_prefilled_samples_are_refused():
    class Prefilled:
        ids = ["prefill:a", "b"]
        has_features = True

    with pytest.raises(DatasetError, match="prefilled samples"):
        peer_samples(Prefilled(), [0, 1])


def test_specforge_files_hold_what_its_reader_needs(samples, tmp_path):
    _, converted, _ = samples
    folder = write_specforge(converted, tmp_path / "specforge")
    files = sorted(folder.glob("*.ckpt"))  # SpecForge reads every .ckpt under the folder, sorted by path
    assert len(files) == len(converted) and not (tmp_path / "specforge.tmp").exists()
    for f, s in zip(files, converted):
        d = torch.load(f, weights_only=True)
        assert set(d) == {"input_ids", "loss_mask", "hidden_states"}
        n = len(s["input_ids"])
        assert d["input_ids"].dtype == d["loss_mask"].dtype == torch.int64
        assert d["hidden_states"].dtype == torch.float32  # the run's model.torch_dtype: it does not cast
        assert d["hidden_states"].shape == s["features"].shape and d["loss_mask"].shape == (n,)
        assert torch.equal(d["hidden_states"], s["features"].float())


def test_speculators_rows_and_hidden_states_align(samples, target, tmp_path):
    from datasets import load_from_disk

    data, converted, _ = samples
    final = prenorm_final_hidden(target.model, [s["input_ids"].tolist() for s in converted], pad_id=0)
    folder = write_speculators(converted, final, tmp_path / "speculators")
    ds = load_from_disk(str(folder))
    assert set(ds.column_names) == {"input_ids", "loss_mask", "seq_len"} and ds.format["type"] == "torch"
    model = target.model
    agree = total = 0
    for i, s in enumerate(converted):
        row = ds[i]
        assert torch.equal(row["input_ids"], s["input_ids"]) and int(row["seq_len"]) == len(s["input_ids"])
        hs = load_file(str(folder / "hidden_states" / f"hs_{i}.safetensors"))
        assert torch.equal(hs["token_ids"], row["input_ids"])  # else speculators drops the row
        n, width = s["features"].shape
        taps = len(data.layer_ids)
        assert hs["hidden_states"].shape == (n, taps + 1, width // taps)
        assert torch.equal(hs["hidden_states"][:, :-1].reshape(n, width), s["features"].float())
        # the last slot is the final layer BEFORE the norm: speculators' label for token t is the argmax of
        # lm_head(norm(h[t - 1])), which for a regenerated reply is the token the target generated
        with torch.no_grad():
            logits = model.lm_head(model.model.norm(hs["hidden_states"][:, -1]))
        reply = data[i]["loss_mask"][1:].bool()
        agree += int((logits[:-1].argmax(-1) == row["input_ids"][1:])[reply].sum())
        total += int(reply.sum())
        # the post-norm state (transformers' last hidden_states entry) would not be: normed twice
        assert not torch.allclose(model.model.norm(hs["hidden_states"][:, -1]), hs["hidden_states"][:, -1])
    assert total > 0 and agree == total


def fake_tensors(cfg: DFlashDrafterConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random tensors with the names and shapes of a drafter of this shape (what both peers write)."""
    embed, head = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size), torch.nn.Linear(cfg.hidden_size, cfg.vocab_size)
    return {k: torch.randn(v.shape).to(dtype) for k, v in DFlashDrafter(cfg, embed, head).state_dict().items()
            if k != "draft_to_target"}


def write_peer_export(folder: Path, config: dict, tensors: dict) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def smollm2_modules():
    """Embedding and LM head of the fixtures' shape (SmolLM2: V 49152, H 576); tied, as the target's."""
    torch.manual_seed(0)
    embed = torch.nn.Embedding(49152, 576)
    head = torch.nn.Linear(576, 49152, bias=False)
    head.weight = embed.weight
    return embed, head


@pytest.mark.parametrize("peer, fixture, ids_offset", [
    ("specforge", "specforge-0.2.0-export.json", 0),
    ("speculators", "speculators-0.9.0-full-attention.json", 1),  # hidden_states indices
])
def test_peer_exports_load_as_trained(peer, fixture, ids_offset, tmp_path, smollm2_modules):
    config = json.loads((FIXTURES / fixture).read_text())
    taps = config["dflash_config"]["target_layer_ids"] if peer == "specforge" else config["aux_hidden_state_layer_ids"]
    shape = READERS[peer](config, 30)
    assert shape.target_layer_ids == [i - ids_offset for i in taps]
    assert shape.block_size == config["block_size"] and shape.num_target_layers == 30
    assert shape.mask_token_id == (config["mask_token_id"] if peer == "speculators"
                                   else config["dflash_config"]["mask_token_id"])
    tensors = fake_tensors(shape, torch.bfloat16 if peer == "speculators" else torch.float32)
    src = write_peer_export(tmp_path / "export", config, tensors)
    out = to_project(peer, src, tmp_path / "project", num_target_layers=30,
                     extra_config={"dflash_pipeline": {"trained_by": peer}})
    assert DFlashDrafterConfig.from_dict(json.loads((out / "config.json").read_text())) == shape
    drafter = DFlashDrafter.from_pretrained(str(out), *smollm2_modules)
    state = drafter.state_dict()
    assert all(torch.equal(state[k], v.float()) for k, v in tensors.items())
    assert drafter.draft_to_target is None


def test_speculators_draft_vocabulary_keeps_its_head(tmp_path, smollm2_modules):
    config = json.loads((FIXTURES / "speculators-0.9.0-full-attention.json").read_text())
    shape = READERS["speculators"](config, 30)
    ids = torch.tensor([3, 17, 100, 4000, 49151])  # speculators orders draft ids by target id
    tensors = fake_tensors(shape, torch.bfloat16)
    tensors.update({"d2t": ids - torch.arange(len(ids)), "t2d": torch.zeros(49152, dtype=torch.bool),
                    "lm_head.weight": smollm2_modules[1].weight.detach()[ids].to(torch.bfloat16)})
    config["draft_vocab_size"] = len(ids)
    out = to_project("speculators", write_peer_export(tmp_path / "export", config, tensors), tmp_path / "project",
                     num_target_layers=30)
    assert "t2d" not in load_file(str(out / "model.safetensors"))
    drafter = DFlashDrafter.from_pretrained(str(out), *smollm2_modules)
    assert torch.equal(drafter.draft_to_target.cpu(), ids)


def test_causal_speculators_default_is_refused(tmp_path):
    config = json.loads((FIXTURES / "speculators-0.9.0-default.json").read_text())
    with pytest.raises(PeerExportError, match="causally inside the block.*--full-attention-indices"):
        READERS["speculators"](config, 30)


def test_bench_peers_help():
    import subprocess
    import sys

    from conftest import ROOT

    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_peers.py"), "--help"], capture_output=True,
                         text=True, check=True).stdout
    assert "--setup" in out and "--teacher" in out and "matched" in out

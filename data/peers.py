"""Teacher data in the formats of the peer DFlash trainers, SpecForge 0.2 and speculators 0.9 (scripts/bench_peers.py).

Both peers train the same drafter design as this project on (input_ids, loss_mask, tapped hidden states) per
sequence. What conversion has to bridge, read in their installed code:

- Anchors. This project anchors a block at every a with loss_mask[a + 1] set (data/blocks.py), so also on the last
  prompt token before a reply; both peers need loss_mask[a] set too (SpecForge both, speculators loss_mask[a]).
  `peer_loss_mask` also marks the token before each reply, so the peers draw from the same anchor positions. In a
  multi-turn sample that token is also a label for a block of the previous reply that reaches it (at most B - 1
  blocks per turn).
- Labels. SpecForge trains on input_ids; speculators on the target's argmax, recomputed from the final decoder
  layer's output before the final norm, which its files carry as one more slot. For regenerated samples both are
  this project's labels (the target's greedy tokens). Prefilled samples (teacher.mode=prefill|mixed) are refused:
  their labels (`targets`) are not their input_ids.
- Layouts. SpecForge: one `torch.save` dict per sample, {input_ids int64 (T,), loss_mask int64 (T,),
  hidden_states (T, n*H) in the model's dtype}, files found recursively and sorted by path; a sample without two
  consecutive supervised tokens stops its run, so such samples are left out. speculators: a `datasets.save_to_disk`
  folder (input_ids, loss_mask, seq_len; torch format) and hidden_states/hs_<row>.safetensors with hidden_states
  (T, n + 1, H) (the taps in order, then the final pre-norm state) and token_ids (T,) equal to the row's input_ids.
  Its layer ids are hidden_states indices: this project's + 1.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_pipeline.data.shards import DatasetError, TeacherDataset
from dflash_pipeline.data.splits import PREFILLED
from dflash_pipeline.models.generation import capture_batched

PEERS = ("specforge", "speculators")


def peer_loss_mask(loss_mask: torch.Tensor) -> torch.Tensor:
    """loss_mask (T,) -> int64 (T,) with the token before each reply span marked too: a peer's anchor rule
    (loss_mask[a] and loss_mask[a + 1]) then admits exactly this project's anchors (loss_mask[a + 1])."""
    out = loss_mask.long().clone()
    starts = ((out[1:] == 1) & (out[:-1] == 0)).nonzero().squeeze(-1)  # a reply starts at starts + 1
    out[starts] = 1
    return out


def trainable_for_peers(mask: torch.Tensor) -> bool:
    """Whether a (peer) loss mask has two consecutive supervised tokens: SpecForge stops on a sample without."""
    return bool(((mask[1:] > 0) & (mask[:-1] > 0)).any())


def prenorm_final_hidden(model, sequences: list[list[int]], *, pad_id: int, max_tokens: int = 8192
                         ) -> list[torch.Tensor]:
    """The target's last decoder layer output before its final norm, (T, H) float32 per sequence: what speculators
    recomputes its labels from (lm_head(norm(h)))."""
    outs = capture_batched(model, sequences, [], pad_id=pad_id, max_tokens=max_tokens, prenorm_final=True)
    return [o["prenorm_final_hidden"].float().cpu() for o in outs]


def peer_samples(data: TeacherDataset, indices: list[int]) -> tuple[list[dict], int]:
    """The samples at `indices` with peer loss masks, those a peer can train on; and how many were left out."""
    if not data.has_features:
        raise DatasetError(f"teacher data at {data.folder} stores no features (teacher.feature_dtype=none): the peers "
                           "read stored hidden states; convert a dataset made with teacher.feature_dtype=bfloat16")
    prefilled = [data.ids[i] for i in indices if data.ids[i].startswith(PREFILLED)]
    if prefilled:
        raise DatasetError(f"{len(prefilled)} prefilled samples (e.g. {prefilled[0]!r}): the peers train on input_ids "
                           "or the target's argmax, not on stored labels; convert a teacher.mode=regenerate dataset")
    out, dropped = [], 0
    for i in indices:
        item = data[i]
        mask = peer_loss_mask(item["loss_mask"])
        if trainable_for_peers(mask):
            out.append({"id": data.ids[i], "input_ids": item["input_ids"].long(), "loss_mask": mask,
                        "features": item["features"]})
        else:
            dropped += 1
    if not out:
        raise DatasetError("no sample has a reply of at least one token: nothing for the peers to train on")
    return out, dropped


def _fresh(folder: Path) -> Path:
    """A temporary folder next to `folder`, empty; renamed to `folder` by _commit once complete."""
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _commit(tmp: Path, folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def write_specforge(samples: list[dict], folder: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """SpecForge's offline dflash data: <folder>/data_<i>.ckpt, one torch.save dict per sample. `dtype` must be the
    run's model.torch_dtype (it does not cast)."""
    folder = Path(folder)
    tmp = _fresh(folder)
    for i, s in enumerate(samples):
        torch.save({"input_ids": s["input_ids"], "loss_mask": s["loss_mask"],
                    "hidden_states": s["features"].to(dtype).contiguous()}, tmp / f"data_{i:06d}.ckpt")
    return _commit(tmp, folder)


def write_speculators(samples: list[dict], final_hidden: list[torch.Tensor], folder: str | Path) -> Path:
    """speculators' offline data: a datasets.save_to_disk folder + hidden_states/hs_<row>.safetensors, float32
    (the final slot decides its labels, so it is not rounded to bf16)."""
    from datasets import Dataset

    folder = Path(folder)
    tmp = _fresh(folder)
    (tmp / "hidden_states").mkdir()
    for i, (s, final) in enumerate(zip(samples, final_hidden)):
        n, width = s["features"].shape
        if final.shape[0] != n:
            raise ValueError(f"sample {s['id']}: {final.shape[0]} final hidden states for {n} tokens")
        taps = s["features"].float().view(n, -1, final.shape[-1])
        save_file({"hidden_states": torch.cat([taps, final[:, None]], dim=1).contiguous(),
                   "token_ids": s["input_ids"]}, str(tmp / "hidden_states" / f"hs_{i}.safetensors"))
    ds = Dataset.from_dict({"input_ids": [s["input_ids"].tolist() for s in samples],
                            "loss_mask": [s["loss_mask"].tolist() for s in samples],
                            "seq_len": [len(s["input_ids"]) for s in samples]})
    ds.set_format("torch")
    ds.save_to_disk(str(tmp))
    return _commit(tmp, folder)

"""The teacher dataset on disk: safetensors shards plus a JSON manifest, written crash-safe, read lazily.

Layout of a dataset folder:
  plan.json                 the ordered sample ids of every shard and the config hash (written first)
  shard-00000.safetensors   input_ids int32 (N,), loss_mask uint8 (N,), features (N, n*H) bf16 by default,
                            offsets int64 (S+1,): sample s is rows offsets[s]:offsets[s+1];
                            features in float8 (teacher.feature_dtype=float8_e4m3) add feature_scales float32
                            (N, n): one scale per token and tap, read back as bf16 (quantize_fp8);
                            teacher.feature_dtype=none stores no features (the stages capture them when needed);
                            optional topk_ids int32 (N, k), topk_logprobs float32 (N, k)
  shard-00000.json          the shard's record: sample ids, counts, sha256 (written after the shard: the commit mark)
  manifest.json             every shard record + target/layer metadata (written last: the dataset is complete)
Every file is written under a temporary name and renamed when complete, so a killed run never leaves a file that a
later stage would trust.
"""
from __future__ import annotations

import hashlib
import json
from bisect import bisect_right
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dflash_pipeline.runtime.files import atomic_path, write_json

FORMAT_VERSION = 1
# teacher.feature_dtype -> the dtype the features are stored in (float8: with per-token, per-tap scales; None: not
# stored, tokens only)
FEATURE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                  "float8_e4m3": torch.float8_e4m3fn, "none": None}
FP8 = torch.float8_e4m3fn


class DatasetError(Exception):
    """A teacher dataset that cannot be used, with the fix in the message."""


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def quantize_fp8(features: torch.Tensor, taps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """features (N, taps*H) -> (e4m3 values (N, taps*H), float32 scales (N, taps)): each token's tap is scaled so
    its largest |value| maps to e4m3's largest (448). Per tap because the tapped layers' magnitudes differ by orders
    (an early layer against a late one); e4m3 keeps ~2 significant digits of every value within 2^-6 of its
    tap's largest, the rest of its range subnormal."""
    N, D = features.shape
    x = features.float().view(N, taps, D // taps)
    scales = x.abs().amax(-1).clamp(min=1e-30) / torch.finfo(FP8).max
    return (x / scales[..., None]).to(FP8).view(N, D), scales


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The features quantize_fp8 stored, in `dtype`."""
    N, D = values.shape
    taps = scales.shape[-1]
    return (values.float().view(N, taps, D // taps) * scales.float()[..., None]).view(N, D).to(dtype)


def write_shard(folder: Path, index: int, samples: list[dict], feature_dtype: torch.dtype | None,
                process: str = "0 of 1", seconds: float | None = None, taps: int = 1) -> dict:
    """Write one shard of samples (dicts with id, input_ids, loss_mask, features[, topk_*]) and its record; `process`
    (rank of world size) says which process of a multi-process run wrote it; `seconds`, how long the target took to
    make it (what a recipe's teacher data cost, summed over the shards a training run uses); `taps`, how many
    tapped layers the features concatenate (float8 scales each one apart); feature_dtype None: no features."""
    lengths = [len(s["input_ids"]) for s in samples]
    offsets = torch.tensor([0] + lengths).cumsum(0)
    tensors = {
        "input_ids": torch.cat([torch.as_tensor(s["input_ids"], dtype=torch.int32) for s in samples]),
        "loss_mask": torch.cat([torch.as_tensor(s["loss_mask"], dtype=torch.uint8) for s in samples]),
        "offsets": offsets,
    }
    if feature_dtype == FP8:
        tensors["features"], tensors["feature_scales"] = quantize_fp8(torch.cat([s["features"] for s in samples]), taps)
    elif feature_dtype is not None:
        tensors["features"] = torch.cat([s["features"] for s in samples]).to(feature_dtype).contiguous()
    if "targets" in samples[0]:  # teacher.mode prefill / mixed: the label of each token (data/teacher.py)
        tensors["targets"] = torch.cat([torch.as_tensor(s["targets"], dtype=torch.int32) for s in samples])
    if "topk_ids" in samples[0]:
        tensors["topk_ids"] = torch.cat([s["topk_ids"] for s in samples]).to(torch.int32)
        tensors["topk_logprobs"] = torch.cat([s["topk_logprobs"] for s in samples]).float()
    name = shard_name(index)
    path = folder / f"{name}.safetensors"
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp))
        record = {
            "index": index,
            "file": path.name,
            "sha256": sha256_file(tmp),
            "bytes": tmp.stat().st_size,
            "ids": [s["id"] for s in samples],
            "num_samples": len(samples),
            "num_tokens": int(offsets[-1]),
            "num_loss_tokens": int(tensors["loss_mask"].sum()),
            "num_turns": [s["num_turns"] for s in samples],
            "process": process,
            "seconds": None if seconds is None else round(seconds, 2),
        }
    write_json(folder / f"{name}.json", record)
    return record


def read_shard_record(folder: Path, index: int, check: bool = True) -> dict | None:
    """The record of a completed shard, or None when the shard is missing, unfinished or (check=True) corrupt."""
    meta = folder / f"{shard_name(index)}.json"
    if not meta.is_file():
        return None
    record = json.loads(meta.read_text())
    path = folder / record["file"]
    if not path.is_file() or path.stat().st_size != record["bytes"]:
        return None
    if check and sha256_file(path) != record["sha256"]:
        return None
    return record


class TeacherDataset(torch.utils.data.Dataset):
    """Random access to a finished teacher dataset; features are read lazily (memory-mapped slices per sample)."""

    def __init__(self, folder: str | Path, verify: bool = True):
        self.folder = Path(folder)
        manifest = self.folder / "manifest.json"
        if not manifest.is_file():
            raise DatasetError(
                f"no teacher dataset at {self.folder} (manifest.json missing: unfinished or never run); "
                "run dflash-teacher for it first"
            )
        self.manifest = json.loads(manifest.read_text())
        if self.manifest.get("format_version") != FORMAT_VERSION:
            raise DatasetError(f"{manifest}: format_version {self.manifest.get('format_version')} != {FORMAT_VERSION}")
        self.shards = self.manifest["shards"]
        self.ids = [i for s in self.shards for i in s["ids"]]
        self._starts = [0]
        for s in self.shards:
            self._starts.append(self._starts[-1] + s["num_samples"])
        self._handles: dict[int, Any] = {}
        self._offsets: dict[int, list[int]] = {}
        if verify:
            self.verify()

    # -- metadata --------------------------------------------------------------------------------------------
    @property
    def layer_ids(self) -> list[int]:
        return self.manifest["layer_ids"]

    @property
    def has_features(self) -> bool:
        """False for a tokens-only dataset (teacher.feature_dtype=none): its readers capture the features."""
        return self.manifest.get("feature_dtype") != "none"

    @property
    def hidden_size(self) -> int:
        return self.manifest["target"]["hidden_size"]

    @property
    def num_tokens(self) -> int:
        return sum(s["num_tokens"] for s in self.shards)

    @property
    def teacher_seconds(self) -> float | None:
        """Seconds the target spent making every shard (generation, prefill, features; not loading the target or
        the data), or None for shards written before this was recorded."""
        times = [s.get("seconds") for s in self.shards]
        return None if None in times else sum(times)

    def verify(self) -> None:
        """Check every shard against the manifest checksum; a bad one is named in the error."""
        for s in self.shards:
            path = self.folder / s["file"]
            if not path.is_file():
                raise DatasetError(f"teacher shard missing: {path}; rerun dflash-teacher to regenerate it")
            if path.stat().st_size != s["bytes"] or sha256_file(path) != s["sha256"]:
                raise DatasetError(
                    f"corrupt teacher shard {path} (checksum mismatch); delete it and its .json record and rerun "
                    "dflash-teacher to regenerate it"
                )

    # -- access ----------------------------------------------------------------------------------------------
    def _shard(self, k: int):
        if k not in self._handles:
            path = self.folder / self.shards[k]["file"]
            try:
                handle = safe_open(str(path), framework="pt")
                self._offsets[k] = handle.get_tensor("offsets").tolist()
            except (SafetensorError, OSError) as e:
                raise DatasetError(f"corrupt teacher shard {path}: {e}") from e
            self._handles[k] = handle
        return self._handles[k], self._offsets[k]

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        k = bisect_right(self._starts, i) - 1
        handle, offsets = self._shard(k)
        j = i - self._starts[k]
        a, b = offsets[j], offsets[j + 1]
        item = {name: handle.get_slice(name)[a:b] for name in handle.keys() if name != "offsets"}
        if "feature_scales" in item:  # float8 features: read as bf16
            item["features"] = dequantize_fp8(item["features"], item.pop("feature_scales"))
        item["loss_mask"] = item["loss_mask"].bool()
        item["input_ids"] = item["input_ids"].long()
        item["id"] = self.ids[i]
        return item

    def __iter__(self) -> Iterator[dict]:
        return (self[i] for i in range(len(self)))

    def length(self, i: int) -> int:
        """Tokens of sample i, from its shard's offsets (nothing else is read)."""
        k = bisect_right(self._starts, i) - 1
        offsets = self._shard(k)[1]
        j = i - self._starts[k]
        return offsets[j + 1] - offsets[j]

    def __getstate__(self):  # safe_open handles do not pickle; DataLoader workers reopen them
        state = self.__dict__.copy()
        state["_handles"], state["_offsets"] = {}, {}
        return state

    def as_hf_dataset(self):
        """The same samples as a `datasets.IterableDataset` (streams from the shards, copies nothing)."""
        import datasets

        folder = str(self.folder)

        def gen():
            ds = TeacherDataset(folder, verify=False)
            for i in range(len(ds)):
                item = ds[i]
                yield {k: (v.float().numpy() if torch.is_tensor(v) and v.is_floating_point() else
                           v.numpy() if torch.is_tensor(v) else v) for k, v in item.items()}

        return datasets.IterableDataset.from_generator(gen)


def merge_datasets(sources: list[str | Path], out: str | Path) -> Path:
    """One teacher dataset made of several finished ones (e.g. a regenerated run and a prefilled run: a mixture
    without paying for either again). The shards are symbolic links to the sources' files, so nothing is copied;
    the manifest, written last, lists every source shard under its new index. The sources must share the target,
    the tapped layers, the feature dtype and top-k, and must not share sample ids (held-out splits hash ids)."""
    out = Path(out)
    datasets = [TeacherDataset(s) for s in sources]
    if len(datasets) < 2:
        raise DatasetError("merging needs at least two teacher datasets")
    first = datasets[0].manifest
    for d in datasets[1:]:
        m = d.manifest
        for key, what in (("layer_ids", "tapped layers"), ("feature_dtype", "feature dtype"),
                          ("topk_logprobs", "stored top-k")):
            if m[key] != first[key]:
                raise DatasetError(f"{d.folder} and {datasets[0].folder} differ in {what} ({m[key]} vs {first[key]}): "
                                   "only datasets made with the same teacher settings can be merged")
        if m["target"]["ref"] != first["target"]["ref"]:
            raise DatasetError(f"{d.folder} was made by target {m['target']['ref']}, {datasets[0].folder} by "
                               f"{first['target']['ref']}: merge datasets of one target")
    ids = [i for d in datasets for i in d.ids]
    if len(set(ids)) != len(ids):
        raise DatasetError("the datasets share sample ids (the same conversations in the same mode); merge "
                           "disjoint datasets, e.g. a second run with data.skip past the first one's conversations")
    if (out / "manifest.json").exists():
        raise DatasetError(f"{out} already holds a teacher dataset; choose another folder or delete it")
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for d in datasets:
        for s in d.shards:
            name = shard_name(len(records))
            link = out / f"{name}.safetensors"
            link.unlink(missing_ok=True)
            link.symlink_to((d.folder / s["file"]).resolve())
            records.append({**s, "index": len(records), "file": link.name})
    digest = hashlib.sha256(":".join(d.manifest["config_hash"] for d in datasets).encode()).hexdigest()[:16]
    write_json(out / "manifest.json", {
        **first,
        "config_hash": digest,
        "mode": "merged",
        "merged_from": [{"folder": str(d.folder.resolve()), "config_hash": d.manifest["config_hash"],
                         "mode": d.manifest.get("mode", "regenerate"), "num_samples": len(d)} for d in datasets],
        "num_prefilled": sum(d.manifest.get("num_prefilled", 0) for d in datasets),
        "num_samples": len(ids),
        "num_tokens": sum(r["num_tokens"] for r in records),
        "num_loss_tokens": sum(r["num_loss_tokens"] for r in records),
        "notes": [n for d in datasets for n in d.manifest.get("notes", [])],
        "shards": records,
    })
    return out

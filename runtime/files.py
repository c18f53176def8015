"""How the pipeline writes its files: under a temporary name, renamed once complete (a killed stage never leaves a
half-written file that a later stage would trust), with the permissions the user's umask gives. The last point is
not automatic: safetensors writes 0600, so a serving process running as another user could not read an export.
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import save_file


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def follow_umask(path: str | Path) -> None:
    """Give a file, or a folder and everything under it, the mode a new file / folder gets under the umask."""
    path, mask = Path(path), _umask()
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to `path`; once the block has written it, it gets its umask mode and replaces
    `path`. If the block raises, `path` is untouched. The temporary name is this process's own: processes writing the
    same file at once (jobs sharing a cache, a spool's two sides, parallel test workers) each replace it whole."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    yield tmp
    follow_umask(tmp)
    os.replace(tmp, path)


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_json(path: str | Path, obj: Any, indent: int = 1) -> None:
    write_text(path, json.dumps(obj, indent=indent) + "\n")


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict | None = None) -> None:
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


def publish_folder(tmp: str | Path, out: str | Path, marker: str = "config.json") -> Path:
    """Rename a finished folder `tmp` to `out` (with its umask mode). Where another process published `out` first
    (jobs of a sweep or test workers filling one cache at once), keep that one, whose content is the same, and drop
    `tmp`; a folder in the way without `marker` (a corrupt one) is an error."""
    tmp, out = Path(tmp), Path(out)
    follow_umask(tmp)
    try:
        tmp.rename(out)
    except OSError:
        if not (out / marker).is_file():
            raise
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out

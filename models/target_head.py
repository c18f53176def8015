"""The target without its decoder layers (TargetHead): what a process whose features come from elsewhere (a feature
producer, vLLM's capture) needs of it, read from the model folder's safetensors without allocating the body.
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from dflash_pipeline.models.errors import TargetError


class TargetHead(torch.nn.Module):
    """The target without its decoder layers: config, generation config, input embeddings and output head, the
    parts a drafter shares with its target. For a process whose features come from elsewhere (a feature producer,
    vLLM's capture): the body's memory is never allocated there."""

    def __init__(self, config, generation_config, embed: torch.nn.Module, head: torch.nn.Module):
        super().__init__()
        self.config, self.generation_config = config, generation_config
        self.embed_tokens, self.lm_head = embed, head

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed_tokens

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head


def _weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise TargetError(f"{folder} holds no safetensors weights: a target without its body is read from them")
    return files


def load_head(folder: str | Path, dtype: torch.dtype, trust_remote_code: bool = False) -> TargetHead:
    """TargetHead of the model folder: the module names come from a skeleton built on the meta device (no memory),
    the two weights from the safetensors files (a stored name matched exactly, else by its last two parts); an
    output head that is not stored is the embeddings, tied."""
    folder = Path(folder)
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        folder = Path(snapshot_download(str(folder), allow_patterns=["*.json", "*.safetensors"]))
    config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    try:
        generation = GenerationConfig.from_pretrained(folder)
    except OSError:
        generation = GenerationConfig.from_model_config(config)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    names = {id(m): n for n, m in skeleton.named_modules()}
    parts = {"embed": skeleton.get_input_embeddings(), "head": skeleton.get_output_embeddings()}
    wanted = {part: names[id(module)] + ".weight" for part, module in parts.items()}
    found: dict[str, torch.Tensor] = {}
    for file in _weight_files(folder):
        with safe_open(file, framework="pt") as f:
            for part, name in wanted.items():
                tail = ".".join(name.split(".")[-2:])
                key = name if name in f.keys() else next((k for k in f.keys() if k.endswith(tail)), None)
                if key is not None and part not in found:
                    found[part] = f.get_tensor(key).to(dtype)
    if "embed" not in found:
        raise TargetError(f"{folder}: no input embeddings ({wanted['embed']}) among its safetensors weights")
    embed = torch.nn.Embedding.from_pretrained(found["embed"], freeze=True)
    weight = found.get("head", found["embed"])  # not stored: tied, the head reads the embeddings' own weight
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")  # no init: the global RNG
    head.weight = torch.nn.Parameter(weight, requires_grad=False) if "head" in found else embed.weight  # stays put
    return TargetHead(config, generation, embed, head)

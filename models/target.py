"""The frozen target (verifier): the Target record and load_target, which loads it in the dtype this machine runs
fastest (models/precision.py) from the source models/target_sources.py resolves; models/families.py reads what
differs between families, models/target_head.py loads the head alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerBase

from dflash_pipeline.models.cache import CacheError, check_supported
from dflash_pipeline.models.errors import TargetError
from dflash_pipeline.models.families import text_config
from dflash_pipeline.models.precision import machine, resolve_dtype
from dflash_pipeline.models.target_head import load_head
from dflash_pipeline.models.target_sources import build_tiny, load_tokenizer, resolve_pretrained, target_folder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Target:
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    ref: str  # how to find this target again (recorded in datasets and checkpoints)
    numerics: dict = field(default_factory=dict)  # the dtype it runs in, why, and the machine (models/precision.py)
    rollback: str = "record"  # how a recurrent target's state goes back after a verify (models/cache.py Rollback)

    @property
    def dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    @property
    def config(self):
        """The text decoder's config (an image-text wrapper's language model): what layer ids count."""
        return text_config(self.model)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def eos_ids(self) -> set[int]:
        """Every token that ends a reply: the tokenizer's EOS and the generation config's (may be a list)."""
        ids = self.model.generation_config.eos_token_id
        ids = ids if isinstance(ids, list) else [ids]
        return {i for i in [self.tokenizer.eos_token_id, *ids] if i is not None}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise TargetError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}")
    return DTYPES[name]


def target_ref(cfg) -> str:
    """How a target config is recorded in datasets, checkpoints and exports."""
    if cfg.kind == "tiny":
        ref = f"tiny:{cfg.tiny.hidden_size}x{cfg.tiny.num_hidden_layers}:seed{cfg.tiny.init_seed}"
        return ref + (f":std{cfg.tiny.initializer_range:g}" if cfg.tiny.initializer_range != 0.02 else "")
    return cfg.path if cfg.kind == "hf" else f"{cfg.path}/{cfg.gguf_file}"


def load_target(cfg, cache_dir: str | Path, body: bool = True) -> Target:
    """Load the frozen target in eval mode with no gradients. `cfg` is a conf.schema.TargetConfig. body=False: its
    head alone (TargetHead: config, embeddings, output head), read from target_folder, in the same dtype."""
    tokenizer = load_tokenizer(cfg, cache_dir)
    name, why = resolve_dtype(str(cfg.dtype), "cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch_dtype(name)
    ref = target_ref(cfg)
    if not body:
        model = load_head(target_folder(cfg, cache_dir), dtype, trust_remote_code=cfg.trust_remote_code)
    elif cfg.kind == "tiny":
        model = build_tiny(cfg, tokenizer).to(dtype)
    else:
        src = resolve_pretrained(cfg.kind, cfg.path, cfg.gguf_file, cache_dir)
        try:
            model, info = AutoModelForCausalLM.from_pretrained(
                src, dtype=dtype, trust_remote_code=cfg.trust_remote_code, output_loading_info=True)
        except OSError as e:
            raise TargetError(f"cannot load target {cfg.path!r}: {str(e).splitlines()[0]}") from e
        except ValueError as e:  # transformers has no causal LM class for this config
            raise TargetError(f"cannot load target {cfg.path!r} as a causal LM: {str(e).splitlines()[0]}") from e
        if info.get("missing_keys"):  # newly initialised weights would make a random verifier, silently
            missing = sorted(info["missing_keys"])
            raise TargetError(f"target {cfg.path!r} lacks weights {missing[:3]}{' ...' if len(missing) > 3 else ''}: "
                              "the folder does not hold this causal LM's checkpoint")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if body:  # the head alone decodes nothing: no cache to support
        try:
            check_supported(model)
        except CacheError as e:
            raise TargetError(f"target {ref!r} is not supported: {e}") from e
    model.eval().requires_grad_(False)
    return Target(model=model, tokenizer=tokenizer, ref=ref, numerics={"dtype": name, **why, "machine": machine()},
                  rollback=str(cfg.get("rollback", "record")))

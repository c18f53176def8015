"""The frozen target (verifier): loading it from a GGUF package, the hub/a folder, or building the tiny one.

GGUF loading dequantises every tensor, far slower than reading a safetensors folder, so the first load converts it
into a safetensors model folder under the cache directory and every later load reads that folder (docs/data.md).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import (AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig,
                          LlamaForCausalLM, PreTrainedTokenizerBase)

from dflash_pipeline.runtime.files import publish_folder
from dflash_pipeline.models.cache import CacheError, check_supported
from dflash_pipeline.models.precision import machine, resolve_dtype

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TargetError(Exception):
    """A target that cannot be loaded, with the fix in the message."""


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


try:  # transformers' per-layer configurations (Gemma 4): a global read of a per-layer value raises this
    from transformers.integrations.heterogeneity.configuration_utils import AmbiguousGlobalPerLayerAttributeError
except ImportError:  # older transformers: no per-layer configurations
    AmbiguousGlobalPerLayerAttributeError = AttributeError


def text_config(model):
    """The config of the text decoder: the model's own, or an image-text wrapper's text_config."""
    return model.config.get_text_config(decoder=True)


def config_value(config, name: str, default=None):
    """A value of a target's config. Where it is per layer (Gemma 4's head_dim, ...), the first full-attention
    layer's: the drafter's attention is full attention."""
    try:
        return getattr(config, name, default)
    except AmbiguousGlobalPerLayerAttributeError:
        types = list(getattr(config, "layer_types", None) or [])
        layer = types.index("full_attention") if "full_attention" in types else 0
        return getattr(config.per_layer_config[layer], name, default)


FINAL_NORMS = ("norm", "norm_f", "final_layernorm", "embedding_norm")  # Llama-likes, Nemotron-H, Falcon-H1, LFM2


def final_norm(model) -> torch.nn.Module:
    """The target's final norm (its output is the last hidden state the LM head reads), by the families' names."""
    for name in FINAL_NORMS:
        norm = getattr(model.model, name, None)
        if norm is not None:
            return norm
    raise TargetError(f"{type(model).__name__}: no final norm among {', '.join(FINAL_NORMS)} of its decoder "
                      "(models/target.py FINAL_NORMS)")


def output_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The target's logits from its final hidden states as its own forward computes them: the LM head, then the
    family's output transforms (Granite's logits_scaling, Falcon-H1's lm_head_multiplier, Gemma's final soft-capping).
    Greedy choices do not change with them; distributions (stored top-k log-probs, sampling) do."""
    config = text_config(model)
    logits = model.lm_head(hidden)
    if getattr(config, "logits_scaling", None):
        logits = logits / config.logits_scaling
    multiplier = getattr(getattr(model, "model", None), "lm_head_multiplier", None)
    if multiplier is not None:
        logits = logits * multiplier
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def tapped(hidden_states, layer_ids: list[int]) -> torch.Tensor:
    """The tapped layers' outputs, concatenated in layer order: (..., T, n*H). Layer i is the output of decoder layer
    i, transformers' hidden_states[i + 1] (hidden_states[0] is the embeddings); no taps gives width 0. The one place
    this contract is written: datasets, the decoding loop and exports all count layers this way."""
    if not layer_ids:
        return hidden_states[-1][..., :0]
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise TargetError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}")
    return DTYPES[name]


def default_layer_ids(num_layers: int, num_taps: int) -> list[int]:
    """DFlash spacing: one tap in the middle, else evenly from layer 1 to layer L-3 (docs/methods.md,
    'Tapped layers')."""
    if num_taps == 1:
        return [num_layers // 2]
    ids = [round(1 + i * (num_layers - 4) / (num_taps - 1)) for i in range(num_taps)]
    if (len(set(ids)) < num_taps or min(ids) < 0) and num_taps <= num_layers:  # too shallow: spread over all layers
        ids = [round(i * (num_layers - 1) / (num_taps - 1)) for i in range(num_taps)]
    return ids


def resolve_layer_ids(layer_ids: list[int] | None, num_taps: int, num_layers: int) -> list[int]:
    """The tapped layers, validated against the target. Layer i is the output of decoder layer i."""
    ids = list(layer_ids) if layer_ids is not None else default_layer_ids(num_layers, num_taps)
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise TargetError(
            f"teacher.layer_ids {bad} out of range: the target has {num_layers} layers (valid ids 0..{num_layers - 1})"
        )
    if len(set(ids)) != len(ids) or ids != sorted(ids):
        raise TargetError(f"teacher.layer_ids {ids} must be strictly increasing")
    return ids


def package_dir(package: str) -> Path:
    """The folder of an installed package, found without importing it (its __init__ may import missing modules)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pip_name = package.replace("_", "-")
        raise TargetError(f"package {package!r} is not installed; run: pip install --no-deps {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def _gguf_source(path: str, gguf_file: str | None) -> Path:
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
        return str(_converted_gguf(_gguf_source(path, gguf_file), Path(cache_dir)))
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


def build_tiny(cfg, vocab_size: int, special: dict[str, int]) -> LlamaForCausalLM:
    t = cfg.tiny
    config = LlamaConfig(
        vocab_size=vocab_size,
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
    special = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build_tiny(cfg, len(tokenizer), special).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    return publish_folder(tmp, out)


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
        special = {k: getattr(tokenizer, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        model = build_tiny(cfg, len(tokenizer), special).to(dtype)
    else:
        src = resolve_pretrained(cfg.kind, cfg.path, cfg.gguf_file, cache_dir)
        try:
            model, info = AutoModelForCausalLM.from_pretrained(src, dtype=dtype, trust_remote_code=cfg.trust_remote_code,
                                                               output_loading_info=True)
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

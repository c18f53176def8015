"""Structured configs: the typed schema every YAML file under conf/ is validated against.

Registered with Hydra's ConfigStore as the base of each config group, so a misspelt key or a value of the wrong type
fails when the config is composed, before any work starts, with Hydra's message naming the key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf


@dataclass
class TinyTargetConfig:
    """A randomly initialised Llama-style target built in-process (tests, smoke runs)."""

    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    init_seed: int = 0


@dataclass
class TargetConfig:
    """The frozen target (verifier) model.

    kind: "gguf" (a GGUF file inside an installed package or a local folder, converted once into a cached
    safetensors folder), "hf" (a Hugging Face model id or local model folder), or "tiny".
    """

    kind: str = "gguf"
    path: str = MISSING  # HF id / local folder, or for gguf: "pkg:<package>" or a local folder holding gguf_file
    gguf_file: Optional[str] = None
    tokenizer: Optional[str] = None  # tiny: where its tokenizer comes from (an HF id/folder, or "target:<name>")
    dtype: str = "float32"
    trust_remote_code: bool = False
    tiny: TinyTargetConfig = field(default_factory=TinyTargetConfig)


@dataclass
class DataConfig:
    """Where prompts come from (data/sources.py): sharegpt | mtbench | humaneval | file | hf."""

    source: str = "sharegpt"
    path: Optional[str] = None
    name: Optional[str] = None
    split: str = "train"  # train | heldout | all (deterministic split by id)
    heldout_fraction: float = 0.02
    skip: int = 0
    num_samples: Optional[int] = 64
    max_prompt_tokens: int = 512


@dataclass
class TeacherConfig:
    """Teacher-data regeneration with the frozen target (data/teacher.py)."""

    out_dir: str = "teacher"  # relative to the run directory
    num_taps: int = 5
    layer_ids: Optional[list[int]] = None  # None: the DFlash spacing formula for num_taps
    max_new_tokens: int = 256
    max_turns: int = 1  # assistant turns regenerated per conversation, in order
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    batch_size: int = 32  # most rows decoded together
    prefill_batch_tokens: int = 4096  # rows x longest prompt of a generation batch (length bucketing)
    capture_batch_tokens: int = 8192  # rows x longest sequence of a feature-capture prefill batch
    shard_size: int = 64  # samples per shard
    feature_dtype: str = "bfloat16"
    topk_logprobs: int = 0  # >0: also store the target's top-k log-probs per position (distillation)


@dataclass
class DrafterConfig:
    """The DFlash block drafter (models/drafter.py)."""

    num_layers: int = 2
    hidden_size: Optional[int] = None  # None: the target's hidden size
    intermediate_size: Optional[int] = None  # None: the target's intermediate size
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    block_size: int = 16
    mask_token_id: Optional[int] = None  # None: chosen from the tokenizer (see README)
    init: str = "random"  # random | target: layers and final norm copied from the target's last layers
    # The attention kernel (models/drafter.py ATTENTION_FUNCTIONS): eager = plain matmul + softmax, the reference;
    # sdpa = torch's scaled_dot_product_attention (fused kernels on GPU). Not part of the export.
    attn_implementation: str = "sdpa"


@dataclass
class TrainerConfig:
    """The one training loop (train/loop.py); `component` picks what it trains."""

    component: str = "drafter"
    out_dir: str = "train"
    data_dir: Optional[str] = None  # teacher dataset; None: the teacher stage's output in this run directory
    steps: int = 100
    lr: float = 6e-4
    warmup_steps: int = 10
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    batch_sequences: int = 8  # global batch (all processes, all micro-batches) of sequences per optimizer step
    grad_accum: int = 1  # micro-batches per process per step
    anchors_per_sequence: int = 48
    loss: str = "decay"  # decay | dpace | kl
    gamma: Optional[float] = None  # decay constant; None: from the block size (7 for 16, 5 for 10, 4 for 8)
    dpace_alpha: float = 0.5
    draft_vocab_size: Optional[int] = None  # None: full vocabulary (what engines expect)
    heldout_samples: int = 16  # teacher sequences kept out of training for held-out metrics
    mixed_precision: str = "no"  # no | bf16 | fp16 (accelerate)
    online: bool = False  # features from the target in the loop instead of the stored teacher features
    resume: bool = False  # a killed run of the same config always resumes; true: also from another config's
    save_every: int = 50
    keep_checkpoints: int = 2
    eval_every: int = 50
    log_every: int = 10


@dataclass
class EvalConfig:
    """Evaluation (eval/stage.py): offline (teacher-forced) and online (real verification) acceptance, speed."""

    out_dir: str = "eval"
    # mtbench (first turns) | humaneval | heldout (held-out ShareGPT prompts) | a .json/.jsonl/.parquet path | hf:<id>
    datasets: list[str] = field(default_factory=lambda: ["mtbench", "humaneval", "heldout"])
    num_prompts: int = 8  # per dataset
    max_new_tokens: int = 64
    max_prompt_tokens: Optional[int] = None  # None: whatever fits the target's context with max_new_tokens
    block_size: Optional[int] = None  # None: the trained block size; may be smaller, never larger
    temperature: float = 0.0  # 0: greedy (outputs must equal autoregressive decoding); >0: speculative sampling
    seed: int = 0  # sampling generators (temperature > 0)
    drafter_dir: Optional[str] = None  # an exported drafter folder; None: <run dir>/<trainer.out_dir>/export
    methods: list[str] = field(default_factory=lambda: ["chain"])  # eval/decode.py METHODS
    recall_k: list[int] = field(default_factory=lambda: [1, 4, 16])  # offline Recall@K
    timing_repeats: int = 1  # A B B A passes (AR, spec, spec, AR) per prompt, after one warm-up per dataset
    strict_exact: bool = True  # greedy: raise on any speculative/autoregressive mismatch (False: record it)
    # torch intra-op threads while evaluating (restored after); None: torch's own setting. 1 by default: batch-1
    # decoding is made of tiny matmuls, and on a shared CPU extra threads mostly wait on each other (tiny eval
    # measured 3.6 s with 1 thread vs 63 s with 2 on a busy 2-core machine, with meaningless speedups).
    num_threads: Optional[int] = 1


@dataclass
class LoggerConfig:
    """wandb logging; offline unless an API key is configured. kind: wandb | none."""

    kind: str = "wandb"
    project: str = "dflash"
    mode: Optional[str] = None  # None: online with WANDB_API_KEY set, else offline
    group: Optional[str] = None


@dataclass
class Config:
    name: str = "default"
    seed: int = 0
    cache_dir: str = "${oc.env:DFLASH_CACHE,${oc.env:HOME}/.cache/dflash-pipeline}"
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


def _mkdir(path: str) -> str:
    Path(path).mkdir(parents=True, exist_ok=True)
    return path


def register() -> None:
    """Register the schema: `base_config` for the root, `<group>/base` for each group's YAML files to extend."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    # ${mkdir:path} -> path, created: for files opened before Hydra makes the sweep folder (the Optuna study).
    OmegaConf.register_new_resolver("mkdir", _mkdir, replace=True)
    for group, node in [
        ("target", TargetConfig),
        ("data", DataConfig),
        ("teacher", TeacherConfig),
        ("drafter", DrafterConfig),
        ("trainer", TrainerConfig),
        ("eval", EvalConfig),
        ("logger", LoggerConfig),
    ]:
        cs.store(group=group, name="base", node=node)

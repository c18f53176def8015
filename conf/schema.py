"""Structured configs: the typed schema every YAML file under conf/ is validated against.

Registered with Hydra's ConfigStore as the base of each config group, so a misspelt key, a value of the wrong type or
an unknown choice (the Enum fields) fails when the config is composed, with Hydra's message naming the key and the
valid choices. Numeric ranges are declared next to each field (`ranged`) and checked by `check_config`, which every
stage calls before it reads or writes anything.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf



class Choice(str, Enum):
    """A config choice: compares, hashes, formats and serialises as its plain string value ("kl" == Loss.kl)."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


class TargetKind(Choice):
    gguf = "gguf"
    hf = "hf"
    tiny = "tiny"


class DType(Choice):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class FeatureDType(Choice):
    """How the teacher stores tapped features: float8_e4m3 is e4m3 with a float32 scale per token and tap, half
    the bytes of bfloat16 (data/shards.py: quantize_fp8), read back as bfloat16; none stores tokens only, and every
    stage that reads the dataset captures the features from the target when it needs them (trainer.online)."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"
    float8_e4m3 = "float8_e4m3"
    none = "none"


class TargetDType(Choice):
    auto = "auto"  # bfloat16 where the machine multiplies bf16 natively (measured: models/precision.py), else float32
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Source(Choice):
    sharegpt = "sharegpt"
    mtbench = "mtbench"
    humaneval = "humaneval"
    file = "file"
    hf = "hf"


class Split(Choice):
    train = "train"
    heldout = "heldout"
    all = "all"


class Rollback(Choice):
    record = "record"
    replay = "replay"


class Capture(Choice):
    during = "during"
    separate = "separate"
    engine = "engine"  # vLLM's own extraction (teacher.engine=vllm): a prefill in the engine that wrote the replies


class TeacherMode(Choice):
    regenerate = "regenerate"
    prefill = "prefill"
    mixed = "mixed"


class DrafterInit(Choice):
    random = "random"
    target = "target"


class Attention(Choice):
    eager = "eager"
    sdpa = "sdpa"
    flex = "flex"


class Loss(Choice):
    decay = "decay"
    dpace = "dpace"
    kl = "kl"


class MixedPrecision(Choice):
    no = "no"
    fp16 = "fp16"
    bf16 = "bf16"
    fp8 = "fp8"


class Engine(Choice):
    hf = "hf"  # the project's own loop on transformers
    vllm = "vllm"  # vLLM in its own virtual environment (models/vllm_engine.py; bash scripts/setup_vllm.sh)


class ServingEngine(Choice):  # eval.served.engine
    vllm = "vllm"  # vLLM in its own virtual environment (models/vllm_engine.py; bash scripts/setup_vllm.sh)
    llamacpp = "llamacpp"  # llama-server on GGUF files (models/llamacpp_engine.py; bash scripts/setup_llamacpp.sh)


class GGUFType(Choice):  # export.gguf: what llama.cpp's converter writes (below 8 bits: llama-quantize's)
    f32 = "f32"  # the exact gate's
    f16 = "f16"
    bf16 = "bf16"
    q8_0 = "q8_0"


class ServedMethod(Choice):  # eval.served.method: the own loop's method the served drafter is gated against
    chain = "chain"  # the drafter's export (DFlash; DFlash2 with its pass-through selector)
    selector_greedy = "selector_greedy"  # the DFlash2 checkpoint with the trained selector (train/selector/export)


class FeatureSource(Choice):  # trainer.features
    dataset = "dataset"  # the teacher dataset's stored features (or the target's, captured in the loop: trainer.online)
    producer = "producer"  # a feature producer's, through a spool (data/producer.py): no target body in the trainer


class DraftSampleMethod(Choice):  # vLLM's speculative_config.draft_sample_method
    greedy = "greedy"
    probabilistic = "probabilistic"


class AcceptanceRule(Choice):  # eval/decode.py ACCEPTANCE_RULES
    sampled = "sampled"
    greedy_draft = "greedy_draft"


class LoggerKind(Choice):
    wandb = "wandb"
    none = "none"


class WandbMode(Choice):
    online = "online"
    offline = "offline"
    disabled = "disabled"
    shared = "shared"


class ConfigError(ValueError):
    """A config value outside its valid range; the message names the key, the value and the range."""


def ranged(default: Any = None, *, ge=None, gt=None, le=None, lt=None, nonempty: bool = False, factory=None):
    """A field whose value (every element, for a list) must satisfy the bounds; None always passes (= automatic)."""
    bounds = {"ge": ge, "gt": gt, "le": le, "lt": lt, "nonempty": nonempty}
    if factory is not None:
        return field(default_factory=factory, metadata={"range": bounds})
    return field(default=default, metadata={"range": bounds})


@dataclass
class TinyTargetConfig:
    """A randomly initialised Llama-style target built in-process (tests, smoke runs)."""

    hidden_size: int = ranged(64, ge=1)
    intermediate_size: int = ranged(128, ge=1)
    num_hidden_layers: int = ranged(6, ge=1)
    # head_dim 32: the smallest head vLLM's CPU attention runs (the served eval and the vLLM teacher load this target)
    num_attention_heads: int = ranged(2, ge=1)
    num_key_value_heads: int = ranged(2, ge=1)
    max_position_embeddings: int = ranged(2048, ge=1)
    init_seed: int = 0
    # std of the random weights: 0.02 (transformers' default) decodes greedily into a one-token loop; ~0.1 gives an
    # output that varies (tests/test_contract.py decodes on such a target)
    initializer_range: float = ranged(0.02, gt=0.0)


@dataclass
class TargetConfig:
    """The frozen target (verifier) model.

    kind: "gguf" (a GGUF file inside an installed package or a local folder, converted once into a cached
    safetensors folder), "hf" (a Hugging Face model id or local model folder), or "tiny".
    """

    kind: TargetKind = TargetKind.gguf
    path: str = MISSING  # HF id / local folder, or for gguf: "pkg:<package>" or a local folder holding gguf_file
    gguf_file: Optional[str] = None
    tokenizer: Optional[str] = None  # tiny: where its tokenizer comes from (an HF id/folder, or "target:<name>")
    # the target's numerics in teacher and eval: float32 (exact, strict check), bfloat16/float16 (exact up to
    # reported near-ties, eval.near_tie_tolerance), or auto (per machine, recorded with the results)
    dtype: TargetDType = TargetDType.float32
    trust_remote_code: bool = False
    # arguments of the chat template (apply_chat_template), e.g. {enable_thinking: false} for thinking templates:
    # the teacher's and the eval's prompts are rendered with them (docs/targets.md, 'Thinking templates')
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # how a recurrent target's state (linear attention, SSM) goes back after rejected drafts: record (the verify
    # keeps per-position states) or replay (restore a copy, forward the accepted tokens again); docs/targets.md
    rollback: Rollback = Rollback.record
    tiny: TinyTargetConfig = field(default_factory=TinyTargetConfig)


@dataclass
class DataConfig:
    """Where prompts come from (data/sources.py)."""

    source: Source = Source.sharegpt
    path: Optional[str] = None
    name: Optional[str] = None
    split: Split = Split.train  # deterministic split by id
    heldout_fraction: float = ranged(0.02, ge=0.0, le=1.0)
    skip: int = ranged(0, ge=0)
    num_samples: Optional[int] = ranged(64, ge=1)  # None: all
    max_prompt_tokens: int = ranged(512, ge=1)
    # only conversations with at least this many tokens over all their turns (long-sequence recipes); 0: any
    min_tokens: int = ranged(0, ge=0)


@dataclass
class TeacherConfig:
    """Teacher-data regeneration with the frozen target (data/teacher.py)."""

    out_dir: str = "teacher"  # relative to the run directory
    num_taps: int = ranged(5, ge=1)
    layer_ids: Optional[list[int]] = ranged(None, ge=0)  # None: the DFlash spacing formula for num_taps
    max_new_tokens: int = ranged(256, ge=1)
    max_turns: int = ranged(1, ge=1)  # assistant turns regenerated per conversation, in order
    temperature: float = ranged(0.0, ge=0.0)  # 0 = greedy
    top_p: float = ranged(1.0, gt=0.0, le=1.0)
    batch_size: int = ranged(32, ge=1)  # most rows decoded together (continuous batching: finished rows refilled)
    prefill_batch_tokens: int = ranged(4096, ge=1)  # rows x longest prompt of the prompts admitted together
    capture_batch_tokens: int = ranged(8192, ge=1)  # rows x longest sequence of a feature-capture prefill batch
    # during: features kept as generation computes them, the default as it spares separate's pass (figures:
    # docs/results/benchmarks.md); separate: one extra right-padded prefill pass after generation (features
    # bit-identical however samples are batched); engine: vLLM captures them (teacher.engine=vllm) in a prefill pass of
    # the engine that wrote the replies, so the target is loaded once, in vLLM (the teacher process reads only its
    # embeddings and head)
    capture: Capture = Capture.during
    shard_size: int = ranged(64, ge=1)  # samples per shard
    feature_dtype: FeatureDType = FeatureDType.bfloat16  # float8_e4m3: half the disk; none: tokens only (online)
    topk_logprobs: int = ranged(0, ge=0)  # >0: also store the target's top-k log-probs per position (distillation)
    # regenerate: the target writes every reply (one decode step per token); prefill: the dataset's own replies, each
    # token labelled with the target's greedy choice after the dataset's prefix, in one prefill per sequence; mixed:
    # data.num_samples regenerated and teacher.prefill_samples more conversations prefilled (held out: regenerated)
    mode: TeacherMode = TeacherMode.regenerate
    prefill_samples: int = ranged(0, ge=0)  # mixed: conversations prefilled besides the regenerated ones
    # who writes the regenerated replies: hf (the project's continuous batching) or vllm (vLLM in its own venv:
    # bash scripts/setup_vllm.sh); its features come from the transformers target's prefill capture (`separate`), or
    # with teacher.capture=engine from vLLM itself: either way the same kind of dataset
    engine: Engine = Engine.hf


@dataclass
class DrafterConfig:
    """The DFlash block drafter (models/drafter.py)."""

    num_layers: int = ranged(2, ge=1)
    # weight-tied depth: the block passes through the num_layers layers this many times (same weights); exported
    # unrolled as num_layers x layer_repeats layers
    layer_repeats: int = ranged(1, ge=1)
    hidden_size: Optional[int] = ranged(None, ge=1)  # None: the target's hidden size
    intermediate_size: Optional[int] = ranged(None, ge=1)  # None: the target's intermediate size
    num_attention_heads: Optional[int] = ranged(None, ge=1)
    num_key_value_heads: Optional[int] = ranged(None, ge=1)
    head_dim: Optional[int] = ranged(None, ge=1)
    block_size: int = ranged(16, ge=2)  # the anchor plus at least one drafted position
    mask_token_id: Optional[int] = ranged(None, ge=0)  # None: chosen from the tokenizer (docs/methods.md, 'The MASK token')
    init: DrafterInit = DrafterInit.random  # target: layers and final norm copied from the target's last layers
    # The attention kernel (models/drafter.py ATTENTION_FUNCTIONS): eager = plain matmul + softmax, the reference;
    # sdpa = torch's scaled_dot_product_attention (fused kernels on GPU; the packed mask in slices of
    # attention_chunk_mb); flex = flex_attention with a block-sparse mask, compiled on a GPU (no backward on a CPU).
    # Not part of the export.
    attn_implementation: Attention = Attention.sdpa
    # sdpa in training: MB of the packed mask built at a time, each slice recomputed in the backward; 0 = all at once
    attention_chunk_mb: float = ranged(64.0, ge=0.0)
    # DFlash2's grouped dynamic convolution around each layer's attention and MLP (docs/methods.md, 'DFlash2
    # convolution'): taps over the block's positions, 0 = off (the DFlash drafter exactly); channels share a per-token
    # coefficient in groups of conv_group_size (must divide the hidden size). Exported as DFlash2DraftModel.
    conv_kernel_size: int = ranged(0, ge=0)
    conv_group_size: int = ranged(32, ge=1)
    # Start from a trained drafter's export folder (e.g. runs/<name>/train/export) instead of drafter.init: its
    # weights, same shape; a convolution the export lacks starts at the identity (a DFlash -> DFlash2 fine-tune)
    init_from: Optional[str] = None


# -- the components trained on a frozen drafter (conf/catalogue.py): one config group each, conf/<name>/ ------------
@dataclass
class FrozenComponentConfig:
    """What every component on a frozen drafter can set: where the drafter comes from, and loop settings (None:
    the trainer.* value)."""

    drafter_dir: Optional[str] = None  # the frozen drafter's export; None: this run's drafter stage
    steps: Optional[int] = ranged(200, ge=1)
    lr: Optional[float] = ranged(1e-3, gt=0.0)
    warmup_steps: Optional[int] = ranged(None, ge=0)
    batch_sequences: Optional[int] = ranged(None, ge=1)
    anchors_per_sequence: Optional[int] = ranged(None, ge=1)
    eval_every: Optional[int] = ranged(None, ge=1)


@dataclass
class SelectorConfig(FrozenComponentConfig):
    """conf/selector/: the pair-codebook selector."""

    top_k: int = ranged(16, ge=2)  # candidates per position
    rank: int = ranged(256, ge=1)  # codebook rank r


@dataclass
class JumpConfig(FrozenComponentConfig):
    """conf/jump/: the jump heads."""

    top_k: int = ranged(16, ge=2)  # candidates re-ranked at each offset
    rank: int = ranged(64, ge=1)
    every: int = ranged(4, ge=1)  # offsets at block positions every, 2*every, ... (the anchor is position 0)
    margin: float = 0.0  # fix an offset when its top-1 minus top-2 jump score is at least this
    weight: float = ranged(1.0, ge=0.0)  # w in U + w * (residual - max residual)
    kl_weight: float = ranged(0.0, ge=0.0, le=1.0)  # mix of KL to the target's stored top-k (needs topk_logprobs)


@dataclass
class JumpHeadConfig(FrozenComponentConfig):
    """conf/jump_head/: the separate jump head."""

    every: int = ranged(4, ge=1)  # offsets at block positions every, 2*every, ... (the anchor is position 0)
    margin: float = 0.0  # fix an offset when the head's top-1 minus top-2 logit is at least this
    num_heads: int = ranged(4, ge=1)  # attention heads of the head's layer (must divide the drafter's hidden size)
    intermediate_size: Optional[int] = ranged(None, ge=1)  # its SwiGLU width; None: 2 x the drafter's hidden size
    top_k: int = ranged(16, ge=2)  # the drafter's candidates per position, for the gap fill and the selector


@dataclass
class WeaverConfig(FrozenComponentConfig):
    """conf/weaver/: the Weaver adapter and its trees."""

    top_k: int = ranged(512, ge=2)  # the candidate pool per depth: the drafter's top-K there
    rank: int = ranged(256, ge=2)  # the adapter's width
    num_layers: int = ranged(2, ge=1)
    num_heads: int = ranged(4, ge=1)
    mlp_dim: int = ranged(512, ge=1)
    # The decode settings (the trees' shape): not part of the training stage's hash, so changing them re-runs only
    # the eval (conf/catalogue.py: decode_only). The root's depth-1 candidates: None widens it with the node budget
    # (eval/components.py root_breadth).
    children: int = ranged(8, ge=1)  # children an expanded node publishes to the frontier
    root_children: Optional[int] = ranged(None, ge=1)
    # Weaver calls a tree is built in: each expands ceil(budget / expansions) frontier nodes at once. Fewer calls
    # build a tree faster and expand nodes before better ones on the frontier are known; the default is the count
    # that kept acceptance while building fastest (docs/results/best-cpu-recipe.md).
    expansions: int = ranged(4, ge=1)
    kl_weight: float = ranged(0.0, ge=0.0)  # x KL(target restricted to the pool || Weaver) (needs topk_logprobs)
    tv_weight: float = ranged(0.0, ge=0.0)  # x total variation against the same
    eval_budget: int = ranged(32, ge=1)  # node budget of the held-out tree acceptance reported while training
    eval_blocks: int = ranged(128, ge=1)  # held-out blocks it grows trees for (the first ones)


# {component: its config section}, every component but the drafter (configured by the drafter and trainer sections)
COMPONENT_CONFIGS = {"selector": SelectorConfig, "jump": JumpConfig, "jump_head": JumpHeadConfig,
                     "weaver": WeaverConfig}
# The trainable components (conf/catalogue.py says what each trains on and which sections it depends on).
Component = Choice("Component", {name: name for name in ("drafter", *COMPONENT_CONFIGS)})


@dataclass
class TrainerConfig:
    """The one training loop (train/loop.py); `component` picks what it trains."""

    component: Component = Component.drafter
    out_dir: str = "train"
    data_dir: Optional[str] = None  # teacher dataset; None: the teacher stage's output in this run directory
    steps: int = ranged(100, ge=1)
    lr: float = ranged(6e-4, gt=0.0)
    warmup_steps: int = ranged(10, ge=0)
    weight_decay: float = ranged(0.0, ge=0.0)
    grad_clip: float = ranged(1.0, ge=0.0)  # 0: no clipping
    batch_sequences: int = ranged(8, ge=1)  # global batch (all processes, all micro-batches) of sequences per step
    grad_accum: int = ranged(1, ge=1)  # micro-batches per process per step
    anchors_per_sequence: int = ranged(48, ge=1)
    # a token budget per step (long sequences of mixed lengths): a step takes sequences until their tokens reach it,
    # at most batch_sequences (the same steps on any process count), cut into micro-batches of even token counts
    # (memory follows tokens_per_step / (processes x grad_accum)); None: batch_sequences sequences per step
    tokens_per_step: Optional[int] = ranged(None, ge=1)
    # memory (docs/results/memory.md): the drafter's logits and block losses are computed this many MB of logits at a
    # time, each slice recomputed in the backward (0: all logits at once); per-layer activation checkpointing
    logits_chunk_mb: float = ranged(256.0, ge=0.0)
    activation_checkpointing: bool = False
    feature_noise: float = ranged(0.0, ge=0.0)  # drafter: Gaussian noise on the target features, x their RMS
    loss: Loss = Loss.decay
    gamma: Optional[float] = ranged(None, gt=0.0)  # decay constant; None: from the block size (7 for 16, 4 for 8)
    dpace_alpha: float = ranged(0.5, ge=0.0, le=1.0)
    draft_vocab_size: Optional[int] = ranged(None, ge=1)  # None: full vocabulary
    # DFlash2 joint training: > 0 trains the pair selector (conf/selector: top_k, rank) with the drafter in one run,
    # loss = block loss + this x the selector's CE, gradients reaching the drafter; 0: the drafter alone
    selector_loss_weight: float = ranged(0.0, ge=0.0)
    heldout_samples: int = ranged(16, ge=1)  # teacher sequences kept out of training for held-out metrics
    # train on this many teacher sequences only (nested subsets, same held-out split); None: all but the held-out
    train_samples: Optional[int] = ranged(None, ge=1)
    # None: whatever the launcher says (`accelerate launch --mixed_precision` / its config file; "no" without one);
    # a value here overrides the launcher.
    mixed_precision: Optional[MixedPrecision] = None
    online: bool = False  # features from the target in the loop instead of the stored teacher features
    # producer: the drafter's features come from a producer process (dflash-producer: vLLM's extraction, or the
    # transformers target) through producer.spool; the trainer loads the target's embeddings and head only
    features: FeatureSource = FeatureSource.dataset
    resume: bool = False  # a killed run of the same config always resumes; true: also from another config's
    save_every: int = ranged(50, ge=1)
    keep_checkpoints: int = ranged(2, ge=1)
    eval_every: int = ranged(50, ge=1)
    log_every: int = ranged(10, ge=1)


@dataclass
class ProducerConfig:
    """The feature producer (data/producer.py, `dflash-producer`) that feeds trainer.features=producer: it computes
    the features of each training step's sequences and hands them over through a spool folder (data/spool.py)."""

    engine: Engine = Engine.vllm  # vllm: vLLM's extract_hidden_states (its venv: bash scripts/setup_vllm.sh); hf
    dtype: FeatureDType = FeatureDType.bfloat16  # the features as handed over (float32, bfloat16 or float16)
    # the spool folder, relative to the run directory unless absolute; producer and trainers on other machines need
    # it on a filesystem they share
    spool: str = "spool"
    capacity: int = ranged(4, ge=1)  # steps the producer may run ahead of the slowest trainer rank
    wait_s: float = ranged(600.0, gt=0.0)  # how long either side waits for the other before it stops with an error
    # true: the trainer's first process starts the producer itself on this machine (one command); false: you start
    # `dflash-producer` with the same overrides, on this machine or on the engine's
    launch: bool = True


@dataclass
class PolicyConfig:
    """eval.policy: settings of the decoding policies (eval/policies.py). A None value is calibrated once per eval
    run on held-out teacher sequences kept apart from the eval prompts, over the bounded grid next to it."""

    top_k: int = ranged(16, ge=2)  # candidates the training-free policies choose among (Boltzmann)
    temperature: Optional[float] = ranged(None, gt=0.0)  # Boltzmann T; None: the best of `temperatures`
    temperatures: list[float] = ranged(gt=0.0, nonempty=True, factory=lambda: [0.02, 0.05, 0.10, 0.20, 0.35])
    threshold: Optional[float] = ranged(None, ge=0.0)  # ACT margin threshold; None: the best of `thresholds`
    thresholds: list[float] = ranged(ge=0.0, nonempty=True, factory=lambda: [0.0, 0.25, 0.5, 1.0, 1.5, 2.0])
    refine: int = ranged(0, ge=0)  # MOBS refinement passes (each re-picks every position given both neighbours)
    adaptive: bool = True  # False: the adaptive method keeps the fixed block (the switch for an A/B)
    probe_every: int = ranged(16, ge=1)  # adaptive: rounds without drafting before it tries the drafter again
    memory: float = ranged(0.9, ge=0.0, lt=1.0)  # adaptive: decay of its running per-position acceptance
    calibration_sequences: int = ranged(32, ge=1)  # held-out teacher sequences the calibration uses


@dataclass
class ServedConfig:
    """eval.served: the exported drafter served by an engine on the eval's prompts, beside the own loop (the chain
    method), with the parity gate (eval/served.py)."""

    engine: Optional[ServingEngine] = None  # vllm | llamacpp: serve it in that engine; None: the own loop only
    # what is served and gated: chain (the drafter's export) | selector_greedy (the DFlash2 checkpoint with the
    # trained selector, whose walk llama.cpp runs; beside the own loop's selector_greedy; llama.cpp only)
    method: ServedMethod = ServedMethod.chain
    # reduced precision: the most |served - own| unconditional acceptance per position (and relative tau) the gate
    # passes; float32 needs equal counters
    tolerance: float = ranged(0.02, ge=0.0)
    batch: int = ranged(8, ge=0)  # requests of the batched timing (0 or 1: batch 1 only)
    strict: bool = False  # true: a failed gate fails the eval stage (false: reported in results and the log)
    # eval.temperature > 0 (docs/metrics.md, 'Acceptance at temperature'): each prompt is decoded with this many
    # seeds (eval.seed, eval.seed + 1, ...) as seeded requests, as many times unseeded, and by the own loop
    seeds: int = ranged(3, ge=1)
    # how the engine drafts at T > 0: greedy (vLLM's default: the own loop's greedy_draft rule) | probabilistic
    # (drafts sampled, kept with min(1, p/q): the own loop's sampled rule); the gate compares like with like
    draft_sample_method: DraftSampleMethod = DraftSampleMethod.greedy
    alpha: float = ranged(0.01, gt=0.0, lt=1.0)  # T > 0: the family-wise level of the gate's tests
    # mend engine code the worker's self-checks find wrong before serving (models/vllm_worker.py; vLLM 0.32's CPU
    # build needs it at T > 0); false: serve the engine as installed, and a failure they explain is named as its
    repair: bool = False


@dataclass
class EvalConfig:
    """Evaluation (eval/stage.py): offline (teacher-forced) and online (real verification) acceptance, speed."""

    out_dir: str = "eval"
    # mtbench (both turns) | humaneval | heldout (held-out ShareGPT prompts) | a .json/.jsonl/.parquet path | hf:<id>
    datasets: list[str] = ranged(nonempty=True, factory=lambda: ["mtbench", "humaneval", "heldout"])
    num_prompts: int = ranged(8, ge=1)  # per dataset: teacher-forced metrics on the target's replies to all of them
    online_prompts: Optional[int] = ranged(None, ge=1)  # the first this many also decode online; None: all
    turns: int = ranged(2, ge=1)  # turns of multi-turn sets (MT-Bench), each on the target's own earlier replies
    max_new_tokens: int = ranged(64, ge=1)
    max_prompt_tokens: Optional[int] = ranged(None, ge=1)  # None: whatever fits the context with max_new_tokens
    block_size: Optional[int] = ranged(None, ge=2)  # None: the trained block size; may be smaller, never larger
    temperature: float = ranged(0.0, ge=0.0)  # 0: greedy (outputs must equal autoregressive decoding); >0: sampling
    seed: int = 0  # sampling generators (temperature > 0)
    # temperature > 0: sampled (drafts x ~ q kept with min(1, p/q)) | greedy_draft (drafts argmax q kept with p(x),
    # what vLLM does by default); both exact in distribution (eval/decode.py)
    acceptance_rule: AcceptanceRule = AcceptanceRule.sampled
    drafter_dir: Optional[str] = None  # an exported drafter folder; None: <run dir>/<trainer.out_dir>/export
    methods: list[str] = ranged(nonempty=True, factory=lambda: ["chain"])  # names in eval/methods.py's catalogue
    recall_k: list[int] = ranged(ge=1, nonempty=True, factory=lambda: [1, 4, 16])  # offline Recall@K
    # node budgets (excluding the root) of the tree methods (ddtree, weaver_tree): each is evaluated per budget
    tree_budgets: list[int] = ranged(ge=1, nonempty=True, factory=lambda: [16, 32, 64])
    timing_repeats: int = ranged(1, ge=1)  # A B B A passes (AR, spec, spec, AR) per prompt, after one warm-up
    # passes of the verify-cost curve measured before each set's timing (medians of per-pass ratios): more passes
    # steady the curve against the machine's slower spells (how much: docs/results/reference-recipe.md)
    cost_repeats: int = ranged(24, ge=1)
    strict_exact: bool = True  # greedy: raise on a wrong speculative output (False: record it in `mismatches`)
    # bf16/fp16 targets: a divergence from autoregressive decoding is a near-tie (reported, not raised) when the two
    # tokens' float32 log-probabilities on the shared prefix differ by less than this (nats; eval/exactness.py
    # says how 0.5 was measured); float32: never
    near_tie_tolerance: float = ranged(0.5, ge=0.0)
    # plain autoregressive decoding is also timed in these dtypes (besides the target's own) in the same passes,
    # and speedup_vs_fastest_ar divides by the fastest: on a CPU bf16 is not always the faster one. None: float32
    # and bfloat16 on a CPU, the target's own dtype alone on a GPU (a copy per dtype costs its memory); []: the
    # target's dtype only
    baseline_dtypes: Optional[list[DType]] = None
    # torch intra-op threads while evaluating (restored after); None: torch's own setting. 1 by default: batch-1
    # decoding is made of tiny matmuls, and on a shared CPU extra threads mostly wait on each other, which makes the
    # timings and speedups meaningless (docs/metrics.md, 'Timing protocol').
    num_threads: Optional[int] = ranged(1, ge=1)
    policy: PolicyConfig = field(default_factory=PolicyConfig)  # decoding policies' settings (eval/policies.py)
    served: ServedConfig = field(default_factory=ServedConfig)  # acceptance where users serve (eval/served.py)


@dataclass
class LoggerConfig:
    """Run logging (runtime/logger.py): wandb or none; metrics.jsonl is always written."""

    kind: LoggerKind = LoggerKind.wandb
    project: str = "dflash"
    entity: Optional[str] = None  # None: wandb's default entity
    # None: wandb's own settings decide (WANDB_MODE, `wandb login`, `wandb offline`); offline when none is configured
    mode: Optional[WandbMode] = None
    group: Optional[str] = None  # None: the experiment name
    tags: list[str] = field(default_factory=list)


@dataclass
class PipelineConfig:
    """What dflash-pipeline runs after the drafter: the components trained on it, each a stage of its own."""

    components: list[Component] = field(default_factory=list)


@dataclass
class ExportConfig:
    """What the trained drafter is written as besides its safetensors export (docs/export.md, 'GGUF for llama.cpp').
    Not part of any stage's hash: adding a type to a finished run writes the files and retrains nothing."""

    # per type: <export>/gguf/drafter-<type>.gguf and target-<type>.gguf, converted by llama.cpp's own converter (a
    # GGUF target is also linked as it is, in its own quantization), and serve.json with the llama-server command;
    # for the drafter's export and a DFlash2 selector's (needs bash scripts/setup_llamacpp.sh)
    gguf: list[GGUFType] = field(default_factory=list)


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
    producer: ProducerConfig = field(default_factory=ProducerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    export: ExportConfig = field(default_factory=ExportConfig)


@functools.cache
def root_config() -> type:
    """The root schema: Config plus a section for every component that brings its own config (conf/<component>/)."""
    sections = [(name, cls, field(default_factory=cls)) for name, cls in COMPONENT_CONFIGS.items()]
    return dataclasses.make_dataclass("RootConfig", sections, bases=(Config,))


def check_config(cfg: DictConfig) -> None:
    """Raise ConfigError naming every value outside the range its schema field declares (see `ranged`)."""
    problems = []

    def walk(schema, node, prefix):
        for f in dataclasses.fields(schema):
            value = node.get(f.name)
            if dataclasses.is_dataclass(f.default_factory):  # a nested section
                walk(f.default_factory, value, f"{prefix}{f.name}.")
                continue
            bounds = f.metadata.get("range")
            problem = bounds and value is not None and _out_of_range(value, bounds)
            if problem:
                shown = list(value) if isinstance(value, ListConfig) else value
                problems.append(f"{prefix}{f.name}={shown} {problem}")

    walk(root_config(), cfg, "")
    if problems:
        raise ConfigError("; ".join(problems) + " (fix the value on the command line or in the experiment YAML)")


def _out_of_range(value, bounds: dict) -> str | None:
    values = list(value) if isinstance(value, (list, ListConfig)) else [value]
    if bounds["nonempty"] and not values:
        return "must not be empty"
    checks = [("ge", ">=", lambda v, b: v >= b), ("gt", ">", lambda v, b: v > b),
              ("le", "<=", lambda v, b: v <= b), ("lt", "<", lambda v, b: v < b)]
    for v in values:
        for key, sign, ok in checks:
            if bounds[key] is not None and not ok(v, bounds[key]):
                wanted = " and ".join(f"{s} {bounds[k]}" for k, s, _ in checks if bounds[k] is not None)
                return f"is out of range: must be {wanted}"
    return None


def _optuna_storage(folder: str) -> str:
    """${optuna_storage:folder} -> the sqlite URL of folder/optuna.db, its tables created under a file lock: sweep
    processes started together on one study would otherwise race to create them ("table studies already exists")."""
    from filelock import FileLock

    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{path}/optuna.db"
    with FileLock(str(path / "optuna.db.lock")):
        import optuna

        optuna.storages.RDBStorage(url)
    return url


def job_dirname(overrides: str, limit: int = 200) -> str:
    """A sweep job's folder name: its overrides (`a=1,b=2`), or when longer than `limit` bytes (file systems stop at
    255) their first part plus a hash of all of them, so a job with many overrides still gets its own folder."""
    if len(overrides.encode()) <= limit:
        return overrides
    digest = hashlib.sha256(overrides.encode()).hexdigest()[:16]
    return overrides.encode()[: limit - 17].decode(errors="ignore") + "-" + digest


def register() -> None:
    """Register the schema: `base_config` for the root, `<group>/base` for each group's YAML files to extend."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=root_config())
    OmegaConf.register_new_resolver("job_dirname", job_dirname, replace=True)  # conf/config.yaml: hydra.sweep.subdir
    OmegaConf.register_new_resolver("optuna_storage", _optuna_storage, replace=True)  # conf/sweep/*.yaml
    for group, node in [
        ("target", TargetConfig),
        ("data", DataConfig),
        ("teacher", TeacherConfig),
        ("drafter", DrafterConfig),
        ("trainer", TrainerConfig),
        ("producer", ProducerConfig),
        ("eval", EvalConfig),
        ("logger", LoggerConfig),
        *COMPONENT_CONFIGS.items(),
    ]:
        cs.store(group=group, name="base", node=node)

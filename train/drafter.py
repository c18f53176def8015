"""The drafter component: the DFlash block drafter trained on packed multi-anchor blocks.

A component gives the one training loop (train/loop.py) its model, its batches and its loss, plus a held-out
evaluation and an export. Later components (selector, jump heads, Weaver) bring their own in the same shape.
"""
from __future__ import annotations

import functools
import logging
from collections import Counter
from pathlib import Path

import torch
from omegaconf import DictConfig

from dflash_pipeline.data.blocks import pack_blocks
from dflash_pipeline.data.shards import DatasetError
from dflash_pipeline.data.splits import (TokenBudgetSteps, anchor_generators, split_heldout, step_batch,
                                         step_seed)
from dflash_pipeline.data.producer import ProducerFeed
from dflash_pipeline.data.teacher import teacher_and_target
from dflash_pipeline.eval.metrics import conditional_acceptance, offline_metrics
from dflash_pipeline.models.drafter import DFlashDrafter, DFlashDrafterConfig
from dflash_pipeline.models.generation import recapture
from dflash_pipeline.models.families import config_value, final_norm, text_config
from dflash_pipeline.models.target import Target
from dflash_pipeline.train.component import ComponentHooks, StageInputs
from dflash_pipeline.train.errors import TrainError
from dflash_pipeline.train.losses import (block_loss, decay_weights, default_gamma, dpace_weights, effective_valid,
                                         normaliser, sliced_loss)

log = logging.getLogger(__name__)
# The K of the held-out Recall@K that training logs (eval.recall_k is the eval stage's: reading it here would tie
# the training stage to an eval setting its hash does not cover)
HELDOUT_RECALL_K = (1, 4, 16)


def choose_mask_token(tokenizer, vocab_size: int) -> int:
    """A token id the target never emits as a reply token.

    If the embedding has rows past the tokenizer (Qwen3: 151936 rows, 151669 tokens), the first such row: no text
    maps to it. Otherwise the highest-id special token that is not BOS/EOS/PAD and not used by the chat template
    (SmolLM2: <empty_output>, id 16). The drafter only ever sees its (frozen) embedding as a placeholder input.
    """
    if vocab_size > len(tokenizer):
        return len(tokenizer)
    template = tokenizer.chat_template or ""
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    special = [i for i in tokenizer.all_special_ids if i not in reserved]
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special += [i for i, t in added.items() if getattr(t, "special", False) and i not in reserved]
    usable = sorted({i for i in special if tokenizer.convert_ids_to_tokens(i) not in template})
    if not usable:
        raise TrainError("no unused special token to serve as the MASK token; set drafter.mask_token_id")
    return usable[-1]


def target_rope(tc) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) of a transformers config: its rope_parameters besides rope_theta, or None for plain
    RoPE, so the drafter's positions (YaRN, llama3, ...) are the target's. Per-layer-type parameters (e.g. sliding
    and full attention) give the full-attention ones: the drafter's attention is full."""
    rope = dict(getattr(tc, "rope_parameters", None) or {})
    if isinstance(rope.get("full_attention"), dict):
        rope = dict(rope["full_attention"])
    theta = float(rope.pop("rope_theta", getattr(tc, "rope_theta", 10000.0)))
    rope.pop("type", None)  # the pre-rope_type spelling; standardised configs carry rope_type too
    return theta, (None if rope.get("rope_type", "default") == "default" and set(rope) <= {"rope_type"} else rope)


def drafter_config(cfg: DictConfig, target: Target, layer_ids: list[int]) -> DFlashDrafterConfig:
    """The drafter's shape: conf/drafter values, the rest from the target (width, heads, rope, vocab)."""
    d, tc = cfg.drafter, text_config(target.model)  # the text decoder's config (an image-text wrapper's language model)
    value = functools.partial(config_value, tc)  # per-layer values (Gemma 4): the first full-attention layer's
    head_dim = d.head_dim or value("head_dim") or tc.hidden_size // value("num_attention_heads")
    rope_theta, rope_scaling = target_rope(tc)
    return DFlashDrafterConfig(
        hidden_size=d.hidden_size or tc.hidden_size,
        intermediate_size=d.intermediate_size or value("intermediate_size"),
        num_hidden_layers=d.num_layers,
        layer_repeats=d.layer_repeats,
        num_attention_heads=d.num_attention_heads or value("num_attention_heads"),
        num_key_value_heads=d.num_key_value_heads or value("num_key_value_heads"),
        head_dim=head_dim,
        rms_norm_eps=value("rms_norm_eps") or value("layer_norm_epsilon") or value("norm_eps") or 1e-6,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=tc.max_position_embeddings,
        vocab_size=tc.vocab_size,
        block_size=d.block_size,
        conv_kernel_size=d.conv_kernel_size,
        conv_group_size=d.conv_group_size,
        target_hidden_size=tc.hidden_size,
        target_layer_ids=list(layer_ids),
        num_target_layers=tc.num_hidden_layers,
        mask_token_id=d.mask_token_id if d.mask_token_id is not None else choose_mask_token(
            target.tokenizer, tc.vocab_size),
        attn_implementation=str(d.attn_implementation),
        attention_chunk_mb=float(d.attention_chunk_mb),
    )


def init_from_target(drafter: DFlashDrafter, target_model) -> None:
    """Start the drafter's layers from the target's last layers and its final norm from the target's: the drafter
    then begins as a shallow continuation of the target instead of a random map (q_norm/k_norm stay at one)."""
    source = target_model.model.layers[-len(drafter.layers):]
    with torch.no_grad():
        for dst, src in zip(drafter.layers, source):
            theirs = dict(src.named_parameters())
            for name, p in dst.named_parameters():
                if name in theirs:
                    if theirs[name].shape != p.shape:
                        raise TrainError(f"drafter.init=target needs the target's layer shapes: {name} is "
                                         f"{tuple(p.shape)} here, {tuple(theirs[name].shape)} in the target")
                    p.copy_(theirs[name])
        drafter.norm.weight.copy_(final_norm(target_model).weight)


def init_from_export(drafter: DFlashDrafter, folder: Path) -> None:
    """Start from a trained drafter's export (drafter.init_from): every weight of the export, which must be this
    drafter's shape and target; weights the export lacks (a DFlash export has no convolution) keep their init,
    the identity for a GroupedConv, so the fine-tune starts from the trained drafter's function exactly."""
    if not (folder / "model.safetensors").is_file():
        raise TrainError(f"drafter.init_from={folder}: no model.safetensors there; give a drafter export folder "
                         "(runs/<name>/train/export)")
    trained = DFlashDrafter.from_pretrained(str(folder), drafter.embed_tokens, drafter.lm_head)
    mine, theirs = drafter.config, trained.config
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "target_hidden_size", "target_layer_ids", "vocab_size", "block_size", "mask_token_id"):
        if getattr(mine, key) != getattr(theirs, key):
            raise TrainError(f"drafter.init_from={folder}: its {key} is {getattr(theirs, key)}, this drafter's "
                             f"{getattr(mine, key)}; set the drafter config to the export's")
    if theirs.num_hidden_layers * theirs.layer_repeats != mine.num_hidden_layers * mine.layer_repeats:
        raise TrainError(f"drafter.init_from={folder}: {theirs.num_hidden_layers} x {theirs.layer_repeats} layers "
                         f"there, {mine.num_hidden_layers} x {mine.layer_repeats} here")
    state = {k: v for k, v in trained.state_dict().items() if k != "draft_to_target"}
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    if unexpected or any(".attention_conv." not in k and ".mlp_conv." not in k for k in missing):
        raise TrainError(f"drafter.init_from={folder}: weights differ (missing {missing}, unexpected {unexpected})")
    if trained.draft_to_target is not None:
        drafter.set_draft_vocab(trained.draft_to_target)
    log.info("drafter: started from %s%s", folder, " (its convolution at the identity)" if missing else "")


class DrafterWithSelector(torch.nn.Module):
    """DFlash2 joint training (trainer.selector_loss_weight > 0): the drafter and its pair selector as one module,
    so one optimizer, one checkpoint and one DDP wrapper hold both. The forward is the drafter's."""

    def __init__(self, drafter: DFlashDrafter, selector):
        super().__init__()
        self.drafter, self.selector = drafter, selector

    def forward(self, *args, **kwargs):
        return self.drafter(*args, **kwargs)

    def fsdp_units(self) -> list[torch.nn.Module]:
        return self.drafter.fsdp_units()


def drafter_of(model) -> DFlashDrafter:
    """The drafter inside whatever the loop holds: a DDP wrapper, a DrafterWithSelector, or the drafter itself."""
    model = getattr(model, "module", model)
    return model.drafter if isinstance(model, DrafterWithSelector) else model


class DrafterComponent(ComponentHooks):
    """Model, batches, loss, held-out metrics and export of the DFlash block drafter (with its DFlash2 selector when
    trained jointly)."""

    name = "drafter"

    def __init__(self, cfg: DictConfig, inputs: StageInputs, device: torch.device):
        self.cfg, t = cfg, cfg.trainer
        produced = t.features == "producer"
        if produced and (t.online or cfg.drafter.init == "target"):
            raise TrainError("trainer.features=producer trains without the target's body: drop trainer.online "
                             "(the producer's features replace it) and drafter.init=target (it copies target layers)")
        self.data, self.target = teacher_and_target(cfg, inputs.teacher, body=not produced)
        self.online = not produced and (t.online or not self.data.has_features)
        if not t.online and self.online:
            log.info("teacher data at %s stores no features (teacher.feature_dtype=none): capturing them from the "
                     "target in the training loop, as trainer.online=true", inputs.teacher)
        if t.loss == "kl" and not self.data.manifest.get("topk_logprobs"):
            raise DatasetError("trainer.loss=kl needs teacher top-k log-probs: rerun the teacher with "
                               "teacher.topk_logprobs=20 (or another k > 0)")
        self.train_idx, self.heldout_idx = split_heldout(self.data.ids, t.heldout_samples, t.train_samples)
        self.budget_steps = TokenBudgetSteps(self.train_idx, self.data.length, cfg.seed, t.tokens_per_step or 0,
                                             t.batch_sequences)
        self.feed = ProducerFeed(cfg, inputs.run_dir, self.data, self.heldout_idx) if produced else None
        self.dconf = drafter_config(cfg, self.target, self.data.layer_ids)
        self.block_size = self.dconf.block_size
        self.gamma = t.gamma or default_gamma(self.block_size)
        self.device = device
        self.target.model.to(device)
        self.model = DFlashDrafter(self.dconf, self.target.model.get_input_embeddings(),
                                   self.target.model.get_output_embeddings())
        if cfg.drafter.init_from:
            init_from_export(self.model, Path(cfg.drafter.init_from))
        elif cfg.drafter.init == "target":
            init_from_target(self.model, self.target.model)
        elif cfg.drafter.init != "random":
            raise TrainError(f"unknown drafter.init {cfg.drafter.init!r}; use random or target")
        if t.draft_vocab_size:
            self.model.set_draft_vocab(self.frequent_tokens(t.draft_vocab_size))
        self.model.to(device)
        self.to_column = self.model.target_to_column()
        vocab = self.model.draft_to_target
        self.model_columns = self.dconf.vocab_size if vocab is None else len(vocab)  # the logits' width
        self.model.activation_checkpointing = t.activation_checkpointing
        self.selector_weight = t.selector_loss_weight
        if self.selector_weight > 0:
            from dflash_pipeline.models.selector import PairSelector

            s = cfg.selector
            selector = PairSelector(self.dconf.vocab_size, self.dconf.hidden_size, s.rank, s.top_k).to(device)
            self.model = DrafterWithSelector(self.model, selector)
        log.info("drafter: %d layers, hidden %d, block %d, taps %s, mask token %d, %s vocabulary; %d train / %d "
                 "held-out sequences, %.1fM trainable parameters%s", self.dconf.num_hidden_layers,
                 self.dconf.hidden_size, self.block_size, self.dconf.target_layer_ids, self.dconf.mask_token_id,
                 t.draft_vocab_size or "full", len(self.train_idx), len(self.heldout_idx),
                 sum(p.numel() for p in self.model.parameters()) / 1e6,
                 f" (DFlash2 selector joint, weight {self.selector_weight})" if self.selector_weight > 0 else "")

    def frequent_tokens(self, n: int) -> torch.Tensor:
        """The draft vocabulary: n target ids, sorted. The most frequent reply tokens of the training split first,
        then prompt tokens, then the lowest unused ids, so the head always has exactly min(n, V) rows."""
        replies: Counter = Counter()
        prompts: Counter = Counter()
        for i in self.train_idx:
            item = self.data[i]
            replies.update(item["input_ids"][item["loss_mask"]].tolist())
            prompts.update(item["input_ids"][~item["loss_mask"]].tolist())
        ranked = [t for t, _ in sorted(replies.items(), key=lambda kv: (-kv[1], kv[0]))]
        ranked += [t for t, _ in sorted(prompts.items(), key=lambda kv: (-kv[1], kv[0])) if t not in replies]
        seen = set(ranked)
        ranked += [t for t in range(self.dconf.vocab_size) if t not in seen]
        return torch.tensor(sorted(ranked[:n]))

    # -- data ------------------------------------------------------------------------------------------------
    def step_items(self, step: int) -> list[int]:
        t = self.cfg.trainer
        if t.tokens_per_step:
            return self.budget_steps(step)
        return step_batch(self.train_idx, step, t.batch_sequences, self.cfg.seed)

    def item_sizes(self, items: list[int]) -> list[int]:
        """What micro-batches are balanced on: tokens under trainer.tokens_per_step, else equal counts."""
        if not self.cfg.trainer.tokens_per_step:
            return [1] * len(items)
        return [self.data.length(i) for i in items]

    def items(self, indices: list[int], step: int | None = None, slot0: int = 0) -> list[dict]:
        """Teacher samples; online (trainer.online, or a tokens-only dataset) the features come from the target now
        instead of from disk; fed by a producer, from its spool: slots slot0.. of `step`'s global batch (None: the
        held-out sequences)."""
        items = [self.data[i] for i in indices]
        if self.feed is not None:
            for item, features in zip(items, self.feed.features(indices, step, slot0)):
                item["features"] = features
        elif self.online:
            recapture(self.target.model, items, self.data.layer_ids, pad_id=self.target.tokenizer.pad_token_id)
        return items

    def checkpointed(self, step: int) -> None:
        if self.feed is not None:
            self.feed.spool.commit(step)

    def close(self) -> None:
        if self.feed is not None:
            self.feed.close()

    def batch(self, indices: list[int], step: int, slot0: int = 0) -> dict:
        """Pack sequences into blocks. Anchors are drawn per (step, slot in the global batch), so any split of the
        global batch over processes and micro-batches draws the same anchors."""
        gens = anchor_generators(self.cfg.seed, step, slot0, len(indices))
        batch = pack_blocks(self.items(indices, step, slot0), block_size=self.block_size,
                            mask_token_id=self.dconf.mask_token_id,
                            anchors_per_sequence=self.cfg.trainer.anchors_per_sequence, generators=gens)
        noise = self.cfg.trainer.feature_noise
        if noise > 0:  # a regulariser: each feature vector moved by `noise` times its own RMS, seeded per step
            f = batch["features"].float()
            gen = torch.Generator().manual_seed(step_seed(self.cfg.seed, "feature_noise", step, slot0))
            rms = f.pow(2).mean(-1, keepdim=True).sqrt()
            batch["features"] = (f + noise * rms * torch.randn(f.shape, generator=gen)).to(batch["features"].dtype)
        return batch

    def normaliser(self, batch: dict) -> float:
        """The loss normaliser of a batch, known before the forward (so it can be summed across processes)."""
        keep = batch["anchor_valid"]
        labels = self.to_column[batch["labels"][keep].to(self.device)]
        teacher_ids = self.to_column[batch["topk_ids"][keep].to(self.device)] if "topk_ids" in batch else None
        kind = self.cfg.trainer.loss
        valid = effective_valid(kind, labels, batch["label_valid"][keep].to(self.device), teacher_ids)
        return normaliser(kind, valid, self.gamma)

    # -- loss ------------------------------------------------------------------------------------------------
    def block_targets(self, batch: dict) -> dict:
        """What the loss of each real block needs besides its hidden states, on the device, one row per block:
        labels in logit columns and as target ids, which carry a label, the anchor token, and the teacher's top-k."""
        keep = batch["anchor_valid"].to(self.device)
        ids = batch["labels"].to(self.device)[keep]
        out = {"labels": self.to_column[ids], "ids": ids, "valid": batch["label_valid"].to(self.device)[keep],
               "anchors": batch["block_ids"].to(self.device)[keep][:, 0]}
        if self.cfg.trainer.loss == "kl":
            out["teacher_ids"] = self.to_column[batch["topk_ids"].to(self.device)[keep]]
            out["teacher_logprobs"] = batch["topk_logprobs"].to(self.device)[keep]
        return out

    def selector_loss(self, selector, drafter, hidden, logits, targets: dict) -> tuple[torch.Tensor, dict]:
        """DFlash2 joint training: the selector's CE over the live drafter's top-K with the true predecessor
        (models/selector.py selector_loss), with the position weights of the block loss. Nothing is detached but
        the weights, so the selector's loss also trains the drafter's hidden states and logits."""
        from dflash_pipeline.models.selector import selector_loss

        t, labels, valid, ids = self.cfg.trainer, targets["labels"], targets["valid"], targets["ids"]
        U, idx = logits.float().topk(selector.top_k, dim=-1)
        if t.loss == "dpace":
            q = torch.softmax(logits.detach().float(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0]
            weights = dpace_weights(torch.where(labels >= 0, q, 0.0), valid, t.dpace_alpha)
        else:
            weights = decay_weights(labels.shape[1], self.gamma, self.device).expand_as(labels)
        return selector_loss(selector, hidden[:, 1:], drafter.to_target_ids(idx), U,
                             torch.cat([targets["anchors"][:, None], ids[:, :-1]], 1), ids, valid, weights)

    def blocks_loss(self, model, hidden: torch.Tensor, targets: dict) -> tuple[torch.Tensor, dict]:
        """Loss SUM and stats of some real blocks: their logits through the target's head, the block loss, the top-1
        hits, and trained jointly the selector's loss. Every term is a sum over blocks, so slices of blocks add up."""
        t, drafter = self.cfg.trainer, drafter_of(model)
        logits = drafter.logits(hidden[:, 1:])  # (n, B-1, V)
        labels, valid = targets["labels"], targets["valid"]
        extra = {k: targets[k] for k in ("teacher_ids", "teacher_logprobs") if k in targets}
        loss_sum = block_loss(logits, labels, valid, kind=t.loss, gamma=self.gamma, alpha=t.dpace_alpha, **extra)
        with torch.no_grad():
            stats = {"correct": (logits.argmax(-1) == labels) & (labels >= 0), "valid": valid}
        if self.selector_weight > 0:  # divided by the block loss's normaliser too: one weighted sum of the two
            sel_sum, sel_stats = self.selector_loss(getattr(model, "module", model).selector, drafter, hidden, logits,
                                                    targets)
            loss_sum = loss_sum + self.selector_weight * sel_sum
            stats.update({f"selector_{k}": v for k, v in sel_stats.items()})
        return loss_sum, stats

    def loss_slices(self, blocks: int, positions: int) -> list[slice]:
        """Slices of blocks whose logits fit trainer.logits_chunk_mb (float32, the loss's own precision)."""
        budget, columns = self.cfg.trainer.logits_chunk_mb, self.model_columns
        step = blocks if budget <= 0 else max(1, int(budget * 2**20 // (4 * positions * columns)))
        return [slice(j, j + step) for j in range(0, max(blocks, 1), step)]

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, dict]:
        """The drafter's forward over the packed blocks, then the loss of the real blocks slice by slice
        (loss_slices, train/losses.py sliced_loss): at most one slice's logits exist at a time, each slice's gradient
        taken as it is computed. One slice is the whole-logits path exactly."""
        b = {k: v.to(self.device) for k, v in batch.items()}
        hidden = model(b["features"], b["block_ids"], b["anchor_pos"], b["context_valid"], b["anchor_valid"])
        hidden, targets = hidden[b["anchor_valid"]], self.block_targets(b)  # (N, B, H), one row per real block
        slices = self.loss_slices(*targets["labels"].shape)
        if len(slices) == 1:
            return self.blocks_loss(model, hidden, targets)
        selector = getattr(getattr(model, "module", model), "selector", None)
        params = [p for p in selector.parameters() if p.requires_grad] if self.selector_weight > 0 else []
        loss_sum, stats = sliced_loss(
            lambda h, part: self.blocks_loss(model, h, {k: v[part] for k, v in targets.items()}), hidden, slices,
            params)
        merged = {k: torch.cat([s[k] for s in stats]) for k in ("correct", "valid")}
        merged.update({k: sum(s[k] for s in stats) for k in stats[0] if k.startswith("selector_")})
        return loss_sum, merged

    def work(self, batch: dict) -> dict[str, int]:
        return {"anchor_blocks": int(batch["anchor_valid"].sum()), "tokens": int(batch["context_valid"].sum())}

    def train_metrics(self, stats: list[dict]) -> dict:
        """Conditional acceptance (train_a_k) and unconditional top-1 accuracy per position on the step's anchors."""
        correct, valid = torch.cat([s["correct"] for s in stats]), torch.cat([s["valid"] for s in stats])
        a, _ = conditional_acceptance(correct, valid)
        acc = ((correct & valid).sum(0) / valid.sum(0).clamp(min=1)).tolist()
        metrics = {"train_a_k": a, "train_acc_k": acc}
        if self.selector_weight > 0:  # as the frozen-drafter selector logs them
            from dflash_pipeline.train.selector import selector_rates

            prefix = "selector_"
            metrics.update(selector_rates([{k[len(prefix):]: v for k, v in s.items() if k.startswith(prefix)}
                                           for s in stats]))
        return metrics

    # -- evaluation ------------------------------------------------------------------------------------------
    def evaluate(self, model, indices: list[int] | None = None) -> dict:
        """Teacher-forced metrics on held-out sequences, every anchor: a_k, Recall@K (K of HELDOUT_RECALL_K),
        tau_offline; trained jointly, also the selector's greedy walk (selector_tau_offline)."""
        was_training = model.training
        model.eval()
        drafter = drafter_of(model)
        if indices is not None and self.feed is not None and list(indices) != self.heldout_idx:
            raise TrainError("fed by a producer, the drafter is evaluated on the held-out sequences only")
        items = self.items(indices if indices is not None else self.heldout_idx)
        methods = None
        if self.selector_weight > 0:
            from dflash_pipeline.eval.components import SelectorMethod

            methods = {"selector_greedy": SelectorMethod(drafter, model.selector, "greedy")}
        result = offline_metrics(drafter, items, self.block_size, list(HELDOUT_RECALL_K), methods=methods)
        if methods:
            result["selector_tau_offline"] = result.pop("methods")["selector_greedy"]["tau_offline"]
        model.train(was_training)
        return result

    # -- export ----------------------------------------------------------------------------------------------
    def export(self, model, folder: Path) -> Path:
        """The engine format (docs/export.md: full vocabulary, or with trainer.draft_vocab_size the drafter's own
        lm_head over the draft vocabulary + d2t), plus where the target and teacher data came from. Trained jointly,
        the DFlash2 checkpoint (the drafter plus candidate_selector.*, as train/selector.py writes it) also goes to
        <folder>/../selector/export, where the eval stage's selector methods look for it."""
        drafter = drafter_of(model)
        drafter.save_pretrained(str(folder), extra_config={"dflash_pipeline": {
            "target": self.target.ref,
            "target_layer_ids": list(self.dconf.target_layer_ids),
            "teacher_config_hash": self.data.manifest["config_hash"],
            "gamma": self.gamma,
            "loss": self.cfg.trainer.loss,
        }})
        if self.selector_weight > 0:
            from dflash_pipeline.runtime.stages import component_export, stage_of_export
            from dflash_pipeline.train.frozen import export_with_drafter
            from dflash_pipeline.train.selector import PREFIX

            selector = model.selector
            export_with_drafter(folder, component_export("selector", stage_of_export(folder)),
                                {PREFIX + k: v for k, v in selector.state_dict().items()}, selector.config_dict(),
                                "selector", {"joint": True, "selector_loss_weight": self.selector_weight,
                                             "steps": self.cfg.trainer.steps})
        return folder

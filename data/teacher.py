"""Teacher stage: regenerate assistant replies with the frozen target and capture its hidden states.

For each conversation: apply the target's chat template, regenerate every assistant turn (up to teacher.max_turns)
in order on the target's own earlier replies, mark the generated tokens as the loss mask, and keep the tapped layers'
hidden states of every token (prompt included).

Features (teacher.capture): `during` (default) keeps them as generation computes them: the last turn's prefill
covers the prompt and each decode step its token (a finished row stays one extra step for its last token).
`separate` runs one more right-padded prefill pass over the finished sequences after generation: its features are
bit-identical however samples are batched, `during`'s match them to float rounding (tested). `during` is the default
because it spares that whole extra pass, while keeping the taps adds little to each step (scripts/bench_teacher.py;
the figures: docs/results/benchmarks.md). `engine` (with teacher.engine=vllm): vLLM writes the replies and then
captures the features itself, one pass of each finished sequence through the same engine (models/vllm_engine.py
capture) that reads the states its generation cached, so the target runs only in vLLM; this process loads its
tokenizer, config, embeddings and head.

teacher.mode=prefill takes the dataset's own assistant replies instead: one prefill per sequence gives the features
and, at every token, the target's greedy choice after the dataset's prefix, which becomes that token's label
(`targets`) in place of the human token; mixed regenerates data.num_samples conversations and prefills
teacher.prefill_samples more. A prefill costs about one decode step for a whole sequence, regeneration one per
token. Prefilled samples' ids start with "prefill:"; held-out splits take regenerated samples first.

Work is planned up front (the ordered samples of every shard, sorted by prompt length so batches carry little
padding) and written shard by shard; a killed run, started again, skips completed shards and redoes the one in
progress, so the result is the same dataset an uninterrupted run writes.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from pathlib import Path

import torch
from accelerate import PartialState
from omegaconf import DictConfig

from dflash_pipeline.runtime.progress import Progress
from dflash_pipeline.conf.schema import check_config
from dflash_pipeline.runtime.stages import config_diff, config_hash, stage_config
from dflash_pipeline.runtime.files import write_json
from dflash_pipeline.data.shards import (FEATURE_DTYPES, FORMAT_VERSION, DatasetError, TeacherDataset,
                                         read_shard_record, write_shard)
from dflash_pipeline.data.sources import load_conversations
from dflash_pipeline.data.splits import PREFILLED
from dflash_pipeline.models.generation import capture_batched, generate, generate_capturing, topk_logprobs
from dflash_pipeline.models.families import output_logits, resolve_layer_ids
from dflash_pipeline.models.target import Target, load_target
from dflash_pipeline.models.target_sources import target_folder
from dflash_pipeline.models.vllm_engine import VLLMEngine, VLLMError, check_capture_layers, vllm_python

log = logging.getLogger(__name__)


# -- chat template ---------------------------------------------------------------------------------------------
def chat_segments(tokenizer, messages: list[dict], max_turns: int) -> list[list[int]]:
    """Token ids of the template text before each assistant turn to regenerate.

    segments[k] is what precedes assistant turn k (for k > 0: after assistant turn k-1), so the prompt of turn k is
    segments[0] + reply[0] + ... + segments[k]. The template is rendered once with placeholder replies and split at
    them; the replies' own text is never re-tokenized, so the stored ids are exactly what the target produced.
    The template's arguments (target.chat_template_kwargs, e.g. enable_thinking) come with the tokenizer. Earlier
    turns' replies, reasoning included, stay as the target wrote them (a template that strips earlier reasoning sees
    only placeholders here): the trained sequence is what the target saw while writing each turn.
    """
    msgs, turns = [], 0
    for m in messages:
        if m["role"] == "system" and not msgs:
            msgs.append(m)
        elif m["role"] == "user" and turns < max_turns:
            msgs += [m, {"role": "assistant", "content": f"@@REPLY{turns}@@"}]
            turns += 1
    text = tokenizer.apply_chat_template(msgs, tokenize=False, **getattr(tokenizer, "template_kwargs", {}))
    pieces, rest = [], text
    for k in range(turns):
        head, rest = rest.split(f"@@REPLY{k}@@", 1)
        pieces.append(head)
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in pieces]


def chat_with_replies(tokenizer, messages: list[dict], max_turns: int, max_reply_tokens: int
                      ) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a conversation with its own assistant replies (at most max_turns, each cut to
    max_reply_tokens tokens) in the template text regeneration uses (chat_segments); the mask marks the replies."""
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    ids, mask = [], []
    for segment, reply in zip(chat_segments(tokenizer, messages, max_turns), replies):
        tokens = tokenizer(reply, add_special_tokens=False)["input_ids"][:max_reply_tokens]
        ids += segment + tokens
        mask += [0] * len(segment) + [1] * len(tokens)
    return ids, mask


def prefill_samples(target: Target, convs: list[dict], cfg: DictConfig, layer_ids: list[int],
                    progress: Progress | None = None) -> list[dict]:
    """Samples of `convs` with their own replies: features and the target's top-k captured in one prefill per
    sequence; `targets` at each token is the target's greedy choice there (the label training uses)."""
    t, tok = cfg.teacher, target.tokenizer
    samples, most, cut = [], target.config.max_position_embeddings, 0
    for c in convs:
        ids, mask = chat_with_replies(tok, c["messages"], t.max_turns, t.max_new_tokens)
        if len(ids) > most:  # past the target's context its features and labels mean nothing
            ids, mask, cut = ids[:most], mask[:most], cut + 1
        samples.append({"id": PREFILLED + c["id"], "input_ids": ids, "loss_mask": mask,
                        "num_turns": min(t.max_turns, sum(m["role"] == "assistant" for m in c["messages"]))})
    if cut:
        log.info("teacher: %d of %d prefilled conversations cut to the target's context of %d tokens", cut,
                 len(convs), most)
    outs = capture_batched(target.model, [s["input_ids"] for s in samples], layer_ids, pad_id=tok.pad_token_id,
                           max_tokens=t.capture_batch_tokens, topk=t.topk_logprobs, final=True,
                           done_callback=None if progress is None else progress.update)
    for s, o in zip(samples, outs):
        final = o.pop("final_hidden")
        s.update(o)
        s["targets"] = greedy_labels(target.model, final, s["input_ids"], s["loss_mask"])
    return samples


@torch.no_grad()
def greedy_labels(model, final_hidden: torch.Tensor, ids: list[int], mask: list[int], chunk: int = 256) -> list[int]:
    """Each masked token replaced by the target's greedy choice at its position (the LM head on the row before it:
    only those rows, in chunks, so no (T, V) logits of the prompt are made); unmasked tokens kept."""
    out = list(ids)
    where = [t for t in range(1, len(ids)) if mask[t]]
    for i in range(0, len(where), chunk):
        rows = torch.tensor(where[i: i + chunk], device=final_hidden.device)
        for t, best in zip(where[i: i + chunk], output_logits(model, final_hidden[rows - 1]).argmax(-1).tolist()):
            out[t] = best
    return out


def sample_seed(seed: int, sample_id: str, turn: int) -> int:
    return int(hashlib.sha256(f"{seed}:{sample_id}:{turn}".encode()).hexdigest()[:15], 16)


# -- one shard -------------------------------------------------------------------------------------------------
def regenerate(target: Target, convs: list[dict], cfg: DictConfig, seed: int, progress: Progress | None = None,
               layer_ids: list[int] | None = None, engine: VLLMEngine | None = None) -> list[dict]:
    """Regenerate the assistant turns of `convs` (turn by turn, each turn one continuously batched generation of
    every sample that has it); returns samples with input_ids and loss_mask. With layer_ids, also their
    features and final hidden states as generation computes them (from the last turn's prefill and decode steps).

    progress: counts each conversation as done in equal parts as its replies finish (inside a generation batch),
    and the generated tokens as "gen tok". engine: vLLM writes the replies instead (teacher.engine=vllm; greedy,
    all of a turn's prompts in one request batch); features are then left to add_features.
    """
    tok, t = target.tokenizer, cfg.teacher
    samples = []
    for c in convs:
        samples.append({"id": c["id"], "segments": chat_segments(tok, c["messages"], t.max_turns),
                        "input_ids": [], "loss_mask": [], "num_turns": 0})
    counted = [0.0]  # samples reported to `progress` so far
    for turn in range(t.max_turns):
        todo = turn_prompts(samples, turn, target.eos_ids, target.config.max_position_embeddings, t.max_new_tokens)
        if not todo:
            continue
        on_step = turn_progress(progress, todo, counted)
        replies, captured = generate_turn(target, todo, cfg, seed, turn, on_step, layer_ids, engine)
        for s, r, c in zip(todo, replies, captured):
            s["input_ids"] += r
            s["loss_mask"] += [1] * len(r)
            s["num_turns"] += 1
            if c is not None:  # this turn's pass saw the whole sequence: it replaces the earlier turn's
                s.update(c)
    if progress is not None:  # turns skipped for want of context room, and conversations without a turn
        progress.update(len(samples) - counted[0])
    return samples


def turn_prompts(samples: list[dict], turn: int, eos_ids: set[int], max_len: int, max_new_tokens: int
                 ) -> list[dict]:
    """The samples that get a reply in `turn`, each with the template text before that reply appended (unmasked),
    shortest first. A sample is left out when it has no such turn, when an earlier turn of it was left out, or when
    the reply would not fit the target's context (max_len)."""
    todo = []
    for s in samples:
        if turn >= len(s["segments"]) or s["num_turns"] < turn:
            continue
        seg = s["segments"][turn]
        if s["input_ids"] and s["input_ids"][-1] in eos_ids and seg[:1] == s["input_ids"][-1:]:
            seg = seg[1:]  # the reply already ended with the template's end-of-turn token
        if turn and len(s["input_ids"]) + len(seg) + max_new_tokens > max_len:
            continue  # no room for another turn within the target's context
        s["input_ids"] += seg
        s["loss_mask"] += [0] * len(seg)
        todo.append(s)
    todo.sort(key=lambda s: len(s["input_ids"]))  # length order: admitted neighbours carry little padding
    return todo


def turn_progress(progress: Progress | None, todo: list[dict], counted: list[float]):
    """The generation's on_step callback for one turn (None without progress): it adds the new tokens to "gen tok"
    and each finished reply as its share of a conversation (1 / its turns), keeping the running total in counted[0]
    so that regenerate can settle the rest at the end."""
    if not progress:
        return None

    def on_step(new_tokens: int, finished: list[int]) -> None:
        progress.add("gen tok", new_tokens)
        part = sum(1 / len(todo[r]["segments"]) for r in finished)
        counted[0] += part
        progress.update(part)

    return on_step


def generate_turn(target: Target, todo: list[dict], cfg: DictConfig, seed: int, turn: int, on_step,
                  layer_ids: list[int] | None, engine: VLLMEngine | None) -> tuple[list[list[int]], list]:
    """One turn's replies to the prompts of `todo` (in that order), and per sample the features generation captured
    (None where it captured none): by vLLM (engine), else by transformers, with the taps when layer_ids is given.
    Sampled replies (teacher.temperature > 0) draw from a generator seeded per sample and turn."""
    t, tok, eos_ids = cfg.teacher, target.tokenizer, target.eos_ids
    gens = None
    if t.temperature > 0:
        gens = [torch.Generator().manual_seed(sample_seed(seed, s["id"], turn)) for s in todo]
    settings = dict(max_new_tokens=t.max_new_tokens, eos_ids=eos_ids, pad_id=tok.pad_token_id,
                    temperature=t.temperature, top_p=t.top_p, generators=gens, on_step=on_step,
                    batch_size=t.batch_size, prefill_tokens=t.prefill_batch_tokens,
                    max_len=target.config.max_position_embeddings)
    prompts = [s["input_ids"] for s in todo]
    if engine is not None:
        replies = engine.generate(prompts, t.max_new_tokens, sorted(eos_ids), batch=True)["outputs"]
        if on_step is not None:
            on_step(sum(map(len, replies)), list(range(len(todo))))
        return replies, [None] * len(todo)
    if layer_ids is None:
        return generate(target.model, prompts, **settings), [None] * len(todo)
    return generate_capturing(target.model, prompts, layer_ids, **settings)


def add_features(target: Target, samples: list[dict], layer_ids: list[int], cfg: DictConfig,
                 engine: VLLMEngine | None = None) -> None:
    """Features (and top-k log-probs) of every sample. Samples that kept them from generation (teacher.capture=
    during) get their top-k from the stored final hidden states; the rest are captured in prefill batches bounded
    by a token budget (sorted by length), by vLLM itself with teacher.capture=engine."""
    k = cfg.teacher.topk_logprobs
    if cfg.teacher.capture == "engine":
        if cfg.teacher.feature_dtype != "none":
            features, _ = engine.capture([s["input_ids"] for s in samples])
            for s, f in zip(samples, features):
                s["features"] = f
        return
    for s in samples:
        final = s.pop("final_hidden", None)
        if final is not None and k:
            s.update(topk_logprobs(target.model, final, k))
    if cfg.teacher.feature_dtype == "none" and not k:  # tokens only: nothing to capture
        return
    todo = [s for s in samples if "features" not in s]
    outs = capture_batched(target.model, [s["input_ids"] for s in todo], layer_ids, pad_id=target.tokenizer.pad_token_id,
                           max_tokens=cfg.teacher.capture_batch_tokens, topk=k)
    for s, o in zip(todo, outs):
        s.update(o)


def teacher_samples(target: Target, convs: list[dict], cfg: DictConfig, layer_ids: list[int],
                    progress: Progress | None = None, engine: VLLMEngine | None = None) -> list[dict]:
    """The finished samples of `convs` (one shard): regenerated replies, loss masks, features (teacher.capture),
    and for conversations marked "prefill" (teacher.mode prefill / mixed) their own replies, prefilled. With any
    prefilled sample in the dataset, every sample carries `targets` (a regenerated one: its own tokens)."""
    regen = [c for c in convs if not c.get("prefill")]
    during = layer_ids if cfg.teacher.capture == "during" and engine is None else None
    samples = regenerate(target, regen, cfg, cfg.seed, progress, during, engine) if regen else []
    add_features(target, samples, layer_ids, cfg, engine)
    prefilled = [c for c in convs if c.get("prefill")]
    if prefilled:
        samples += prefill_samples(target, prefilled, cfg, layer_ids, progress)
    if cfg.teacher.mode != "regenerate":
        for s in samples:
            s.setdefault("targets", list(s["input_ids"]))
    return samples


# -- the stage -------------------------------------------------------------------------------------------------
def plan_shards(target: Target, convs: list[dict], shard_size: int) -> list[list[int]]:
    """Conversation indices per shard, in order of first-prompt length (stable): the bucketing order. Conversations
    to regenerate come before those to prefill, so regeneration batches stay full instead of being split over every
    shard."""
    lengths = [len(chat_segments(target.tokenizer, c["messages"], 1)[0]) for c in convs]
    order = sorted(range(len(convs)), key=lambda i: (bool(convs[i].get("prefill")), lengths[i]))
    return [order[i: i + shard_size] for i in range(0, len(order), shard_size)]


def check_existing(out: Path, digest: str, config: dict) -> str:
    """'done' / 'resume' / 'new' for an output folder, refusing a folder made with another config."""
    for name in ("manifest.json", "plan.json"):
        f = out / name
        if f.is_file():
            theirs = json.loads(f.read_text())
            if theirs["config_hash"] != digest:
                diff = "; ".join(config_diff(theirs.get("config", {}), config)[:5])
                raise DatasetError(
                    f"{out} holds a teacher dataset of a different config ({diff or 'hash ' + theirs['config_hash']}); "
                    "choose another hydra.run.dir / name, or delete the folder"
                )
            return "done" if name == "manifest.json" else "resume"
    return "new"


def teacher_and_target(cfg: DictConfig, data_dir: Path, body: bool = True) -> tuple[TeacherDataset, Target]:
    """A finished teacher dataset and the configured target (body=False: its head alone, models/target_head.py
    TargetHead), checked to belong together and to leave more than trainer.heldout_samples sequences for training
    (what every training stage starts from)."""
    data = TeacherDataset(data_dir)
    target = load_target(cfg.target, cfg.cache_dir, body=body)
    tc = target.model.config
    meta = data.manifest["target"]
    if meta["hidden_size"] != tc.hidden_size or max(data.layer_ids) >= tc.num_hidden_layers:
        raise DatasetError(
            f"teacher dataset {data_dir} was made for a target with hidden size {meta['hidden_size']} and "
            f"{meta['num_layers']} layers (taps {data.layer_ids}); the configured target has hidden size "
            f"{tc.hidden_size} and {tc.num_hidden_layers} layers: regenerate the teacher data for this target")
    if len(data) <= cfg.trainer.heldout_samples:
        raise DatasetError(f"teacher dataset has {len(data)} samples, not more than "
                           f"trainer.heldout_samples={cfg.trainer.heldout_samples}: generate more teacher data")
    return data, target


def teacher_conversations(cfg: DictConfig, target: Target, note) -> list[dict]:
    """The conversations of the dataset, in source order; those whose own replies are prefilled marked "prefill"
    (teacher.mode=prefill: all of them; mixed: teacher.prefill_samples after the data.num_samples regenerated)."""
    d, t = cfg.data, cfg.teacher
    extra = t.prefill_samples if t.mode == "mixed" else 0
    if t.mode == "mixed" and not extra:
        raise DatasetError("teacher.mode=mixed prefills teacher.prefill_samples conversations besides the "
                           "regenerated ones: set teacher.prefill_samples > 0")
    limit = None if d.num_samples is None else d.num_samples + extra
    convs = load_conversations(d.source, path=d.path, name=d.name, split=d.split,
                               heldout_fraction=d.heldout_fraction, limit=limit, skip=d.skip,
                               tokenizer=target.tokenizer, max_prompt_tokens=d.max_prompt_tokens,
                               min_tokens=d.min_tokens, log=note)
    first = {"regenerate": len(convs), "prefill": 0, "mixed": len(convs) - extra}[str(t.mode)]
    for i, c in enumerate(convs):
        c["prefill"] = i >= first
    if t.mode != "regenerate":
        without = sum(c["prefill"] and not any(m["role"] == "assistant" for m in c["messages"]) for c in convs)
        if without == sum(c["prefill"] for c in convs):
            raise DatasetError(f"teacher.mode={t.mode}: the {d.source} conversations have no assistant replies to "
                               "prefill (a prompt-only source); use teacher.mode=regenerate")
        if without:
            note(f"{without} conversations to prefill have no assistant reply: they add no training tokens")
    return convs


def check_engine(cfg: DictConfig) -> None:
    """teacher.engine=vllm (and teacher.capture=engine): refused in one line where it cannot make the dataset (before
    any output)."""
    t = cfg.teacher
    if t.capture == "engine":
        if t.engine != "vllm":
            raise DatasetError("teacher.capture=engine takes the features from vLLM: set teacher.engine=vllm (and run "
                               "bash scripts/setup_vllm.sh once)")
        if t.mode != "regenerate" or t.topk_logprobs:
            raise DatasetError("teacher.capture=engine captures the features of regenerated replies only; prefilled "
                               "samples (teacher.mode) and top-k log-probs (teacher.topk_logprobs) come from the "
                               "transformers target: use teacher.capture=separate for them")
    if cfg.teacher.engine != "vllm":
        return
    if cfg.teacher.temperature > 0:
        raise DatasetError("teacher.engine=vllm regenerates greedily (replies token-identical to the hf engine's); "
                           "set teacher.temperature=0 or use teacher.engine=hf for sampled replies")
    try:
        vllm_python(cfg.cache_dir)
    except VLLMError as err:
        raise DatasetError(str(err)) from None


def teacher_engine(cfg: DictConfig, target: Target, out: Path, layer_ids: list[int]
                   ) -> contextlib.AbstractContextManager:
    """The vLLM engine that writes the replies (teacher.engine=vllm) and with teacher.capture=engine captures the
    features, on the target's folder in the target's dtype with this process's threads, logging to <out>/vllm.log;
    a null context for the hf engine."""
    if cfg.teacher.engine != "vllm":
        return contextlib.nullcontext()
    capture = cfg.teacher.capture == "engine"
    log.info("teacher: replies%s from vLLM (engine log %s)", " and features" if capture else "", out / "vllm.log")
    return VLLMEngine(cfg.cache_dir, target_folder(cfg.target, cfg.cache_dir), target.dtype,
                      target.config.max_position_embeddings, threads=torch.get_num_threads(),
                      max_num_seqs=cfg.teacher.batch_size, log_file=out / "vllm.log",
                      capture_layers=layer_ids if capture else None)


def run_teacher(cfg: DictConfig, out: Path) -> Path:
    """Build (or finish) the teacher dataset of `cfg` in folder `out`; returns `out`."""
    check_config(cfg)
    # cpu=True on a machine without CUDA, as the trainer's Accelerator: otherwise a CPU `accelerate launch` of N
    # processes gives each process a one-process state, and every process generates every shard.
    state = PartialState(cpu=not torch.cuda.is_available())
    digest, config = config_hash(cfg, "teacher"), stage_config(cfg, "teacher")
    status = check_existing(out, digest, config)
    if status == "done":
        log.info("teacher dataset already complete at %s (config %s): skipping", out, digest)
        return out

    # Everything that can fail on bad input is checked before the output folder is created.
    target, layer_ids = checked_target(cfg)
    feature_dtype = FEATURE_DTYPES[str(cfg.teacher.feature_dtype)]
    notes: list[str] = []

    def note(msg: str) -> None:
        notes.append(msg)
        log.info(msg)

    convs = teacher_conversations(cfg, target, note)
    target.model.to(state.device)
    shards = plan_shards(target, convs, cfg.teacher.shard_size)
    plan = {"config_hash": digest, "config": config, "target_dtype": target.dtype,
            "shards": [[convs[i]["id"] for i in s] for s in shards]}

    if state.is_main_process:
        start_or_check_plan(out, status, plan, target)
    state.wait_for_everyone()
    write_own_shards(cfg, out, state, target, convs, shards, layer_ids, feature_dtype)
    state.wait_for_everyone()
    if state.is_main_process:
        write_manifest(cfg, out, target, convs, len(shards), layer_ids, digest, config, notes)
    state.wait_for_everyone()
    return out


def checked_target(cfg: DictConfig) -> tuple[Target, list[int]]:
    """The target (its head alone with teacher.capture=engine) and the tapped layer ids, the engine settings checked
    first and the taps against what vLLM can capture: the checks on bad input that run before any output."""
    check_engine(cfg)
    target = load_target(cfg.target, cfg.cache_dir, body=cfg.teacher.capture != "engine")
    layer_ids = resolve_layer_ids(cfg.teacher.layer_ids, cfg.teacher.num_taps, target.num_layers)
    if cfg.teacher.capture == "engine":
        try:
            check_capture_layers(layer_ids, target.num_layers)
        except VLLMError as err:
            raise DatasetError(str(err)) from None
    return target, layer_ids


def start_or_check_plan(out: Path, status: str, plan: dict, target: Target) -> None:
    """A new folder gets plan.json; a started one must hold this very plan (the same samples in the same shards, a
    target in the same dtype), so that finishing it gives the dataset an uninterrupted run writes."""
    if status == "new":
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "plan.json", plan)
        return
    started = json.loads((out / "plan.json").read_text())
    if started["shards"] != plan["shards"]:
        raise DatasetError(f"{out}/plan.json lists other samples than this config selects; delete the folder")
    if started.get("target_dtype", target.dtype) != target.dtype:  # target.dtype=auto on another machine
        raise DatasetError(f"{out} was started with a {started['target_dtype']} target, this machine runs it "
                           f"in {target.dtype} (target.dtype=auto decides per machine): finish it where the "
                           f"target runs in {started['target_dtype']}, or start another folder with an "
                           "explicit target.dtype")


def write_own_shards(cfg: DictConfig, out: Path, state: PartialState, target: Target, convs: list[dict],
                     shards: list[list[int]], layer_ids: list[int], feature_dtype: torch.dtype | None) -> None:
    """Generate and write this process's shards (shard k is process k mod N's) that are not on disk yet: a shard
    file is the unit of resumption, so a rerun redoes only the shard a killed run was writing. The vLLM engine is
    started only when a shard left to write has replies to regenerate."""
    mine = [k for k in range(len(shards)) if k % state.num_processes == state.process_index]
    todo = [k for k in mine if read_shard_record(out, k) is None]
    total = sum(len(shards[k]) for k in mine)
    done = total - sum(len(shards[k]) for k in todo)
    log.info("teacher: %d samples in %d shards (%d done), layers %s -> %s", total, len(mine), done, layer_ids, out)
    desc = "teacher" if state.num_processes == 1 else f"teacher (rank 0 of {state.num_processes})"
    regenerating = any(not convs[i]["prefill"] for k in todo for i in shards[k])
    with contextlib.ExitStack() as stack:
        engine = stack.enter_context(teacher_engine(cfg, target, out, layer_ids)) if regenerating else None
        bar = stack.enter_context(Progress(desc, total, "sample", initial=done, enabled=state.is_main_process))
        for k in todo:  # the bar moves as replies finish; features and the shard file follow each shard
            start = time.perf_counter()
            samples = teacher_samples(target, [convs[i] for i in shards[k]], cfg, layer_ids, bar, engine)
            write_shard(out, k, samples, feature_dtype, process=f"{state.process_index} of {state.num_processes}",
                        seconds=time.perf_counter() - start, taps=len(layer_ids))


def write_manifest(cfg: DictConfig, out: Path, target: Target, convs: list[dict], num_shards: int,
                   layer_ids: list[int], digest: str, config: dict, notes: list[str]) -> None:
    """manifest.json, which marks the dataset complete (check_existing then skips the folder): written only once
    every process's shards are on disk, with what a training stage checks the dataset against."""
    records = [read_shard_record(out, k, check=False) for k in range(num_shards)]
    missing = [k for k, r in enumerate(records) if r is None]
    if missing:
        raise DatasetError(f"teacher shards {missing} are missing in {out}; rerun the same command to finish")
    mc = target.model.config
    write_json(out / "manifest.json", {
        "format_version": FORMAT_VERSION,
        "config_hash": digest,
        "config": config,
        "target": {"ref": target.ref, "num_layers": mc.num_hidden_layers, "hidden_size": mc.hidden_size,
                   "vocab_size": mc.vocab_size, "eos_token_id": target.tokenizer.eos_token_id,
                   "dtype": target.dtype, "numerics": target.numerics},
        "layer_ids": layer_ids,
        "feature_dtype": cfg.teacher.feature_dtype,
        "topk_logprobs": cfg.teacher.topk_logprobs,
        "mode": str(cfg.teacher.mode),
        "engine": str(cfg.teacher.engine),  # who wrote the regenerated replies
        "capture": str(cfg.teacher.capture),  # who captured the features (engine: vLLM, else transformers)
        "num_prefilled": sum(c["prefill"] for c in convs),
        "num_samples": sum(r["num_samples"] for r in records),
        "num_tokens": sum(r["num_tokens"] for r in records),
        "num_loss_tokens": sum(r["num_loss_tokens"] for r in records),
        "notes": notes,
        "shards": records,
    })
    log.info("teacher dataset complete: %s", out)

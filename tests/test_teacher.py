"""The teacher stage: what a drafter is trained on must be exactly what the target computes."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from hydra.errors import ConfigCompositionException
from safetensors.torch import load_file

from dflash_pipeline.data import teacher as teacher_mod
from dflash_pipeline.data.shards import DatasetError, TeacherDataset, dequantize_fp8, quantize_fp8
from dflash_pipeline.data.sources import DataSourceError
from dflash_pipeline.data.teacher import chat_segments, run_teacher
from dflash_pipeline.models.generation import budget_batches, recapture
from dflash_pipeline.models.errors import TargetError
from dflash_pipeline.models.families import default_layer_ids
from dflash_pipeline.models.target import load_target

from conftest import make_config


@pytest.fixture(scope="module")
def tiny_target():
    cfg = make_config()
    return load_target(cfg.target, cfg.cache_dir)


def test_default_layer_ids_follow_dflash_spacing():
    assert default_layer_ids(30, 5) == [1, 8, 14, 20, 27]
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(30, 1) == [15]


def test_features_equal_target_hidden_states_despite_padding(tiny_teacher, tiny_target):
    ds = TeacherDataset(tiny_teacher)
    # The capture pass batched samples of different lengths with padding (same shard, one prefill batch).
    assert len({len(ds[i]["input_ids"]) for i in range(4)}) > 1
    for i in range(len(ds)):
        item = ds[i]
        ids = item["input_ids"][None]
        with torch.no_grad():
            hs = tiny_target.model(input_ids=ids, output_hidden_states=True).hidden_states
        want = torch.cat([hs[l + 1][0] for l in ds.layer_ids], dim=-1)
        assert item["features"].dtype == torch.bfloat16
        assert item["features"].shape == want.shape
        torch.testing.assert_close(item["features"].float(), want, rtol=1e-2, atol=1e-2)


def test_recapture_in_budgeted_batches_equals_one_sequence_at_a_time(tiny_teacher, tiny_target):
    """The eval recaptures features of prompts of very different lengths: batching them under a token budget
    (rows x longest) must give each sequence the features it has alone, in the items' own order."""
    ds = TeacherDataset(tiny_teacher)
    items = [{"input_ids": ds[i]["input_ids"]} for i in reversed(range(len(ds)))]
    pad = tiny_target.tokenizer.pad_token_id
    longest = max(len(it["input_ids"]) for it in items)
    with torch.no_grad():
        batched = recapture(tiny_target.model, [dict(it) for it in items], ds.layer_ids, pad_id=pad,
                            max_tokens=2 * longest, final=True)
        alone = [recapture(tiny_target.model, [dict(it)], ds.layer_ids, pad_id=pad, final=True)[0] for it in items]
    for b, a in zip(batched, alone):
        assert b["features"].shape[0] == len(b["input_ids"])
        torch.testing.assert_close(b["features"], a["features"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b["final_hidden"], a["final_hidden"], rtol=1e-4, atol=1e-4)
    assert len(budget_batches(sorted((it["input_ids"] for it in items), key=len), len(items), 2 * longest)) > 1


def test_replies_equal_unbatched_greedy_generation(tiny_teacher, tiny_target):
    """Left-padded batched decoding must not change what the target says."""
    ds = TeacherDataset(tiny_teacher)
    for i in range(len(ds)):
        ids, mask = ds[i]["input_ids"], ds[i]["loss_mask"]
        start = int(mask.nonzero()[0])
        end = start
        while end < len(mask) and mask[end]:
            end += 1
        out = tiny_target.model.generate(input_ids=ids[None, :start], max_new_tokens=end - start, do_sample=False,
                                         min_new_tokens=end - start)
        assert out[0, start:].tolist() == ids[start:end].tolist()


def test_loss_mask_covers_exactly_the_replies(tiny_teacher, tiny_target):
    tok = tiny_target.tokenizer
    ds = TeacherDataset(tiny_teacher)
    cfg = make_config()
    two_turns = 0
    for i in range(len(ds)):
        ids, mask = ds[i]["input_ids"].tolist(), ds[i]["loss_mask"].tolist()
        # Runs of masked tokens are the replies; everything else is template + user text.
        runs, k = [], 0
        while k < len(mask):
            if mask[k]:
                j = k
                while j < len(mask) and mask[j]:
                    j += 1
                runs.append((k, j))
                k = j
            else:
                k += 1
        assert mask[-1] == 1, "a sample ends with the last generated reply"
        first_prompt = tok.apply_chat_template(
            [m for m in _conversation(ds.ids[i]) if m["role"] == "user"][:1], add_generation_prompt=True,
            tokenize=True, return_dict=False)
        assert ids[: runs[0][0]] == list(first_prompt)
        for a, b in runs:
            assert b - a == cfg.teacher.max_new_tokens or ids[b - 1] in tiny_target.eos_ids
        if len(runs) == 2:
            two_turns += 1
            between = tok.decode(ids[runs[0][1]: runs[1][0]])
            assert "<|im_start|>user" in between and between.endswith("<|im_start|>assistant\n")
    assert two_turns > 0, "the tiny experiment regenerates two turns"


def _conversation(sample_id: str):
    from dflash_pipeline.data.sources import load_conversations

    cfg = make_config()
    convs = load_conversations("sharegpt", limit=cfg.data.num_samples, max_prompt_tokens=None, log=lambda s: None)
    return next(c for c in convs if c["id"] == sample_id)["messages"]


def test_chat_segments_match_the_template(tiny_target):
    tok = tiny_target.tokenizer
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "old"},
            {"role": "user", "content": "more"}]
    segs = chat_segments(tok, msgs, max_turns=2)
    assert len(segs) == 2
    assert segs[0] == list(tok.apply_chat_template(msgs[:1], add_generation_prompt=True, tokenize=True,
                                                   return_dict=False))
    assert tok.decode(segs[1]).startswith("<|im_end|>\n<|im_start|>user\nmore")
    assert len(chat_segments(tok, msgs, max_turns=1)) == 1


def _dataset_content(folder):
    """(tensors, shard records without the time each took, file names) of a teacher dataset."""
    shards = sorted(folder.glob("shard-*.safetensors"))
    manifest = json.loads((folder / "manifest.json").read_text())
    records = [{k: v for k, v in r.items() if k != "seconds"} for r in manifest["shards"]]
    return [load_file(str(s)) for s in shards], records, [s.name for s in shards]


def test_resume_after_crash_gives_identical_dataset(tiny_teacher, tmp_path, monkeypatch):
    cfg = make_config()
    out = tmp_path / "teacher"
    real_write = teacher_mod.write_shard
    calls = {"n": 0}

    def crash_after_first(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            # die half-way through the second shard: a stray temporary file is left behind
            (out / "shard-00001.safetensors.tmp").write_bytes(b"partial")
            raise KeyboardInterrupt("simulated kill")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(teacher_mod, "write_shard", crash_after_first)
    with pytest.raises(KeyboardInterrupt):
        run_teacher(cfg, out)
    assert not (out / "manifest.json").exists()
    with pytest.raises(DatasetError, match="manifest.json missing"):
        TeacherDataset(out)
    monkeypatch.setattr(teacher_mod, "write_shard", real_write)
    run_teacher(cfg, out)

    got, got_records, got_names = _dataset_content(out)
    want, want_records, want_names = _dataset_content(tiny_teacher)
    assert got_names == want_names and got_records == want_records
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for k in g:
            assert torch.equal(g[k], w[k]), k


def crash_before_second_shard(cfg, out, monkeypatch) -> None:
    """Run the teacher into `out` and kill it as it writes shard 1 (shard 0 complete), as a user's ^C would."""
    real_write = teacher_mod.write_shard

    def crash_on_second(out_dir, k, *args, **kwargs):
        if k == 1:
            raise KeyboardInterrupt("simulated kill")
        return real_write(out_dir, k, *args, **kwargs)

    monkeypatch.setattr(teacher_mod, "write_shard", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        run_teacher(cfg, out)
    monkeypatch.setattr(teacher_mod, "write_shard", real_write)


def test_bf16_resume_after_crash_equals_an_uninterrupted_bf16_run(tmp_path, monkeypatch):
    """bf16 replies may depend on their batch at near-ties, but the batches are fixed by the config: a crash-resumed
    bf16 teacher writes exactly the shards of an uninterrupted one."""
    cfg = make_config("target.dtype=bfloat16", "data.num_samples=6", "teacher.max_turns=1")
    whole = run_teacher(cfg, tmp_path / "whole")
    out = tmp_path / "resumed"
    crash_before_second_shard(cfg, out, monkeypatch)
    run_teacher(cfg, out)
    (_, got_records, _), (_, want_records, _) = _dataset_content(out), _dataset_content(whole)
    assert got_records == want_records and json.loads((out / "manifest.json").read_text())["target"]["dtype"] == \
        "bfloat16"


@pytest.mark.slow
def test_auto_dtype_resume_on_other_numerics_is_refused(tmp_path, monkeypatch):
    """target.dtype=auto decides per machine: a teacher started in float32 is not finished in bfloat16 (its shards
    would mix numerics); the resolved dtype is recorded in the plan and the manifest."""
    import dflash_pipeline.models.target as target_mod

    cfg, out = make_config("target.dtype=auto"), tmp_path / "teacher"
    monkeypatch.setattr(target_mod, "resolve_dtype", lambda name, device: ("float32", {"requested": name}))
    crash_before_second_shard(cfg, out, monkeypatch)
    assert json.loads((out / "plan.json").read_text())["target_dtype"] == "float32"
    monkeypatch.setattr(target_mod, "resolve_dtype", lambda name, device: ("bfloat16", {"requested": name}))
    with pytest.raises(DatasetError, match=r"started with a float32 target, this machine runs it in bfloat16"):
        run_teacher(cfg, out)
    monkeypatch.setattr(target_mod, "resolve_dtype", lambda name, device: ("float32", {"requested": name}))
    run_teacher(cfg, out)
    target = json.loads((out / "manifest.json").read_text())["target"]
    assert target["dtype"] == "float32" and target["numerics"]["requested"] == "auto"


def test_complete_dataset_is_skipped_and_other_config_refused(tiny_teacher, tmp_path):
    out = tmp_path / "teacher"
    shutil.copytree(tiny_teacher, out)
    before = (out / "manifest.json").stat().st_mtime_ns
    run_teacher(make_config(), out)  # same config: nothing to do
    assert (out / "manifest.json").stat().st_mtime_ns == before
    with pytest.raises(DatasetError, match=r"different config \(teacher.max_new_tokens: 24 -> 5"):
        run_teacher(make_config("teacher.max_new_tokens=5"), out)


def test_corrupt_or_truncated_shard_is_named(tiny_teacher, tmp_path):
    out = tmp_path / "teacher"
    shutil.copytree(tiny_teacher, out)
    shard = out / "shard-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DatasetError, match="shard-00001.safetensors"):
        TeacherDataset(out)
    shard.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(DatasetError, match="shard-00001.safetensors"):
        TeacherDataset(out)


def test_dataset_reads_lazily_and_as_hf_dataset(tiny_teacher):
    ds = TeacherDataset(tiny_teacher)
    assert len(ds) == 8 and ds.num_tokens == sum(len(ds[i]["input_ids"]) for i in range(len(ds)))
    item = ds[3]
    assert item["topk_ids"].shape == (len(item["input_ids"]), 4)
    # top-k row t is the target's distribution that predicted token t: on a reply the target's greedy token is top-1
    reply = item["loss_mask"].nonzero().squeeze(-1)
    assert torch.equal(item["topk_ids"][reply, 0].long(), item["input_ids"][reply])
    hf = next(iter(ds.as_hf_dataset()))
    assert hf["id"] == ds.ids[0] and len(hf["input_ids"]) == len(ds[0]["input_ids"])


def test_layer_id_out_of_range_fails_and_writes_nothing(tmp_path):
    out = tmp_path / "teacher"
    with pytest.raises(TargetError, match=r"layer_ids \[99\] out of range.*6 layers"):
        run_teacher(make_config("teacher.layer_ids=[1,99]"), out)
    assert not out.exists()


def test_empty_dataset_fails_and_writes_nothing(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"prompt": ""}\n')
    out = tmp_path / "teacher"
    with pytest.raises(DataSourceError, match="no conversations"):
        run_teacher(make_config("data=file", f"data.path={empty}"), out)
    assert not out.exists()


def test_wrong_config_key_fails_at_compose():
    with pytest.raises(ConfigCompositionException, match="max_new_tokenz"):
        make_config("teacher.max_new_tokenz=3")
    with pytest.raises(ConfigCompositionException, match="max_new_tokens"):
        make_config("teacher.max_new_tokens=lots")


def test_cli_wrong_key_is_one_clear_line_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", "from dflash_pipeline.cli.entrypoints import teacher; teacher()", "experiment=tiny",
         "teacher.max_new_tokenz=3", f"hydra.run.dir={run_dir}"],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "max_new_tokenz" in proc.stderr and "Traceback" not in proc.stderr
    assert not run_dir.exists()


def _varied_llama():
    """A small random Llama whose greedy continuations vary (the tiny target's greedy output repeats one token)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()


@pytest.mark.parametrize("sampling", [False, True], ids=["greedy", "sampled"])
def test_continuous_batching_replies_equal_one_prompt_at_a_time(sampling):
    """generate() with continuous batching (3 rows, admissions split by the prefill budget, rows leaving at
    different steps and replaced from the queue) gives every prompt the reply it gets alone."""
    from dflash_pipeline.models.generation import generate

    model = _varied_llama()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 64, (3 + 2 * i,), generator=g).tolist() for i in range(10)]
    kw = {"temperature": 1.0, "top_p": 0.9} if sampling else {}
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(len(prompts))] if sampling else None  # noqa: E731
    common = dict(max_new_tokens=24, eos_ids={5, 17, 33}, pad_id=0, **kw)
    single = []
    for i, p in enumerate(prompts):
        if sampling:  # the one-prompt path of the same sampler
            single.append(generate(model, [p], generators=gens()[i: i + 1], **common)[0])
        else:  # transformers' own greedy decoding
            out = model.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=[5, 17, 33],
                                 pad_token_id=0)
            single.append(out[0, len(p):].tolist())
    assert len({len(r) for r in single}) > 3, "replies of many lengths: rows leave and are replaced mid-batch"
    batched = generate(model, prompts, generators=gens(), batch_size=3, prefill_tokens=24, **common)
    assert batched == single
    # the target's context: a reply stops where prompt + reply reach max_len, whatever max_new_tokens says
    capped = generate(model, prompts, generators=gens(), batch_size=3, max_len=20, **common)
    assert capped == [r[:max(0, 20 - len(p))] or r[:1] for p, r in zip(prompts, single)]


@pytest.mark.slow
def test_continuous_batching_gives_the_unbatched_dataset(tiny_target):
    """The teacher's continuously batched regeneration writes exactly the dataset of the one-row-at-a-time path:
    ids, loss masks, top-k and features (both turns, a batch smaller than the samples, a prefill budget that splits
    admissions); with features kept during generation (the default), equal to float rounding."""
    from dflash_pipeline.data.sources import load_conversations
    from dflash_pipeline.data.teacher import teacher_samples

    def dataset(*overrides):
        cfg = make_config(*overrides)
        convs = load_conversations("sharegpt", limit=cfg.data.num_samples, tokenizer=tiny_target.tokenizer,
                                   max_prompt_tokens=cfg.data.max_prompt_tokens, log=lambda s: None)
        return teacher_samples(tiny_target, convs, cfg, [0, 1, 5])

    unbatched = dataset("teacher.batch_size=1", "teacher.capture=separate")
    batched = ("teacher.batch_size=3", "teacher.prefill_batch_tokens=200")
    continuous = dataset(*batched, "teacher.capture=separate")
    during = dataset(*batched, "teacher.capture=during")
    assert sum(s["num_turns"] for s in unbatched) > len(unbatched), "second turns regenerated too"
    for a, b, c in zip(unbatched, continuous, during):
        assert a["input_ids"] == b["input_ids"] == c["input_ids"] and a["loss_mask"] == b["loss_mask"] == c["loss_mask"]
        assert torch.equal(a["features"], b["features"]) and torch.equal(a["topk_ids"], b["topk_ids"])
        assert c["features"].shape == a["features"].shape == (len(a["input_ids"]), 3 * tiny_target.hidden_size)
        torch.testing.assert_close(c["features"], a["features"], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(c["topk_logprobs"], a["topk_logprobs"], rtol=1e-4, atol=1e-4)


def test_stored_topk_logprobs_are_the_targets_log_softmax_topk(tiny_target):
    """The chunked top-k (logits' top-k minus their logsumexp) equals the top-k of the full log-softmax, row t from
    the logits at t-1 and row 0 zero, across chunk boundaries."""
    from dflash_pipeline.models.generation import topk_logprobs

    hidden = torch.randn(11, tiny_target.hidden_size, generator=torch.Generator().manual_seed(0))
    out = topk_logprobs(tiny_target.model, hidden, 4, chunk=3)
    with torch.no_grad():
        ref_vals, ref_ids = torch.log_softmax(tiny_target.model.lm_head(hidden[:-1]).float(), -1).topk(4, dim=-1)
    assert out["topk_logprobs"].shape == (11, 4) and out["topk_ids"].dtype == torch.long
    assert not out["topk_logprobs"][0].any() and not out["topk_ids"][0].any()
    torch.testing.assert_close(out["topk_logprobs"][1:], ref_vals)
    assert torch.equal(out["topk_ids"][1:], ref_ids)


# -- teacher.mode prefill / mixed --------------------------------------------------------------------------------
def test_mixed_teacher_prefills_the_datasets_replies_labelled_by_the_target(tiny_target, tmp_path):
    """teacher.mode=mixed: the first data.num_samples conversations regenerated, teacher.prefill_samples more with
    their own replies; a prefilled token's label is the target's greedy choice after the dataset's prefix, a
    regenerated one's its own token; held-out samples are regenerated ones; blocks train on the labels."""
    from dflash_pipeline.data.blocks import pack_blocks
    from dflash_pipeline.data.splits import split_heldout
    from dflash_pipeline.data.sources import load_conversations
    from dflash_pipeline.data.teacher import chat_with_replies

    cfg = make_config("teacher.mode=mixed", "teacher.prefill_samples=4", "data.num_samples=4")
    data = TeacherDataset(run_teacher(cfg, tmp_path / "teacher"))
    assert data.manifest["mode"] == "mixed" and data.manifest["num_prefilled"] == 4
    prefilled = [i for i, s in enumerate(data.ids) if s.startswith("prefill:")]
    assert len(prefilled) == 4 and len(data) == 8
    convs = {c["id"]: c for c in load_conversations("sharegpt", limit=8, tokenizer=tiny_target.tokenizer,
                                                     max_prompt_tokens=cfg.data.max_prompt_tokens, log=lambda s: 0)}
    model = tiny_target.model
    for i in range(len(data)):
        it = data[i]
        ids, mask = it["input_ids"].long(), it["loss_mask"].bool()
        if i in prefilled:  # the dataset's own reply tokens, labelled with the target's argmax
            conv = convs[data.ids[i].removeprefix("prefill:")]
            expect = chat_with_replies(tiny_target.tokenizer, conv["messages"], cfg.teacher.max_turns,
                                       cfg.teacher.max_new_tokens)
            assert ids.tolist() == expect[0] and mask.tolist() == [bool(m) for m in expect[1]]
            with torch.no_grad():
                greedy = model(input_ids=ids[None]).logits[0].argmax(-1)  # row t predicts token t + 1
            assert torch.equal(it["targets"].long()[1:][mask[1:]], greedy[:-1][mask[1:]])
            assert torch.equal(it["targets"].long()[~mask], ids[~mask])
            assert not torch.equal(it["targets"].long()[mask], ids[mask])  # not the human tokens
        else:
            assert torch.equal(it["targets"].long(), ids)
    _, held = split_heldout(data.ids, 3)
    assert not set(held) & set(prefilled)
    item = data[prefilled[0]]
    b = pack_blocks([item], block_size=4, mask_token_id=0, anchors_per_sequence=None)
    pos = b["anchor_pos"][0][b["anchor_valid"][0]][:, None] + torch.arange(1, 4)
    labels = b["labels"][0][b["anchor_valid"][0]]
    inside = pos < len(item["input_ids"])
    assert torch.equal(labels[inside], item["targets"].long()[pos[inside]])


def test_prefill_of_a_prompt_only_source_is_one_line(tmp_path):
    with pytest.raises(DatasetError, match="no assistant replies to prefill .*teacher.mode=regenerate"):
        run_teacher(make_config("teacher.mode=prefill", "data.source=mtbench", "data.split=all"), tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_mixed_without_prefill_samples_is_one_line(tmp_path):
    with pytest.raises(DatasetError, match="teacher.mode=mixed prefills .*set teacher.prefill_samples > 0"):
        run_teacher(make_config("teacher.mode=mixed"), tmp_path / "t")
    assert not (tmp_path / "t").exists()


def test_merged_datasets_read_as_their_sources_and_hold_out_regenerated_samples(tiny_teacher, tmp_path):
    """scripts/merge_teacher.py: a regenerated and a prefilled dataset of disjoint prompts merge into one dataset
    (links, no copies) whose samples are the sources' own, held out from the regenerated ones first; the same
    dataset twice (shared ids) and datasets of other taps are refused with the fix."""
    from dflash_pipeline.data.blocks import pack_blocks
    from dflash_pipeline.data.shards import merge_datasets
    from dflash_pipeline.data.splits import split_heldout

    regen = TeacherDataset(tiny_teacher)
    prefilled = TeacherDataset(run_teacher(make_config("teacher.mode=prefill", f"data.skip={len(regen)}",
                                                       "data.num_samples=4"), tmp_path / "prefilled"))
    merged = TeacherDataset(merge_datasets([tiny_teacher, prefilled.folder], tmp_path / "merged"))  # verifies
    assert merged.ids == regen.ids + prefilled.ids and merged.manifest["num_prefilled"] == 4
    assert merged.num_tokens == regen.num_tokens + prefilled.num_tokens
    assert regen.teacher_seconds > 0
    assert merged.teacher_seconds == pytest.approx(regen.teacher_seconds + prefilled.teacher_seconds)
    for i, (src, j) in enumerate([(regen, k) for k in range(len(regen))] + [(prefilled, k) for k in range(4)]):
        a, b = merged[i], src[j]
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a if k != "id")
    _, held = split_heldout(merged.ids, len(regen))
    assert sorted(held) == list(range(len(regen)))  # every regenerated sample before any prefilled one
    batch = pack_blocks([merged[0], merged[len(regen)]], block_size=4, mask_token_id=0, anchors_per_sequence=4)
    assert batch["labels"].shape[0] == 2

    with pytest.raises(DatasetError, match="share sample ids .*disjoint"):
        merge_datasets([tiny_teacher, tiny_teacher], tmp_path / "twice")
    other = run_teacher(make_config("teacher.layer_ids=[0,1]", f"data.skip={len(regen) + 4}", "data.num_samples=2"),
                        tmp_path / "other_taps")
    with pytest.raises(DatasetError, match="differ in tapped layers"):
        merge_datasets([tiny_teacher, other], tmp_path / "taps")
    with pytest.raises(DatasetError, match="already holds a teacher dataset"):
        merge_datasets([tiny_teacher, prefilled.folder], tmp_path / "merged")


@pytest.mark.slow
def test_show_sample_renders_the_stored_turns_with_the_trained_tokens_marked(tiny_teacher):
    """scripts/show_sample.py, the README's template check: the sample as the tokenizer renders it, each span of
    the target's own reply tokens (the loss mask) between [[ and ]], nothing else marked."""
    from dflash_pipeline.data.shards import TeacherDataset
    from dflash_pipeline.models.target_sources import load_tokenizer

    from conftest import run_command

    cfg = make_config()
    item = TeacherDataset(tiny_teacher)[1]
    out = run_command(["python", "scripts/show_sample.py", "experiment=tiny", f"trainer.data_dir={tiny_teacher}",
                       "--index", "1"]).stdout
    ids, mask = item["input_ids"].tolist(), item["loss_mask"].tolist()
    assert f"{len(ids)} tokens, {sum(mask)} trained on" in out
    tokenizer = load_tokenizer(cfg.target, cfg.cache_dir)
    marked = [span.split("]]")[0] for span in out.split("[[")[1:]]
    replies, run = [], []
    for tok, m in zip(ids + [None], mask + [False]):
        if m:
            run.append(tok)
        elif run:
            replies.append(tokenizer.decode(run))
            run = []
    assert marked == replies and len(replies) == 2  # two regenerated turns
    assert "<|im_start|>user" in out.split("[[")[0]  # the template, unmarked


def test_fp8_scales_each_tap_apart_so_a_quiet_layer_keeps_its_digits():
    """Tapped layers differ in magnitude by orders; one scale per token would flush the quiet tap to zero."""
    g = torch.Generator().manual_seed(0)
    quiet, loud = torch.randn(6, 64, generator=g) * 1e-3, torch.randn(6, 64, generator=g) * 300
    x = torch.cat([quiet, loud], -1)
    values, scales = quantize_fp8(x, taps=2)
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (6, 2)
    back = dequantize_fp8(values, scales, torch.float32)
    for a, b in ((back[:, :64], quiet), (back[:, 64:], loud)):
        assert float((a - b).norm() / b.norm()) < 0.04  # e4m3: 3 mantissa bits
    assert float((dequantize_fp8(*quantize_fp8(x, taps=1), torch.float32)[:, :64] - quiet).norm() / quiet.norm()) > 0.5


def test_fp8_features_take_half_the_disk_and_read_back_as_the_bf16_ones(tiny_teacher, tmp_path):
    """teacher.feature_dtype=float8_e4m3: the same samples, features stored in e4m3 (half of bf16's bytes, plus a
    scale per token and tap), read as bf16 within e4m3's precision of the bf16 dataset; a drafter trains on them."""
    out = run_teacher(make_config("teacher.feature_dtype=float8_e4m3"), tmp_path / "fp8")
    bf16, fp8 = TeacherDataset(tiny_teacher), TeacherDataset(out)
    assert fp8.manifest["feature_dtype"] == "float8_e4m3" and fp8.ids == bf16.ids
    taps = len(fp8.layer_ids)
    for k in range(len(fp8.shards)):
        a = load_file(str(tiny_teacher / fp8.shards[k]["file"]))
        b = load_file(str(out / fp8.shards[k]["file"]))
        assert b["features"].dtype == torch.float8_e4m3fn and b["feature_scales"].shape == (len(b["input_ids"]), taps)
        assert b["features"].nbytes * 2 == a["features"].nbytes
    for i in range(len(fp8)):
        x, y = bf16[i], fp8[i]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        assert y["features"].dtype == torch.bfloat16 and "feature_scales" not in y
        err = (y["features"].float() - x["features"].float()).norm(dim=-1) / x["features"].float().norm(dim=-1)
        assert float(err.max()) < 0.05
    from dflash_pipeline.cli.entrypoints import run_stages

    done = run_stages(make_config(f"trainer.data_dir={out}", "trainer.steps=2", "logger=none"), tmp_path / "run",
                      ["train"])
    assert (done["train"] / "export" / "model.safetensors").is_file()


@pytest.mark.slow
def test_tokens_only_teacher_trains_exactly_as_online_training_on_stored_features(tiny_teacher, tmp_path):
    """teacher.feature_dtype=none: the same samples with no features on disk (a fraction of the bytes); training on
    it captures them from the target in the loop, the same weights as trainer.online=true on the stored dataset; a
    component on a frozen drafter and the eval's held-out set read it through the target too."""
    from dflash_pipeline.cli.entrypoints import run_stages

    out = run_teacher(make_config("teacher.feature_dtype=none"), tmp_path / "tokens")
    tokens, full = TeacherDataset(out), TeacherDataset(tiny_teacher)
    assert not tokens.has_features and full.has_features and tokens.ids == full.ids
    for k in range(len(tokens.shards)):
        assert "features" not in load_file(str(out / tokens.shards[k]["file"]))
        assert tokens.shards[k]["bytes"] * 4 < full.shards[k]["bytes"]
    for i in range(len(tokens)):
        assert torch.equal(tokens[i]["input_ids"], full[i]["input_ids"]) and "features" not in tokens[i]

    common = ("trainer.steps=2", "trainer.eval_every=2", "logger=none")
    a = run_stages(make_config(f"trainer.data_dir={out}", *common), tmp_path / "a", ["train"])["train"]
    b = run_stages(make_config(f"trainer.data_dir={tiny_teacher}", "trainer.online=true", *common), tmp_path / "b",
                   ["train"])["train"]
    wa, wb = (load_file(str(d / "export" / "model.safetensors")) for d in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(DatasetError, match="teacher.feature_dtype=none"):
        from dflash_pipeline.data.peers import peer_samples

        peer_samples(tokens, list(range(len(tokens))))

    done = run_stages(make_config(f"trainer.data_dir={out}", *common, "selector.steps=1", "eval.methods=[chain]",
                                  "eval.num_prompts=1", "pipeline.components=[selector]"), tmp_path / "a",
                      ["components", "eval"])
    results = json.loads((done["eval"] / "eval_results.json").read_text())
    assert results["offline"]["teacher_heldout"]["tau_offline"] >= 1.0

"""Training the drafter: blocks, labels, losses, the loop's resume and multi-process equality, export."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from hydra.errors import ConfigCompositionException
from safetensors.torch import load_file

from dflash_pipeline.data.blocks import pack_blocks
from dflash_pipeline.data.shards import DatasetError
from dflash_pipeline.models.drafter import DFlashDrafter
from dflash_pipeline.train.component import StageInputs
from dflash_pipeline.train.drafter import DrafterComponent
from dflash_pipeline.train.errors import TrainError
from dflash_pipeline.train.loop import run_train
from dflash_pipeline.train.losses import block_loss, dpace_weights, normaliser

from conftest import ROOT, accelerate_launch, make_config, metrics, run_command


def losses(run: Path) -> list[float]:
    return [row["loss"] for row in metrics(run)]


def test_blocks_labels_are_the_tokens_at_anchor_plus_k():
    ids = torch.arange(100, 112)
    mask = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1], dtype=torch.bool)
    item = {"input_ids": ids, "loss_mask": mask, "features": torch.zeros(12, 2)}
    b = pack_blocks([item], block_size=4, mask_token_id=7, anchors_per_sequence=None)
    anchors = b["anchor_pos"][0].tolist()
    assert anchors == list(range(3, 11))  # the next token is a reply token; the last token has nothing to predict
    for j, a in enumerate(anchors):
        assert b["block_ids"][0, j].tolist() == [100 + a, 7, 7, 7]
        for k in range(1, 4):
            inside = a + k < 12
            assert bool(b["label_valid"][0, j, k - 1]) == inside
            if inside:
                assert int(b["labels"][0, j, k - 1]) == 100 + a + k


def test_dpace_weights_match_hand_computation():
    q = torch.tensor([[0.5, 0.25, 1.0]])
    # s = 0.5 q + 0.5 = [.75, .625, 1]; P = [.75, .46875, .46875]; w_k = sum_{j>=k} P_j
    w = dpace_weights(q, torch.tensor([[True, True, True]]), alpha=0.5)
    torch.testing.assert_close(w, torch.tensor([[1.6875, 0.9375, 0.46875]]))
    w = dpace_weights(q, torch.tensor([[True, True, False]]), alpha=0.5)
    torch.testing.assert_close(w, torch.tensor([[1.21875, 0.46875, 0.0]]))


def test_dpace_label_outside_the_draft_vocabulary_has_q_zero():
    """Such a label carries no loss, but the path through it cannot survive: s = alpha there (q = 0), so every
    later position's weight drops by alpha (it used to be s = 1, over-weighting them)."""
    logits = torch.zeros(1, 3, 4)  # uniform: q = 1/4 where the label is in the vocabulary
    labels, valid = torch.tensor([[0, -1, 2]]), torch.tensor([[True, True, True]])
    # s = [0.625, 0.5, 0.625]; P = [0.625, 0.3125, 0.1953125]; mask [1, 0, 1]: w = [0.8203125, 0.1953125, 0.1953125]
    ce = torch.log(torch.tensor(4.0))
    total = block_loss(logits, labels, valid, kind="dpace", gamma=1.0, alpha=0.5)
    torch.testing.assert_close(total, ce * (0.8203125 + 0.1953125))


def test_frozen_components_weight_positions_as_the_drafter_was_trained():
    """A selector / jump head on a D-PACE drafter takes the drafter's D-PACE weights of each block (from its own q of
    the true tokens), not decay weights."""
    from dflash_pipeline.train.frozen import FrozenDrafterComponent
    from dflash_pipeline.train.losses import decay_weights

    comp = FrozenDrafterComponent.__new__(FrozenDrafterComponent)
    comp.decay = decay_weights(3, 4.0)
    batch = {"valid": torch.tensor([[True, True, True], [True, True, False]]),
             "label_q": torch.tensor([[0.5, 0.25, 1.0], [0.0, 0.9, 0.2]])}
    comp.cfg = make_config("trainer.loss=dpace")
    torch.testing.assert_close(comp.position_weights(batch), dpace_weights(batch["label_q"], batch["valid"], 0.5))
    comp.cfg = make_config("trainer.loss=decay")
    torch.testing.assert_close(comp.position_weights(batch), comp.decay.expand(2, -1))


def test_decay_loss_is_a_weighted_mean():
    logits = torch.zeros(1, 3, 5)
    labels, valid = torch.tensor([[0, 1, 2]]), torch.tensor([[True, True, False]])
    total = block_loss(logits, labels, valid, kind="decay", gamma=1.0)
    norm = normaliser("decay", valid, 1.0)
    torch.testing.assert_close(total / norm, torch.log(torch.tensor(5.0)))


@pytest.fixture(scope="module")
def component(tiny_teacher):
    torch.manual_seed(0)
    return DrafterComponent(make_config(), StageInputs(tiny_teacher), torch.device("cpu"))


def _train_on(comp, batch, steps, lr=3e-3, **shape):
    model = DFlashDrafter(dataclasses.replace(comp.dconf, **shape), comp.model.embed_tokens, comp.model.lm_head)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    out = []
    for _ in range(steps):
        loss_sum, stats = comp.loss(model, batch)
        (loss_sum / comp.normaliser(batch)).backward()
        opt.step()
        opt.zero_grad()
        c, v = stats["correct"], stats["valid"]
        out.append((float(loss_sum.detach() / comp.normaliser(batch)), float((c & v).sum() / v.sum())))
    return out


def test_loss_decreases_on_a_fixed_batch(component):
    batch = component.batch(component.train_idx[:2], step=0)
    curve = _train_on(component, batch, 30, lr=1e-2)
    assert curve[-1][0] < 0.85 * curve[0][0]


def test_label_alignment_with_a_perfect_shortcut(component):
    """Feed the answer at block position k as its input: a drafter without layers (each position sees only its own
    input, through the residual stream) predicts it only if the labels sit at anchor + k."""
    g = torch.Generator().manual_seed(0)
    width = len(component.data.layer_ids) * component.data.hidden_size
    items = [{"input_ids": torch.randperm(40000, generator=g)[:60] + 100,  # distinct tokens: no lucky repeats
              "loss_mask": torch.arange(60) >= 20, "features": torch.randn(60, width, generator=g)} for _ in range(2)]
    batch = pack_blocks(items, block_size=component.block_size, mask_token_id=component.dconf.mask_token_id,
                        anchors_per_sequence=None)
    for b, it in enumerate(items):
        for j, a in enumerate(batch["anchor_pos"][b].tolist()):
            for k in range(1, component.block_size):
                if a + k < 60:
                    batch["block_ids"][b, j, k] = it["input_ids"][a + k]  # the shortcut: the answer in the input
    aligned = _train_on(component, batch, 5, num_hidden_layers=0)[-1][1]
    shifted = dict(batch, labels=batch["labels"].roll(1, dims=-1))  # off by one position
    misaligned = _train_on(component, shifted, 5, num_hidden_layers=0)[-1][1]
    assert aligned > 0.95 and misaligned < 0.1


@pytest.mark.parametrize("overrides", [
    (), ("trainer.loss=dpace",), ("trainer.loss=kl",),
    ("trainer.loss=dpace", "trainer.selector_loss_weight=1.0", "trainer.draft_vocab_size=50", "selector.top_k=8",
     "selector.rank=8"),
], ids=["decay", "dpace", "kl", "dpace-joint-selector-draft-vocab"])
def test_memory_savers_give_the_whole_logits_loss_and_gradients(tiny_teacher, overrides):
    """Logits and losses one block at a time, the packed mask one block's rows at a time and per-layer activation
    checkpointing (each recomputed in the backward) give today's loss, stats and gradients at float32 tolerance."""
    torch.manual_seed(0)
    comp = DrafterComponent(make_config(*overrides), StageInputs(tiny_teacher), torch.device("cpu"))
    drafter = comp.model.drafter if hasattr(comp.model, "drafter") else comp.model
    batch = comp.batch(comp.step_items(0), 0)
    assert int(batch["anchor_valid"].sum()) > 2

    def step(sliced: bool):
        comp.cfg.trainer.logits_chunk_mb = 1e-9 if sliced else 0.0  # one block per slice, or all at once
        drafter.config.attention_chunk_mb = 1e-9 if sliced else 0.0
        drafter.activation_checkpointing = sliced
        comp.model.zero_grad()
        loss, stats = comp.loss(comp.model, batch)
        loss.backward()
        return loss.detach(), stats, {n: p.grad.clone() for n, p in comp.model.named_parameters() if p.grad is not None}

    comp.cfg.trainer.logits_chunk_mb = 1e-9
    assert len(comp.loss_slices(int(batch["anchor_valid"].sum()), comp.block_size - 1)) > 2
    (whole, whole_stats, whole_grads), (sliced, sliced_stats, sliced_grads) = step(False), step(True)
    torch.testing.assert_close(sliced, whole, rtol=1e-5, atol=1e-5)
    assert whole_stats.keys() == sliced_stats.keys()
    for k in whole_stats:
        assert torch.equal(sliced_stats[k], whole_stats[k]), k
    assert whole_grads.keys() == sliced_grads.keys() and len(whole_grads) > 5
    for n, want in whole_grads.items():  # float32 sums in another order: equal to a millionth of the largest entry
        assert (sliced_grads[n] - want).abs().max() <= 1e-5 * want.abs().max(), n


def test_token_budget_steps_take_sequences_to_the_budget_and_cut_even_micro_batches():
    from dflash_pipeline.data.splits import TokenBudgetSteps, split_points, step_batch

    lengths = {i: 100 * (1 + i % 7) for i in range(40)}  # 100 .. 700 tokens
    train = list(range(40))
    steps = TokenBudgetSteps(train, lengths.__getitem__, seed=3, budget=1500, most=16)
    batches = [steps(s) for s in range(30)]
    for b in batches:
        tokens = sum(lengths[i] for i in b)
        assert 2 <= len(b) <= 16 and 1500 <= tokens < 1500 + 700  # stops at the first sequence that reaches it
        assert [lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True)  # longest first
    # the same stream of sequences as the fixed-count batches (epoch permutations), only cut by tokens
    flat = [i for b in batches for i in b]
    assert sorted(flat) == sorted(step_batch(train, 0, len(flat), 3))
    assert TokenBudgetSteps(train, lengths.__getitem__, 3, 1500, 16)(17) == batches[17]  # resumable
    # one sequence longer than the budget is a step alone, whatever the process count
    assert len(TokenBudgetSteps(train, lambda i: 10**6, 3, 1500, 16)(0)) == 1

    assert split_points([1] * 8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]  # equal counts: the fixed-count split
    runs = split_points([700, 600, 500, 300, 200, 100, 100], 2)
    assert runs == [(0, 2), (2, 7)]  # 1300 and 1200 tokens
    # fewer sequences than micro-batches: one each to the first, the rest empty
    assert split_points([3, 2, 1], 4) == [(0, 1), (1, 2), (2, 3), (3, 3)]
    assert split_points([5], 2) == [(0, 1), (1, 1)]


def test_token_budget_steps_do_not_depend_on_the_process_count(tiny_teacher):
    """A step of trainer.tokens_per_step is a function of (seed, step): the component never sees the process count,
    and the loop cuts the same global batch into any number of micro-batches (some empty when it holds fewer
    sequences), so the union of every process's runs is the step."""
    import inspect

    from dflash_pipeline.data.splits import split_points

    from dflash_pipeline.data.shards import TeacherDataset

    data = TeacherDataset(tiny_teacher)
    budget = sorted(data.length(i) for i in range(len(data.ids)))[len(data.ids) // 2]  # the median sequence's tokens
    comp = DrafterComponent(make_config(f"trainer.tokens_per_step={budget}", "trainer.batch_sequences=8"),
                            StageInputs(tiny_teacher), torch.device("cpu"))
    assert list(inspect.signature(comp.step_items).parameters) == ["step"]
    steps = [comp.step_items(s) for s in range(6)]
    assert any(len(b) == 1 for b in steps) and any(len(b) > 1 for b in steps)  # some sequences exceed the budget
    for items in steps:
        for parts in (1, 2, 8):
            runs = split_points(comp.item_sizes(items), parts)
            assert len(runs) == parts and [i for a, b in runs for i in items[a:b]] == items


# the settings that change memory and speed, not the weights (runtime/stages.py IGNORED, TRAINING_RUNTIME)
RUNTIME_CHANGES = ("trainer.logits_chunk_mb=0.001", "trainer.activation_checkpointing=true",
                   "drafter.attention_chunk_mb=0.001", "drafter.attn_implementation=eager", "trainer.eval_every=3",
                   "trainer.keep_checkpoints=3", "trainer.log_every=1")


def test_memory_and_speed_settings_leave_every_stage_hash_as_it_is():
    from dflash_pipeline.runtime.stages import config_hash

    base = make_config()
    for change in RUNTIME_CHANGES:
        changed = make_config(change)
        for stage in ("train", "train/selector", "train/weaver"):
            assert config_hash(changed, stage) == config_hash(base, stage), (change, stage)
    # what does change the weights still changes the hash
    assert config_hash(make_config("trainer.lr=1e-3"), "train") != config_hash(base, "train")


def test_rerun_of_a_killed_run_resumes_and_repeats_the_losses_of_an_uninterrupted_run(tiny_teacher, tmp_path, monkeypatch):
    """A killed run started again goes on from its checkpoint to the uninterrupted run's losses and weights, with its
    memory and speed settings changed (the user who lowers trainer.logits_chunk_mb after running out of memory); a
    restart with another config is refused in one line naming the key, and its checkpoints are kept."""
    cfg = make_config("trainer.steps=4", "trainer.save_every=2")
    full = run_train(cfg, tmp_path / "full", data_dir=tiny_teacher)
    real_batch = DrafterComponent.batch

    def crash_at_step_3(self, indices, step, slot0=0):
        if step == 3:
            raise KeyboardInterrupt("simulated kill")
        return real_batch(self, indices, step, slot0)

    monkeypatch.setattr(DrafterComponent, "batch", crash_at_step_3)
    with pytest.raises(KeyboardInterrupt):
        run_train(cfg, tmp_path / "killed", data_dir=tiny_teacher)
    monkeypatch.setattr(DrafterComponent, "batch", real_batch)
    kept = sorted((tmp_path / "killed" / "checkpoints").iterdir())
    assert [p.name for p in kept] == ["step-0000002"]
    with pytest.raises(TrainError, match=r"checkpoints \(to step 2\) of another config \(trainer.lr: 0.0006 -> 0.001\)"
                                         r".*trainer.resume=true"):
        run_train(make_config("trainer.steps=4", "trainer.save_every=2", "trainer.lr=1e-3"), tmp_path / "killed",
                  data_dir=tiny_teacher)
    assert sorted((tmp_path / "killed" / "checkpoints").iterdir()) == kept  # nothing removed
    restarted = make_config("trainer.steps=4", "trainer.save_every=2", *RUNTIME_CHANGES)
    resumed = run_train(restarted, tmp_path / "killed", data_dir=tiny_teacher)  # the same run, lower memory
    assert [m["step"] for m in metrics(resumed) if "loss" in m][:2] == [1, 2]  # steps 1-2 from before the kill
    assert len(losses(resumed)) == 4
    assert losses(resumed) == pytest.approx(losses(full), rel=1e-5)
    ours, theirs = (load_file(str(r / "export" / "model.safetensors")) for r in (resumed, full))
    assert ours.keys() == theirs.keys()
    for k in ours:  # float32 sums in another order (sliced logits, eager attention): equal to float32 noise
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-4, atol=1e-5)


def test_export_reloads_to_the_same_drafter(tiny_teacher, tmp_path, component):
    run = run_train(make_config("trainer.steps=2"), tmp_path / "run", data_dir=tiny_teacher)
    last = metrics(run)[-1]
    model = DFlashDrafter.from_pretrained(str(run / "export"), component.model.embed_tokens, component.model.lm_head)
    assert component.evaluate(model) == last["heldout"]
    config = json.loads((run / "export" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]  # experiment=tiny trains DFlash2's convolution
    assert config["dflash_config"]["conv_kernel_size"] == model.config.conv_kernel_size == 3
    assert config["dflash_pipeline"]["target_layer_ids"] == config["dflash_config"]["target_layer_ids"]


@pytest.mark.slow
def test_dflash2_fine_tune_starts_from_the_trained_dflash_drafter(tiny_teacher, tmp_path):
    """drafter.init_from: a convolution drafter started from a DFlash drafter's export is that drafter (the same
    held-out metrics before its first step), then trains its convolution; an export of another shape is refused."""
    plain = run_train(make_config("trainer.steps=3", "drafter.conv_kernel_size=0"), tmp_path / "plain",
                      data_dir=tiny_teacher)
    cfg = make_config("trainer.steps=3", f"drafter.init_from={plain / 'export'}")
    comp = DrafterComponent(cfg, StageInputs(tiny_teacher), torch.device("cpu"))
    assert comp.model.config.conv_kernel_size == 3
    assert comp.evaluate(comp.model) == metrics(plain)[-1]["heldout"]
    run = run_train(cfg, tmp_path / "conv", data_dir=tiny_teacher)
    tuned = load_file(str(run / "export" / "model.safetensors"))
    assert not torch.equal(tuned["layers.0.attention_conv.kernel_projection.weight"],
                           torch.zeros_like(tuned["layers.0.attention_conv.kernel_projection.weight"]))
    with pytest.raises(TrainError, match="drafter.init_from=.*layers"):
        DrafterComponent(make_config("drafter.num_layers=2", f"drafter.init_from={plain / 'export'}"),
                         StageInputs(tiny_teacher), torch.device("cpu"))
    with pytest.raises(TrainError, match="no model.safetensors"):
        DrafterComponent(make_config(f"drafter.init_from={tmp_path}"), StageInputs(tiny_teacher), torch.device("cpu"))


def test_draft_vocabulary_head(tiny_teacher, tmp_path):
    run = run_train(make_config("trainer.steps=2", "trainer.draft_vocab_size=50"), tmp_path / "run",
                    data_dir=tiny_teacher)
    config = json.loads((run / "export" / "config.json").read_text())
    assert config["draft_vocab_size"] == 50
    assert set(load_file(str(run / "export" / "model.safetensors"))) >= {"d2t", "lm_head.weight"}


@pytest.mark.parametrize("loss", ["dpace", "kl"])
def test_other_losses_train(tiny_teacher, tmp_path, loss):
    run = run_train(make_config("trainer.steps=2", f"trainer.loss={loss}"), tmp_path / "run", data_dir=tiny_teacher)
    assert all(torch.isfinite(torch.tensor(losses(run))))


def test_wrong_component_and_mismatched_dataset_fail_clearly(tiny_teacher, tmp_path):
    with pytest.raises(ConfigCompositionException, match="trainer.component=selectr"):
        make_config("trainer.component=selectr")
    with pytest.raises(DatasetError, match="hidden size 64.*hidden size 32"):
        run_train(make_config("target.tiny.hidden_size=32", "target.tiny.intermediate_size=64"), tmp_path / "b",
                  data_dir=tiny_teacher)


@pytest.mark.slow
def test_two_processes_follow_the_one_process_loss_curve(tiny_teacher, tmp_path):
    """accelerate launch with 2 CPU processes (gloo) and the same global batch gives the same losses, and a
    1-process run resumed on 2 processes continues that curve. With a token budget (trainer.tokens_per_step) of
    the median sequence, some steps hold one sequence (the second process's micro-batch is empty): a run of 2
    processes resumed on 1 takes the same steps to the same losses and weights as 1 process throughout."""
    from dflash_pipeline.data.shards import TeacherDataset

    def launch(n: int, run_dir: Path, *extra: str):
        run_command(accelerate_launch(n, "-m", "dflash_pipeline.train", "experiment=tiny", f"hydra.run.dir={run_dir}",
                                      f"trainer.data_dir={tiny_teacher}", "trainer.eval_every=100",
                                      "trainer.save_every=2", *extra), timeout=300)
        return losses(run_dir / "train")

    one = launch(1, tmp_path / "one", "trainer.steps=4")
    two = launch(2, tmp_path / "two", "trainer.steps=4")
    assert len(one) == len(two) == 4
    assert two == pytest.approx(one, rel=1e-4)

    data = TeacherDataset(tiny_teacher)
    budget = f"trainer.tokens_per_step={sorted(data.length(i) for i in range(len(data.ids)))[len(data.ids) // 2]}"
    one_budget = launch(1, tmp_path / "budget", "trainer.steps=4", budget)
    launch(2, tmp_path / "switch", "trainer.steps=2", budget)
    switched = launch(1, tmp_path / "switch", "trainer.steps=4", "trainer.resume=true", budget)
    assert len(switched) == 4 and switched == pytest.approx(one_budget, rel=1e-4)
    ours, theirs = (load_file(str(tmp_path / r / "train" / "export" / "model.safetensors")) for r in ("switch", "budget"))
    for k in theirs:
        torch.testing.assert_close(ours[k], theirs[k], rtol=1e-4, atol=1e-5)


def test_training_subsets_are_nested_and_share_the_heldout_split(tiny_teacher):
    from dflash_pipeline.data.splits import split_heldout

    ids = [f"sample-{i}" for i in range(50)]
    full, held = split_heldout(ids, 5)
    small, held_small = split_heldout(ids, 5, 10)
    mid, held_mid = split_heldout(ids, 5, 20)
    assert held == held_small == held_mid and len(full) == 45
    assert len(small) == 10 and len(mid) == 20 and set(small) < set(mid) < set(full)
    comp = DrafterComponent(make_config("trainer.train_samples=3"), StageInputs(tiny_teacher), torch.device("cpu"))
    assert len(comp.train_idx) == 3 and comp.heldout_idx == split_heldout(comp.data.ids, 2)[1]


def test_feature_noise_is_seeded_per_step_and_scaled_to_the_features(tiny_teacher):
    noisy = DrafterComponent(make_config("trainer.feature_noise=0.1"), StageInputs(tiny_teacher), torch.device("cpu"))
    clean = DrafterComponent(make_config(), StageInputs(tiny_teacher), torch.device("cpu"))
    idx = noisy.train_idx[:2]
    a, b, c = noisy.batch(idx, step=3), noisy.batch(idx, step=3), clean.batch(idx, step=3)
    assert torch.equal(a["features"], b["features"]), "the same step draws the same noise (resumable)"
    assert not torch.equal(a["features"], noisy.batch(idx, step=4)["features"])
    diff = (a["features"].float() - c["features"].float())[c["context_valid"]]
    rms = c["features"].float()[c["context_valid"]].pow(2).mean(-1).sqrt()
    ratio = diff.pow(2).mean(-1).sqrt() / rms
    assert 0.07 < float(ratio.median()) < 0.13, "noise of 0.1 x each feature vector's RMS"


def test_weight_tied_depth_trains_and_exports_unrolled(tiny_teacher, tmp_path):
    """drafter.layer_repeats=2 (DFlash2's same layers applied twice): one layer of parameters trains, the export is
    a two-layer drafter whose layers are the same weights, which the eval stage loads like any other."""
    cfg = make_config("drafter.layer_repeats=2", "trainer.steps=2")
    comp = DrafterComponent(cfg, StageInputs(tiny_teacher), torch.device("cpu"))
    assert len(comp.model.layers) == 1 and comp.model.layer_order() == [0, 0]
    run = run_train(cfg, tmp_path / "run", data_dir=tiny_teacher)
    drafter = DFlashDrafter.from_pretrained(str(run / "export"), comp.target.model.get_input_embeddings(),
                                            comp.target.model.get_output_embeddings())
    assert len(drafter.layers) == 2
    for a, b in zip(drafter.layers[0].parameters(), drafter.layers[1].parameters()):
        assert torch.equal(a, b)


def test_dflash2_joint_training_trains_the_selector_with_the_drafter(tiny_teacher, tmp_path):
    """trainer.selector_loss_weight > 0 (DFlash2 joint): the selector's loss also reaches the drafter, one run
    exports the drafter and, where the eval stage's selector methods look, the DFlash2 checkpoint carrying that very
    drafter; the selector's settings enter the drafter stage's hash, and a frozen-drafter selector stage on top is
    refused with the fix."""
    from dflash_pipeline.cli.entrypoints import run_stages
    from dflash_pipeline.conf.schema import ConfigError
    from dflash_pipeline.runtime.stages import stage_sections
    from dflash_pipeline.eval.methods import drafter_difference
    from dflash_pipeline.eval.components import load_selector

    cfg = make_config("trainer.steps=3", "trainer.selector_loss_weight=1.0", "trainer.draft_vocab_size=50",
                      "selector.top_k=48", "selector.rank=8")
    comp = DrafterComponent(cfg, StageInputs(tiny_teacher), torch.device("cpu"))
    batch = comp.batch(comp.step_items(0), 0)

    def grads(weight: float) -> list[torch.Tensor]:
        comp.selector_weight = weight
        comp.model.zero_grad()
        loss, stats = comp.loss(comp.model, batch)
        loss.backward()
        assert weight == 0 or int(stats["selector_scored"]) > 0
        return [p.grad.clone() for p in comp.model.drafter.layers.parameters()]

    assert any(not torch.allclose(a, b) for a, b in zip(grads(1.0), grads(0.0)))
    assert comp.model.selector.successor_codebook.grad is None  # weight 0: the selector takes no part
    assert "selector" in stage_sections(cfg, "train") and "selector" not in stage_sections(make_config(), "train")

    run = run_train(cfg, tmp_path / "run", data_dir=tiny_teacher)
    last = metrics(run)[-1]
    assert 0 < last["candidate_recall"] <= 1 and "selector_tau_offline" in last["heldout"]
    drafter = DFlashDrafter.from_pretrained(str(run / "export"), comp.target.model.get_input_embeddings(),
                                            comp.target.model.get_output_embeddings())
    assert drafter_difference(run / "selector" / "export", run / "export") is None
    selector = load_selector(run / "selector" / "export", torch.device("cpu"))
    assert selector.top_k == 48 and selector.rank == 8 and selector.successor_codebook.abs().sum() > 0
    assert drafter.config.block_size == comp.block_size

    with pytest.raises(ConfigError, match="drop selector from pipeline.components"):
        run_stages(make_config("trainer.selector_loss_weight=1.0", "pipeline.components=[selector]"), tmp_path / "p",
                   ["components"])


@pytest.mark.slow
def test_fsdp_on_two_processes_follows_one_process_resumes_on_another_count_and_exports_its_weights(tiny_teacher,
                                                                                                    tmp_path):
    """An FSDP launch (accelerate's --use_fsdp, which a CPU launch runs as gloo processes: train/parallel.py shards
    the drafter itself): the losses and held-out metrics of 1 process; its full-state checkpoint resumes on 1 process
    and continues the curve; the export holds exactly the checkpoint's weights, unsharded, as a 1-process export."""
    def launch(n: int, run_dir: Path, *extra: str, fsdp: bool = True):
        args = ["-m", "dflash_pipeline.train", "experiment=tiny", f"hydra.run.dir={run_dir}",
                f"trainer.data_dir={tiny_teacher}", "trainer.eval_every=2", "trainer.save_every=2", *extra]
        fsdp_config = ROOT / "scripts" / "accelerate" / "cpu_2proc_fsdp.yaml"  # the documented CPU FSDP launch
        run_command(accelerate_launch(n, *args, config_file=fsdp_config if fsdp else None), timeout=300)
        return metrics(run_dir / "train")

    one = launch(1, tmp_path / "one", "trainer.steps=4", fsdp=False)
    two = launch(2, tmp_path / "two", "trainer.steps=4")
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], rel=1e-4)
    for a, b in zip(one, two):
        if "heldout" in a:
            assert b["heldout"]["a_k"] == pytest.approx(a["heldout"]["a_k"], abs=1e-6)
    ckpt = tmp_path / "two" / "train" / "checkpoints" / "step-0000004"
    assert {p.name for p in ckpt.iterdir()} == {"model.safetensors", "optimizer.safetensors", "optimizer.json",
                                               "scheduler.json", "step.json"}  # safetensors + JSON: no pickle
    export = load_file(str(tmp_path / "two" / "train" / "export" / "model.safetensors"))
    export = {k: v for k, v in export.items() if not k.startswith("candidate_selector.")}  # DFlash2's pass-through
    state = load_file(str(ckpt / "model.safetensors"))
    assert set(export) == set(state) and all(torch.equal(export[k], state[k]) for k in export)
    launch(2, tmp_path / "switch", "trainer.steps=2")  # killed after step 2 (a shorter run), resumed on 1 process
    switched = launch(1, tmp_path / "switch", "trainer.steps=4", "trainer.resume=true")
    assert [r["loss"] for r in switched] == pytest.approx([r["loss"] for r in one], rel=1e-4)

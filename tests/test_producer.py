"""Features from an engine: the teacher's vLLM capture (teacher.capture=engine) and the drafter trained from a
feature producer's spool (trainer.features=producer, data/producer.py, data/spool.py) with no target body in the
trainer: the same dataset and the same weights as with stored features, across kills of either process."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, accelerate_launch, make_config, run_command, user_env
from dflash_pipeline.data.shards import DatasetError, TeacherDataset
from dflash_pipeline.data.spool import Spool, SpoolError
from dflash_pipeline.data.teacher import check_engine, run_teacher
from dflash_pipeline.train.loop import run_train
from test_served import needs_vllm

# float32 features everywhere, so that stored and spooled features differ by float rounding at most
EXACT = ["teacher.topk_logprobs=0", "teacher.feature_dtype=float32", "teacher.capture=separate", "trainer.steps=6",
         "trainer.save_every=2", "trainer.eval_every=3", "producer.dtype=float32",
         "trainer.tokens_per_step=null"]  # a producer spools steps of batch_sequences


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    return run_teacher(make_config(*EXACT), tmp_path_factory.mktemp("producer") / "teacher")


@pytest.fixture(scope="module")
def stored(teacher) -> dict:
    """The drafter trained on the stored features: what every producer-fed run must equal."""
    out = run_train(make_config(*EXACT), teacher.parent / "stored" / "train", teacher)
    return weights(out)


def weights(train_dir: Path) -> dict:
    return load_file(train_dir / "export" / "model.safetensors")


def assert_same_weights(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst <= atol, f"weights differ by {worst}"


@pytest.mark.slow
def test_producer_fed_training_equals_stored_features(teacher, stored):
    """The trainer starts the producer itself (producer.launch=true, transformers features), reads every step from
    the spool, and ends with the stored-feature run's weights; the spool keeps no step files after the run."""
    out = run_train(make_config(*EXACT, "trainer.features=producer", "producer.engine=hf"),
                    teacher.parent / "fed" / "train", teacher)
    assert_same_weights(stored, weights(out), atol=1e-6)
    spool = teacher.parent / "fed" / "spool"
    assert json.loads((spool / "committed.json").read_text())["step"] == 6
    assert not list(spool.glob("step-*.safetensors")) and (spool / "heldout.safetensors").is_file()
    assert json.loads((spool / "producer.json").read_text())["done"]


@pytest.mark.slow
def test_producer_fed_trainer_holds_no_target_body(teacher):
    """Fed by a producer, the drafter stage loads the target's embeddings and head only, shared by the drafter."""
    from dflash_pipeline.train.component import StageInputs
    from dflash_pipeline.train.drafter import DrafterComponent

    cfg = make_config(*EXACT, "trainer.features=producer", "producer.launch=false")
    comp = DrafterComponent(cfg, StageInputs(teacher, run_dir=teacher.parent / "nobody"), torch.device("cpu"))
    target = comp.target.model
    assert type(target).__name__ == "TargetHead"
    assert {n for n, _ in target.named_parameters()} == {"embed_tokens.weight"}  # the tiny target's head is tied
    assert comp.model.embed_tokens is target.get_input_embeddings()


@pytest.mark.slow
def test_producer_settings_that_cannot_work_are_refused_in_one_line(teacher):
    from dflash_pipeline.train.errors import TrainError

    with pytest.raises(TrainError, match="drop trainer.online"):
        run_train(make_config(*EXACT, "trainer.features=producer", "trainer.online=true"),
                  teacher.parent / "refused" / "train", teacher)
    with pytest.raises(DatasetError, match="set trainer.tokens_per_step=null"):
        run_train(make_config(*EXACT, "trainer.features=producer", "trainer.tokens_per_step=256"),
                  teacher.parent / "budget" / "train", teacher)
    with pytest.raises(DatasetError, match="set teacher.engine=vllm"):
        check_engine(make_config("teacher.capture=engine"))
    with pytest.raises(DatasetError, match="use teacher.capture=separate"):
        check_engine(make_config("teacher.capture=engine", "teacher.engine=vllm", "teacher.topk_logprobs=4"))
    from dflash_pipeline.models.vllm_engine import VLLMError, check_capture_layers

    check_capture_layers([1, 3], 6)
    with pytest.raises(VLLMError, match="include the last layer \\(5\\), whose state vLLM captures before the final"):
        check_capture_layers([1, 5], 6)  # vLLM's last state is the layer's output before the norm


def test_spool_refuses_other_runs_and_says_who_is_missing(tmp_path):
    key = {"seed": 0, "steps": 4}
    spool = Spool(tmp_path, key, wait_s=0.3)
    with pytest.raises(SpoolError, match=r"another run \(seed: 0 -> 1\)"):
        Spool(tmp_path, {"seed": 1, "steps": 4}, wait_s=0.3)
    spool.write(spool.step_file(0), [5, 9], [torch.ones(3, 2), torch.zeros(4, 2)])
    assert [f.shape[0] for f in spool.read(spool.step_file(0), [1], [9])] == [4]  # a rank reads its own slots
    with pytest.raises(SpoolError, match="holds samples \\[5\\], this trainer expects \\[7\\]"):
        spool.read(spool.step_file(0), [0], [7])
    with pytest.raises(SpoolError, match="no word from a producer .* start `dflash-producer`"):
        spool.read(spool.step_file(1), [0], [5])
    # backpressure: with no reader the producer writes `capacity` steps from the last checkpoint's, no more
    assert spool.wait_for_room(capacity=2, steps=4) == 1
    spool.write(spool.step_file(1), [1, 2], [torch.ones(1, 2), torch.ones(1, 2)])
    with pytest.raises(SpoolError, match="no trainer has read"):
        spool.wait_for_room(capacity=2, steps=4)
    spool.mark_read(0, 1), spool.mark_read(1, 3)
    assert spool.wait_for_room(capacity=2, steps=4) == 2  # the slowest rank (0, at step 1) allows steps 1 and 2
    assert not spool.step_file(0).exists()  # read past by every rank: deleted
    spool.mark_read(0, 0)  # a trainer resumed from its checkpoint at step 0: the producer goes back
    assert spool.wait_for_room(capacity=2, steps=4) == 0
    spool.commit(4)
    assert spool.wait_for_room(capacity=2, steps=4) is None  # the trainer's last checkpoint is the last step: done


def _start(cmd: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=user_env(), stdout=open(log, "ab"), stderr=subprocess.STDOUT)


def _wait_until(what, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    start = time.monotonic()
    while not what():
        assert proc.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() - start < timeout, f"timed out; {log.read_text()[-2000:]}"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=needs_vllm)])
def test_killed_producer_and_killed_trainer_resume_to_the_same_weights(teacher, stored, tmp_path, engine):
    """An external producer (dflash-producer) is killed while it waits for room and started again; then the trainer
    (dflash-train, producer.launch=false) is killed after a checkpoint and started again. Both go on where they
    were, and the weights equal the stored-feature run's."""
    run = tmp_path / "run"
    common = ["experiment=tiny", *EXACT, f"hydra.run.dir={run}", f"trainer.data_dir={teacher}",
              "trainer.features=producer", f"producer.engine={engine}", "producer.launch=false", "producer.capacity=2"]
    spool, log = run / "spool", tmp_path / "log.txt"
    producer = _start(["dflash-producer", *common], log)
    _wait_until(lambda: (spool / "step-0000001.safetensors").is_file(), producer, log)
    time.sleep(0.5)
    assert not (spool / "step-0000002.safetensors").exists()  # backpressure: no trainer has read yet
    producer.send_signal(signal.SIGKILL), producer.wait()
    producer = _start(["dflash-producer", *common], log)
    trainer = _start(["dflash-train", *common, "trainer.save_every=2"], log)
    _wait_until(lambda: (spool / "committed.json").is_file(), trainer, log)
    trainer.send_signal(signal.SIGKILL), trainer.wait()
    assert json.loads((spool / "committed.json").read_text())["step"] < 6
    run_command(["dflash-train", *common, "trainer.save_every=2"], timeout=600)
    assert producer.wait(timeout=300) == 0, log.read_text()[-3000:]
    assert "resumed from" in (run / "dflash-train.log").read_text()
    assert_same_weights(stored, weights(run / "train"), atol=1e-6 if engine == "hf" else 1e-5)


@pytest.mark.slow
def test_two_trainer_ranks_read_disjoint_slots_of_one_spool(teacher, stored, tmp_path):
    """Two gloo processes fed by one producer each read their half of every step and train the weights of one
    process on stored features."""
    run = tmp_path / "run"
    run_command(accelerate_launch(2, "-m", "dflash_pipeline.train", "experiment=tiny", *EXACT,
                                  f"hydra.run.dir={run}", f"trainer.data_dir={teacher}", "trainer.features=producer",
                                  "producer.engine=hf"), timeout=900)
    assert_same_weights(stored, weights(run / "train"), atol=1e-5)
    marks = {p.name: json.loads(p.read_text())["step"] for p in (run / "spool").glob("read-*.json")}
    assert marks == {"read-0.json": 5, "read-1.json": 5}


@pytest.mark.slow
@needs_vllm
def test_vllm_captured_teacher_dataset_equals_the_transformers_one(teacher, tmp_path):
    """teacher.capture=engine: vLLM writes the replies and captures the features; tokens identical to the
    transformers teacher's, features within float32 rounding."""
    ours = run_teacher(make_config(*EXACT, "teacher.engine=vllm", "teacher.capture=engine"), tmp_path / "teacher")
    a, b = TeacherDataset(teacher), TeacherDataset(ours)
    assert a.ids == b.ids and b.manifest["capture"] == "engine"
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        assert ((x["features"] - y["features"]).norm() / x["features"].norm()).item() < 1e-5


@pytest.mark.slow
@needs_vllm
def test_vllm_producer_feeds_the_weights_of_stored_features(teacher, stored):
    """A vLLM producer (extract_hidden_states) feeds a trainer without the target's body: the stored run's
    weights, within the features' float32 rounding."""
    out = run_train(make_config(*EXACT, "trainer.features=producer", "producer.engine=vllm"),
                    teacher.parent / "vllm" / "train", teacher)
    assert_same_weights(stored, weights(out), atol=1e-5)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

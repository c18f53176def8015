"""Progress users can read: live bars on a terminal, plain lines with rate and ETA in a log, per sample in the
teacher."""
from __future__ import annotations

import io
import logging
import re
import subprocess
import sys

import pytest

from dflash_pipeline.runtime import memory
from dflash_pipeline.runtime import progress as progress_mod
from dflash_pipeline.runtime.progress import Progress
from dflash_pipeline.models.generation import generate
from dflash_pipeline.models.target import load_target

from conftest import ROOT, make_config, user_env

LINE = re.compile(r"^(?P<desc>[^:]+): (?P<n>\d+)/(?P<total>\d+) (?P<unit>\w+)s")


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(progress_mod.time, "monotonic", fake)
    monkeypatch.delenv("DFLASH_PROGRESS", raising=False)
    monkeypatch.delenv("DFLASH_PROGRESS_INTERVAL", raising=False)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    return fake


def test_lines_in_a_log_file_hold_rate_and_eta_once_per_interval(clock, tmp_path):
    log_file = tmp_path / "job.err"
    with open(log_file, "w") as f:  # not a tty: plain lines
        with Progress("teacher", 800, "sample", file=f, enabled=True) as bar:
            for _ in range(20):  # 20 x 16 samples at 10 s each: 200 s, lines at 0, 30, 60, ..., 180 and at the end
                clock.t += 10
                bar.update(16)
                bar.add("gen tok", 2480)
    text = log_file.read_text()
    assert "\r" not in text
    lines = text.splitlines()
    assert lines[0] == "teacher: 0/800 samples, elapsed 0:00"
    assert len(lines) == 1 + 6 + 1, lines
    assert lines[1] == "teacher: 48/800 samples, 1.60 samples/s, 165 gen tok/s, elapsed 0:30, ETA 7:50"
    assert lines[-1] == "teacher: 320/800 samples, 1.60 samples/s, 248 gen tok/s, elapsed 3:20, ETA 5:00"


def test_resume_counts_only_this_runs_rate_and_ends_with_done(clock):
    out = io.StringIO()
    with Progress("train", 10, "step", initial=4, file=out, enabled=True) as bar:
        for _ in range(6):
            clock.t += 2
            bar.update()
        assert bar.eta() == 0
    lines = out.getvalue().splitlines()
    assert lines[0] == "train: 4/10 steps (resumed), elapsed 0:00"
    assert lines[-1] == "train: 10/10 steps, 2.00 s/step, elapsed 0:12, done"


def test_fractional_work_floors_on_display(clock):
    out = io.StringIO()
    bar = Progress("eval mtbench chain", 2, "prompt", file=out, enabled=True)
    for _ in range(3):
        clock.t += 1
        bar.update(1 / 4)
    assert bar.summary().startswith("0/2 prompts, 4.00 s/prompt")
    bar.update(1 / 4)
    assert bar.summary().startswith("1/2 prompts")
    bar.close()


def test_off_by_environment_or_on_other_ranks_but_eta_still_known(clock, monkeypatch):
    out = io.StringIO()
    bar = Progress("train", 10, "step", file=out, enabled=False)  # not the main process
    clock.t += 1
    bar.update()
    assert bar.eta() == 9 and bar.eta_text() == "0:09"
    bar.close()
    monkeypatch.setenv("DFLASH_PROGRESS", "off")
    Progress("train", 10, "step", file=out, enabled=True).close()
    monkeypatch.setenv("DFLASH_PROGRESS", "lines")
    monkeypatch.setenv("TQDM_DISABLE", "1")
    Progress("train", 10, "step", file=out, enabled=True).close()
    assert out.getvalue() == ""


def test_a_terminal_gets_a_bar_and_logging_goes_through_tqdm(clock, monkeypatch):
    class Tty(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setenv("DFLASH_PROGRESS", "bar")
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    root.addHandler(handler)
    try:
        with Progress("train", 3, "step", file=Tty(), enabled=True) as bar:
            assert bar.mode == "bar" and handler not in root.handlers  # console logs are written above the bar
            bar.update()
        assert handler in root.handlers  # and given back
    finally:
        root.removeHandler(handler)


def test_each_stage_logs_its_own_peak_and_the_process_peak_stays_for_gnu_time():
    """A stage's log line counts a tensor it made, not an earlier stage's larger one; and measuring resets nothing,
    so GNU time's maximum RSS (the kernel's high-water mark) still holds the job's peak."""
    import torch

    big, small = 256 * 2**20, 128 * 2**20
    with memory.StagePeak() as first:
        x = torch.ones(big // 4)  # written, so resident
    del x
    with memory.StagePeak() as second:
        y = torch.ones(small // 4)
    del y
    assert first.peak >= big and second.peak >= small
    assert second.peak < first.peak - (big - small) // 2
    assert memory.peak_rss() >= first.peak - 2**20  # (the kernel's counters lag by a few pages)
    assert re.fullmatch(r"peak \d+\.\d GB resident", second.text())


@pytest.fixture(scope="module")
def tiny_target():
    cfg = make_config()
    return load_target(cfg.target, cfg.cache_dir)


def test_generate_reports_each_row_when_it_finishes(tiny_target):
    """Rows leave a generation batch at different steps; on_step says which, as it happens."""
    tok = tiny_target.tokenizer
    prompts = [tok(t)["input_ids"] for t in ("Hello there", "What is the capital of France?", "1 2 3 4 5 6 7")]
    free = generate(tiny_target.model, prompts, max_new_tokens=8, eos_ids={-1}, pad_id=tok.pad_token_id)

    def first(row: list[int], token: int) -> int:
        return row.index(token) if token in row else len(row)

    # an end token that ends the rows at different steps
    eos = next(t for row in free for t in row if len({first(r, t) for r in free}) > 1)
    calls = []
    out = generate(tiny_target.model, prompts, max_new_tokens=8, eos_ids={eos}, pad_id=tok.pad_token_id,
                   on_step=lambda n, finished: calls.append((n, list(finished))))
    assert sum(n for n, _ in calls) == sum(len(r) for r in out)
    finished = [r for _, rows in calls for r in rows]
    assert sorted(finished) == [0, 1, 2]  # every row reported once
    assert any(rows for _, rows in calls[:-1])  # one of them before the batch ended


@pytest.mark.slow
def test_teacher_log_advances_per_sample_with_rate_and_eta(tmp_path):
    """dflash-teacher with stderr to a file: plain lines only, and the count moves inside a shard."""
    err = tmp_path / "teacher.err"
    env = dict(user_env(), DFLASH_PROGRESS_INTERVAL="0")
    env.pop("DFLASH_PROGRESS", None)
    with open(err, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "dflash_pipeline.data", "experiment=tiny",
                               f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=f, text=True, timeout=600)
    text = err.read_text()
    assert proc.returncode == 0, text[-3000:]
    assert "\r" not in text
    lines = [l for l in text.splitlines() if l.startswith("teacher: ")]
    counts = [int(LINE.match(l)["n"]) for l in lines]
    cfg = make_config()
    assert counts[-1] == cfg.data.num_samples and counts == sorted(counts)
    assert any(0 < n < cfg.teacher.shard_size for n in counts), counts  # before the first shard is written
    assert any(re.search(r"[\d.]+ samples/s, [\d.]+ gen tok/s, elapsed \d+:\d\d, ETA \d+:\d\d$", l) for l in lines)


@pytest.mark.slow
def test_train_and_eval_show_steps_and_prompts(tiny_teacher, tmp_path, capsys, caplog, monkeypatch):
    from dflash_pipeline.eval.stage import run_eval
    from dflash_pipeline.train.loop import run_train

    monkeypatch.delenv("DFLASH_PROGRESS", raising=False)
    caplog.set_level(logging.INFO)
    cfg = make_config("eval.datasets=[mtbench]", "eval.num_prompts=1", "eval.methods=[chain]")
    run_train(cfg, tmp_path / "train", data_dir=tiny_teacher)
    run_eval(cfg, tmp_path / "eval", teacher_dir=tiny_teacher, train_dir=tmp_path / "train")
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    train = [l for l in lines if l.startswith("train: ")]
    assert train[0] == f"train: 0/{cfg.trainer.steps} steps, elapsed 0:00"
    n = cfg.trainer.steps
    assert re.match(rf"train: {n}/{n} steps, [\d.]+ (steps/s|s/step), elapsed \d+:\d\d, done$", train[-1]), train
    steps = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert steps and all(re.search(r", ETA \d+:\d\d$", s) for s in steps)
    for desc, unit in (("eval teacher_heldout offline", "sequence"), ("eval mtbench chain", "prompt"),
                       ("eval mtbench offline", "sequence")):
        mine = [l for l in lines if l.startswith(desc + ": ")]
        assert len(mine) == 2 and mine[-1].endswith("done") and f" {unit}s" in mine[-1], (desc, lines)

"""The experiment workflow: Hydra sweeps (grid and Optuna), resumable sweeps, dflash-compare, multi-process teacher
generation, and the launch recipes (accelerate config files, the SLURM launcher)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from dflash_pipeline.data.shards import TeacherDataset
from dflash_pipeline.eval.compare import CompareError, compare, main as compare_main

from conftest import ROOT, accelerate_launch, make_config, metrics, run_command, user_env

GRID = ["drafter.num_layers=1,2", "trainer.lr=3e-4,1e-3"]


def console(name: str) -> str:
    path = shutil.which(name) or str(Path(sys.executable).parent / name)
    assert Path(path).is_file(), f"{name} is not installed: pip install -e ."
    return path


def sweep_cmd(sweep_dir: Path, *extra: str) -> list[str]:
    return [console("dflash-pipeline"), "-m", "experiment=tiny", *GRID, f"hydra.sweep.dir={sweep_dir}",
            "eval.datasets=[mtbench,heldout]", "eval.methods=[chain]", "pipeline.components=[]", *extra]


def finished_jobs(sweep_dir: Path) -> list[Path]:
    return sorted(p.parent.parent for p in sweep_dir.glob("multirun/*/eval/eval_results.json"))


def stage_files(job: Path) -> dict[Path, int]:
    """The files the stages wrote (Hydra rewrites its own .hydra/ and log files on every launch)."""
    return {p: p.stat().st_mtime_ns for d in ("train", "eval") for p in (job / d).rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def killed_and_rerun_sweep(tmp_path_factory):
    """A 2x2 pipeline sweep on tiny, killed (SIGKILL, whole process group) once two jobs have finished, then the
    same command run again to the end. Returns (sweep dir, {finished job: its stage files at the kill}, rerun log)."""
    sweep_dir = tmp_path_factory.mktemp("sweep")
    proc = subprocess.Popen(sweep_cmd(sweep_dir), cwd=ROOT, env=user_env(), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while len(finished_jobs(sweep_dir)) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {job: stage_files(job) for job in finished_jobs(sweep_dir)}
    assert len(before) in (2, 3), f"the sweep was killed after {len(before)} finished jobs, not mid-sweep"
    rerun = run_command(sweep_cmd(sweep_dir))
    return sweep_dir, before, rerun.stdout + rerun.stderr


@pytest.mark.slow
def test_a_killed_sweep_rerun_does_not_repeat_its_finished_jobs(killed_and_rerun_sweep):
    sweep_dir, before, log = killed_and_rerun_sweep
    assert len(finished_jobs(sweep_dir)) == 4
    for job, files in before.items():
        assert stage_files(job) == files, f"{job.name} was run again"
    assert log.count("evaluation already complete") == len(before)
    assert log.count("training already complete") == len(before)
    # The jobs share one teacher dataset, generated once in the experiment's folder.
    assert (sweep_dir / "teacher" / "manifest.json").is_file()
    assert not list(sweep_dir.glob("multirun/*/teacher"))


@pytest.mark.slow
def test_compare_lists_the_sweep_runs_with_the_values_of_their_results(killed_and_rerun_sweep, tmp_path, capsys):
    sweep_dir, _, _ = killed_and_rerun_sweep
    header, rows = compare([str(sweep_dir)], png=tmp_path / "c.png", md=tmp_path / "c.md")
    assert len(rows) == 4
    assert {"drafter.num_layers", "trainer.lr"} <= set(header)  # the swept keys, found as config differences
    assert "trainer.steps" not in header  # the same in every run
    col = {name: i for i, name in enumerate(header)}
    for row in rows:
        job = sweep_dir / "multirun" / row[0].split("/", 1)[1]
        results = json.loads((job / "eval" / "eval_results.json").read_text())
        assert f"drafter.num_layers={row[col['drafter.num_layers']]}" in job.name
        assert row[col["teacher_heldout tau_off"]] == results["offline"]["teacher_heldout"]["tau_offline"]
        for ds in ("mtbench", "heldout"):
            r = results["methods"]["chain"][ds]
            assert row[col[f"{ds} tau_on"]] == r["tau_online"]
            assert row[col[f"{ds} tau_off"]] == r["tau_offline"]
            assert row[col[f"{ds} speedup"]] == r["speedup"]
        speeds = [row["tokens_per_s"] for row in metrics(job / "train")]
        assert min(speeds) <= row[col["train tok/s"]] <= max(speeds)
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "c.md").read_text().count("\n") == 2 + 4

    compare_main([str(sweep_dir), "--png", str(tmp_path / "cli.png")])  # the console script prints the same table
    printed = capsys.readouterr().out
    assert printed.count("| tiny/drafter.num_layers=") == 4 and (tmp_path / "cli.png").is_file()


def test_compare_rejects_folders_without_runs(tmp_path):
    with pytest.raises(CompareError, match="holds no run results"):
        compare([str(tmp_path)])


@pytest.mark.slow
def test_compare_reads_the_same_rows_from_wandb_runs(killed_and_rerun_sweep):
    """--wandb: the train and eval runs of each job, as wandb's API gives them (config + summary written by
    RunLogger), make the same rows as the folders."""
    from omegaconf import OmegaConf

    from dflash_pipeline.eval import report
    from dflash_pipeline.runtime.logger import flatten

    sweep_dir, _, _ = killed_and_rerun_sweep

    class FakeRun:
        def __init__(self, name, job_type, config, summary):
            self.name, self.job_type, self.config, self.summary = name, job_type, config, summary

    runs = []
    for job in finished_jobs(sweep_dir):
        config = OmegaConf.to_container(OmegaConf.load(job / ".hydra" / "config.yaml"), resolve=False)
        name = f"tiny/{job.name}"
        train_rows = metrics(job / "train")
        train_summary = {}
        for r in train_rows:  # wandb's summary keeps the last value of every key
            train_summary.update(flatten({k: v for k, v in r.items() if k != "step"}))
        train_summary["_step"] = train_rows[-1]["step"]
        results = json.loads((job / "eval" / "eval_results.json").read_text())
        runs += [FakeRun(f"{name}-train", "train", config, train_summary),
                 FakeRun(f"{name}-eval", "eval", config, flatten(report.loggable(results)))]

    class FakeApi:
        def runs(self, path, filters=None):
            assert path == "me/dflash" and filters == {"group": "tiny"}
            return runs

    header_w, rows_w = compare(wandb_project="me/dflash", group="tiny", api=FakeApi())
    header_d, rows_d = compare([str(sweep_dir)])
    assert header_w == header_d
    rows_d = [[v for h, v in zip(header_d, r) if h != "train tok/s"] for r in rows_d]
    rows_w = [[v for h, v in zip(header_w, r) if h != "train tok/s"] for r in rows_w]  # last value, not median
    assert sorted(map(str, rows_w)) == sorted(map(str, rows_d))


@pytest.mark.slow
def test_optuna_sweep_maximises_heldout_tau_and_continues_its_study(tiny_teacher, tmp_path):
    optuna = pytest.importorskip("optuna", reason="the sweep extra: pip install -e '.[sweep]'")

    def run(trials: int):
        cmd = [console("dflash-train"), "-m", "experiment=tiny", "sweep=optuna_tau", f"hydra.sweep.dir={tmp_path}",
               f"hydra.sweeper.n_trials={trials}", f"trainer.data_dir={tiny_teacher}"]
        run_command(cmd)

    run(2)
    run(1)  # the same command again: the stored study goes on
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path}/optuna.db")
    trials = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert len(trials) == 3
    for t in trials:  # each trial's value is the held-out tau of the job run with its parameters
        job = next(j for j in (tmp_path / "multirun").iterdir()
                   if f"trainer.lr={t.params['trainer.lr']}" in j.name
                   and f"drafter.num_layers={t.params['drafter.num_layers']}" in j.name)
        held = [row["heldout"] for row in metrics(job / "train") if "heldout" in row]
        assert t.value == pytest.approx(held[-1]["tau_offline"])


@pytest.mark.slow
def test_recipe_sweep_searches_the_mlp_width_only_for_random_init_and_shares_its_study(tiny_teacher, tmp_path):
    optuna = pytest.importorskip("optuna", reason="the sweep extra: pip install -e '.[sweep]'")
    base = [console("dflash-train"), "-m", "experiment=tiny", "sweep=optuna_recipe", f"hydra.sweep.dir={tmp_path}",
            f"trainer.data_dir={tiny_teacher}", "trainer.train_samples=null", "trainer.heldout_samples=2",
            "trainer.steps=2", "trainer.eval_every=2", "hydra.sweeper.n_trials=3"]
    # two processes on one study, as on two cores: each its own seed (its sampler's too, and its own job folders)
    procs = [subprocess.Popen(base + [f"seed={s}"], env=user_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for s in (0, 1)]
    for p in procs:
        out = p.communicate(timeout=900)[0]
        assert p.returncode == 0, out[-3000:]
    study = optuna.load_study(study_name="recipe", storage=f"sqlite:///{tmp_path}/optuna.db")
    trials = [t for t in study.trials if t.state.name == "COMPLETE"]
    assert len(trials) == 6
    assert {t.params["trainer.loss"] for t in trials} <= {"decay", "dpace", "kl"}
    for t in trials:
        assert ("drafter.intermediate_size" in t.params) == (t.params["drafter.init"] == "random")
        wanted = {f"{k}={v}" for k, v in t.params.items()}  # by overrides: names this long are a prefix + hash
        jobs = [j for j in (tmp_path / "multirun").iterdir()
                if wanted <= set(yaml.safe_load((j / ".hydra" / "overrides.yaml").read_text()))]
        held = [[row["heldout"] for row in metrics(j / "train") if "heldout" in row][-1]["tau_offline"] for j in jobs]
        assert t.value in [pytest.approx(h) for h in held]


@pytest.mark.slow
def test_teacher_generated_by_two_processes_equals_the_one_process_dataset(tmp_path):
    def launch(n: int, run_dir: Path) -> TeacherDataset:
        run_command(accelerate_launch(n, "-m", "dflash_pipeline.data", "experiment=tiny", f"hydra.run.dir={run_dir}"))
        return TeacherDataset(run_dir / "teacher")

    one, two = launch(1, tmp_path / "one"), launch(2, tmp_path / "two")
    assert len(one.manifest["shards"]) == 2  # so each of the 2 processes wrote one shard
    assert one.manifest["num_tokens"] == two.manifest["num_tokens"]
    assert [r["sha256"] for r in one.manifest["shards"]] == [r["sha256"] for r in two.manifest["shards"]]
    assert one.ids == two.ids
    assert [r["process"] for r in two.manifest["shards"]] == ["0 of 2", "1 of 2"]  # really split over 2 processes
    for i in range(len(one)):
        a, b = one[i], two[i]
        assert set(a) == set(b)
        for k in a:
            assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k


def test_slurm_launcher_and_accelerate_recipes_are_valid():
    cfg = make_config("hydra/launcher=slurm", return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
    assert cfg.hydra.launcher.tasks_per_node == cfg.hydra.launcher.gpus_per_node  # one process per GPU
    from accelerate.commands.config.config_args import ClusterConfig

    recipes = sorted((ROOT / "scripts" / "accelerate").glob("*.yaml"))
    assert {p.stem for p in recipes} >= {"ddp_bf16", "multinode_ddp_bf16", "cpu_2proc", "fsdp_bf16",
                                         "multinode_fsdp_bf16", "cpu_2proc_fsdp"}
    for path in recipes:
        c = ClusterConfig.from_yaml_file(str(path))  # unknown keys raise
        assert c.num_processes >= 2
        assert c.mixed_precision == ("no" if c.use_cpu else "bf16")
        if "fsdp" in path.stem:  # the loop shards the drafter itself with FSDP2 (train/parallel.py)
            assert c.distributed_type == "FSDP" and c.fsdp_config == {"fsdp_version": 2}


@pytest.mark.slow
def test_slurm_launcher_runs_each_job_as_one_distributed_job_per_task(tiny_teacher, tmp_path):
    """The submitit launcher with 2 tasks per job (its local executor, as SLURM would start them): the tasks form
    one 2-process accelerate run, which follows the 1-process loss curve."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the sweep extra: pip install -e '.[sweep]'")
    cmd = [console("dflash-train"), "-m", "experiment=tiny", "hydra/launcher=submitit_local",
           "hydra.launcher.tasks_per_node=2", "hydra.launcher.timeout_min=10", f"hydra.sweep.dir={tmp_path}",
           f"trainer.data_dir={tiny_teacher}", "trainer.lr=1e-3", "logger=none"]
    run_command(cmd)
    logs = "".join(p.read_text() for p in tmp_path.glob(".submitit/*/*_log.*"))
    assert logs.count("train: 2 process(es) (MULTI_CPU)") == 2
    job = tmp_path / "multirun" / "trainer.lr=0.001"
    from dflash_pipeline.train.loop import run_train

    one = run_train(make_config("trainer.lr=1e-3", "logger=none"), tmp_path / "one", data_dir=tiny_teacher)
    losses = [[row["loss"] for row in metrics(d)] for d in (job / "train", one)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)


def test_sweep_job_folders_stay_short_enough_for_the_file_system():
    """Many overrides make a folder name over 255 bytes (an OSError at the job's start): past 200 bytes the name is a
    prefix plus a hash, still one folder per override set."""
    from dflash_pipeline.conf.schema import job_dirname

    short = "drafter.num_layers=1,trainer.lr=0.001"
    assert job_dirname(short) == short
    long_a = ",".join(f"trainer.option_{i}={i}" for i in range(20))
    long_b = long_a.replace("option_19=19", "option_19=20")
    a, b = job_dirname(long_a), job_dirname(long_b)
    assert len(a.encode()) <= 200 and len(b.encode()) <= 200 and a != b and a.startswith("trainer.option_0=0,")
    assert job_dirname(long_a) == a
    assert "job_dirname:" in (ROOT / "conf" / "config.yaml").read_text()

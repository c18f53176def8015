"""How the pipeline fits the tools around it: one import namespace that a user's own files cannot shadow, the
launcher's precision, wandb's own settings, the umask, and bad input refused with one line before any output."""
from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from dflash_pipeline.conf import schema
from dflash_pipeline.conf.schema import ConfigError, check_config
from dflash_pipeline.data.sources import DataSourceError
from dflash_pipeline.data.teacher import run_teacher
from dflash_pipeline.train.loop import run_train

from conftest import ROOT, make_config, metrics, user_env

SHADOW = 'raise SystemExit("the user\'s own {name}.py ran instead of dflash-pipeline")\n'


def run_in(folder: Path, cmd: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=folder, env=user_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture()
def user_folder(tmp_path) -> Path:
    """A working directory holding a user's own train.py, data.py and eval.py."""
    folder = tmp_path / "work"
    folder.mkdir()
    for name in ("train", "data", "eval", "models", "conf"):
        (folder / f"{name}.py").write_text(SHADOW.format(name=name))
    return folder


@pytest.mark.slow
def test_console_scripts_and_python_m_run_the_project_from_a_folder_with_its_own_train_py(user_folder, tiny_teacher):
    run_in(user_folder, [sys.executable, "-c", "import dflash_pipeline.data.shards, dflash_pipeline.eval.compare"])
    run_in(user_folder, ["dflash-teacher", "experiment=tiny", "data.num_samples=2", "teacher.max_new_tokens=4",
                         "hydra.run.dir=run_cli"])
    assert (user_folder / "run_cli" / "teacher" / "manifest.json").is_file()
    for module in ("dflash_pipeline.train", "dflash_pipeline.data"):
        assert "dflash-" in run_in(user_folder, [sys.executable, "-m", module, "--help"]).stdout
    run_in(user_folder, [sys.executable, "-m", "dflash_pipeline.train", "experiment=tiny", "trainer.steps=1",
                         f"trainer.data_dir={tiny_teacher}", "hydra.run.dir=run_m"])
    assert (user_folder / "run_m" / "train" / "export" / "model.safetensors").is_file()
    # the job log is named after the command, not after the module that implements it
    assert (user_folder / "run_cli" / "dflash-teacher.log").is_file()
    assert (user_folder / "run_m" / "dflash-train.log").is_file()


@pytest.mark.slow
def test_help_names_the_command_and_the_project():
    out = subprocess.run(["dflash-eval", "--help"], capture_output=True, text=True, timeout=120).stdout
    assert out.startswith("dflash-eval: part of dflash-pipeline") and "entrypoints" not in out


def _launch_config(tmp_path: Path, precision: str) -> Path:
    """An accelerate config file as `accelerate config` writes it: one CPU process."""
    path = tmp_path / f"{precision}.yaml"
    path.write_text(f"compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nmixed_precision: {precision}\n"
                    "num_machines: 1\nnum_processes: 1\nuse_cpu: true\nmachine_rank: 0\ndynamo_config: {}\n")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("override, expected", [([], "bfloat16"), (["trainer.mixed_precision=no"], "float32")])
def test_the_launcher_config_sets_precision_unless_the_trainer_says_otherwise(tiny_teacher, tmp_path, override,
                                                                               expected):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(_launch_config(tmp_path, "bf16")),
           "-m", "dflash_pipeline.train", "experiment=tiny", "trainer.steps=2", "trainer.log_every=1",
           f"trainer.data_dir={tiny_teacher}", f"hydra.run.dir={run_dir}", *override]
    run_in(ROOT, cmd)
    assert {row["autocast"] for row in metrics(run_dir / "train")} == {expected}


def test_unknown_choice_fails_before_any_stage_runs(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.run(["dflash-pipeline", "experiment=tiny", "trainer.loss=dpce", f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, env=user_env(), timeout=120)
    assert proc.returncode != 0
    assert "Invalid value 'dpce', expected one of [decay, dpace, kl]" in proc.stderr
    assert not run_dir.exists()
    for key, value in [("target.dtype", "float33"), ("logger.kind", "tensorboard"), ("target.kind", "onnx"),
                       ("teacher.feature_dtype", "fp8"), ("trainer.component", "selectr")]:
        with pytest.raises(ConfigCompositionException, match=f"{key}={value}"):
            make_config(f"{key}={value}")


def _ranged_fields(node=schema.Config, prefix=""):
    for f in dataclasses.fields(node):
        if dataclasses.is_dataclass(f.default_factory):
            yield from _ranged_fields(f.default_factory, f"{prefix}{f.name}.")
        elif f.metadata.get("range"):
            yield f"{prefix}{f.name}", dict(f.metadata["range"], is_list="list[" in str(f.type))


def _outside(bounds: dict):
    """A value just outside the declared bounds (in a list when the field holds a list)."""
    if bounds["ge"] is None and bounds["gt"] is None and bounds["le"] is None and bounds["lt"] is None:
        return "[]"  # a list that must not be empty
    if bounds["ge"] is not None:
        bad = bounds["ge"] - (1 if isinstance(bounds["ge"], int) else 0.5)
    elif bounds["gt"] is not None:
        bad = bounds["gt"]
    else:
        bad = (bounds["le"] if bounds["le"] is not None else bounds["lt"]) + 1
    return f"[{bad}]" if bounds["is_list"] else bad


RANGED = list(_ranged_fields())


def test_every_numeric_setting_declares_a_range():
    assert len(RANGED) >= 45
    ranged = {key for key, _ in RANGED}
    assert {"teacher.max_new_tokens", "trainer.lr", "eval.block_size", "drafter.block_size",
            "data.heldout_fraction", "teacher.top_p", "eval.temperature"} <= ranged


@pytest.mark.parametrize("key, bounds", RANGED, ids=[key for key, _ in RANGED])
def test_out_of_range_value_is_one_line_naming_the_key(key, bounds):
    value = _outside(bounds)
    with pytest.raises(ConfigError, match=rf"^{key}=\S+ (is out of range: must be|must not be empty)"):
        check_config(make_config(f"{key}={value}"))


def test_empty_lists_are_refused():
    with pytest.raises(ConfigError, match=r"eval.datasets=\[\] must not be empty"):
        check_config(make_config("eval.datasets=[]"))


@pytest.mark.parametrize("name, content, match", [
    ("cut.json", '[{"messages": [{"role": "user", "content": "hello th', r"cut.json could not be read as json"),
    ("empty.jsonl", "", r"empty.jsonl is empty"),
    ("cut.jsonl", '{"prompt": "hello"}\n{"prompt": "hel', r"cut.jsonl could not be read as json"),
])
def test_unreadable_prompt_files_fail_with_one_line_and_write_nothing(tmp_path, name, content, match):
    file = tmp_path / name
    file.write_text(content)
    out = tmp_path / "teacher"
    with pytest.raises(DataSourceError, match=match) as info:
        run_teacher(make_config("data=file", f"data.path={file}"), out)
    assert "\n" not in str(info.value)
    assert not out.exists()


@pytest.mark.slow
def test_negative_max_new_tokens_fails_before_any_output(tmp_path):
    out = tmp_path / "teacher"
    with pytest.raises(ConfigError, match=r"teacher.max_new_tokens=-5 is out of range: must be >= 1"):
        run_teacher(make_config("teacher.max_new_tokens=-5"), out)
    assert not out.exists()
    run_dir = tmp_path / "cli"
    proc = subprocess.run(["dflash-teacher", "experiment=tiny", "teacher.max_new_tokens=-5", f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, env=user_env(), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: teacher.max_new_tokens=-5 is out of range: must be >= 1 (fix the value on "
                                   "the command line or in the experiment YAML)")
    assert not (run_dir / "teacher").exists()


def test_artifacts_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        teacher = run_teacher(make_config("data.num_samples=3", "teacher.max_new_tokens=4", "teacher.shard_size=2"),
                              tmp_path / "teacher")
        run = run_train(make_config("trainer.steps=1", "trainer.heldout_samples=1"), tmp_path / "train",
                        data_dir=teacher)
    finally:
        os.umask(old)
    files = [*teacher.glob("*"), *(run / "export").glob("*"), *(run / "checkpoints").rglob("*")]
    weights = [p for p in files if p.suffix == ".safetensors"]
    assert len(weights) >= 4  # two shards, the export, a checkpoint's model
    modes = {p.relative_to(tmp_path): oct(stat.S_IMODE(p.stat().st_mode)) for p in files if p.is_file()}
    assert set(modes.values()) == {"0o640"}, modes


def _wandb_mode(env: dict, requested: str | None = None) -> str:
    code = ("from dflash_pipeline.runtime.logger import wandb_mode; "
            f"print('MODE', wandb_mode({requested!r}))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return next(line for line in proc.stdout.splitlines() if line.startswith("MODE")).split()[1]


@pytest.mark.slow
def test_wandb_settings_decide_the_mode_unless_logger_mode_is_given(tmp_path):
    base = {k: v for k, v in user_env().items() if not k.startswith("WANDB_")}
    base.update(HOME=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"))
    assert _wandb_mode(base) == "offline"  # nothing configured: offline rather than a prompt for a key
    assert _wandb_mode(dict(base, WANDB_MODE="disabled")) == "None"  # wandb's own setting stands
    assert _wandb_mode(dict(base, WANDB_API_KEY="x" * 40)) == "None"  # credentials: wandb goes online itself
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "y" * 40 + "\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert _wandb_mode(base) == "None"  # `wandb login` stored a key
    assert _wandb_mode(dict(base, WANDB_MODE="offline"), "online") == "online"  # logger.mode overrides


@pytest.mark.slow
def test_a_resumed_training_stage_continues_its_wandb_run(tiny_teacher, tmp_path):
    out = tmp_path / "train"
    common = ["logger=wandb", "logger.mode=offline", "logger.tags=[ablation,tiny]", "trainer.save_every=1"]
    run_train(make_config("trainer.steps=2", *common), out, data_dir=tiny_teacher)
    first = (out / "wandb_run_id").read_text()
    run_train(make_config("trainer.steps=3", "trainer.resume=true", *common), out, data_dir=tiny_teacher)
    assert (out / "wandb_run_id").read_text() == first
    runs = sorted(p.name for p in (out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(name.endswith(first) for name in runs)
    run_train(make_config("trainer.steps=2", "trainer.lr=1e-3", *common), tmp_path / "other", data_dir=tiny_teacher)
    assert (tmp_path / "other" / "wandb_run_id").read_text() != first


@pytest.mark.slow
def test_a_user_error_is_printed_once(tmp_path):
    proc = subprocess.run(["dflash-eval", "experiment=tiny", "eval.datasets=[nope]", f"hydra.run.dir={tmp_path}"],
                          capture_output=True, text=True, env=user_env(), timeout=120)
    assert proc.returncode == 2
    assert (proc.stdout + proc.stderr).count("unknown eval dataset 'nope'") == 1
    assert "unknown eval dataset 'nope'" in (tmp_path / "dflash-eval.log").read_text()  # and kept in the job log


def test_two_processes_filling_one_cache_folder_both_succeed(tmp_path):
    """Jobs of a sweep (or test workers) converting the same target into a fresh cache at once: whoever renames its
    folder second keeps the first one's (same content) instead of failing; a folder in the way that is not a finished
    one is an error. Concurrent writers of one file each use their own temporary name."""
    import os

    from dflash_pipeline.runtime.files import atomic_path, publish_folder

    out = tmp_path / "targets" / "tiny-abc"
    first, second = tmp_path / "targets" / "tiny-abc.tmp1", tmp_path / "targets" / "tiny-abc.tmp2"
    for folder, text in ((first, "first"), (second, "second")):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(text)
    assert publish_folder(first, out) == out and publish_folder(second, out) == out
    assert (out / "config.json").read_text() == "first" and not second.exists()
    broken, other = tmp_path / "broken", tmp_path / "other.tmp"
    (broken / "x").mkdir(parents=True)
    other.mkdir()
    with pytest.raises(OSError):
        publish_folder(other, broken)
    with atomic_path(tmp_path / "shared.json") as tmp:
        assert tmp.name == f"shared.json.tmp{os.getpid()}"
        tmp.write_text("{}")
    assert (tmp_path / "shared.json").read_text() == "{}" and not tmp.exists()

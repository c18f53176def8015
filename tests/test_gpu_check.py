"""scripts/gpu_check.py, the one prepared GPU command, at its tiny scale on the CPU: it runs from the checkout alone
(no install needed, PYTHONPATH unset) with hydra, omegaconf, accelerate, datasets and wandb unimportable, as on a
GPU machine that has only torch and transformers, and writes the cost curve, the training throughput and the
exactness verdicts it promises."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from conftest import ROOT, user_env

SCRIPT = ROOT / "scripts" / "gpu_check.py"
FORBIDDEN = ("hydra", "omegaconf", "accelerate", "datasets", "wandb")
# `python scripts/gpu_check.py ARGS` as on a plain checkout: the editable install's finder and path hook removed (the
# package must then be unfindable), and FORBIDDEN set to None in sys.modules: importing one raises
# ModuleNotFoundError and importlib.util.find_spec reports it absent (so transformers skips its accelerate hooks).
LAUNCH = """
import importlib.util, runpy, sys
editable = lambda x: "__editable__" in (x if isinstance(x, str) else getattr(x, "__module__", "") or "")
sys.meta_path[:] = [f for f in sys.meta_path if not editable(f)]
sys.path_hooks[:] = [h for h in sys.path_hooks if not editable(h)]
sys.path[:] = [{scripts!r}] + [p for p in sys.path[1:] if not editable(p)]
sys.path_importer_cache.clear()
assert importlib.util.find_spec("dflash_pipeline") is None, "dflash_pipeline is still importable without the script"
sys.modules.update(dict.fromkeys({forbidden!r}))
sys.argv[0] = {script!r}
runpy.run_path({script!r}, run_name="__main__")
"""


def plain_env() -> dict:
    env = user_env()
    env.pop("PYTHONPATH", None)
    return env


def run_script(*args: str, blocked: bool = True) -> subprocess.CompletedProcess:
    code = LAUNCH.format(forbidden=FORBIDDEN if blocked else (), scripts=str(SCRIPT.parent), script=str(SCRIPT))
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=plain_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_tiny_run_on_cpu(tmp_path):
    out = tmp_path / "g.json"
    proc = run_script("--scale", "tiny", "--device", "cpu", "--train-steps", "3", "--decodes", "2",
                      "--max-new-tokens", "12", "--fsdp-procs", "2", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["errors"] == {}
    assert r["unneeded_imported"] == []
    assert r["package_root"] == str(ROOT)  # this checkout, whatever is installed
    assert set(r["seconds"]) == {"build", "costs", "train", "decodes", "fsdp", "dflash2", "kernels", "total"}
    assert r["dflash2"]["skipped"].startswith("vllm is not importable")  # the project's python has no vLLM

    c = r["costs"]
    assert len(c["verify_cost"]) == 16 and c["verify_cost"][0] == pytest.approx(1.0)
    assert all(math.isfinite(x) and x > 0 for x in c["verify_cost"])
    assert set(c["tree_cost"]) == {"16", "32", "64", "128"}
    assert all(x > 0 for x in c["tree_cost"].values()) and c["draft_cost"] > 0 and c["step_ms"] > 0

    t = r["train"]
    assert t["steps"] == 3 and len(t["losses"]) == 3 and t["losses_finite"]
    assert all(math.isfinite(x) for x in t["losses"])
    assert t["block_positions_per_s"] > 0 and t["anchor_blocks_per_s"] > 0 and t["ms_per_step"] > 0

    d = r["decodes"]
    assert sum(d["counts"].values()) == 2 == len(d["decodes"])
    for row in d["decodes"]:
        assert row["tau"] >= 1.0 and row["tokens"] == 12
        if row["kind"] == "identical":
            assert row["position"] is None
        else:
            assert row["position"] is not None
        if row["kind"] == "near_tie":
            assert row["logprob_gap"] < d["tolerance"]
    assert d["speedup"] > 0
    assert "c(n), n=1..16" in proc.stdout and "exactness:" in proc.stdout

    f = r["fsdp"]  # 2 gloo processes, the drafter sharded as an FSDP launch shards it: 1 process's losses
    assert set(f["runs"]) == {"1", "2"} and len(f["runs"]["2"]["losses"]) == 3
    assert f["loss_max_rel_diff"] < 1e-3 and f["state_ratio"] == pytest.approx(0.5, abs=0.01)
    assert "fsdp over 2 processes" in proc.stdout


def test_help():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], cwd=ROOT, env=plain_env(), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--scale" in proc.stdout and "--train-steps" in proc.stdout

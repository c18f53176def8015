"""scripts/gpu_check.py, the one prepared GPU command, at its tiny scale on the CPU: it runs from the checkout alone
(no install needed, PYTHONPATH unset) with hydra, omegaconf, accelerate, datasets and wandb unimportable, as on a
GPU machine that has only torch and transformers, and writes the cost curve, the training throughput and the
exactness verdicts it promises."""
from __future__ import annotations

import json
import math
import runpy
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


def run_script(*args: str, blocked: bool = True, returncode: int = 0) -> subprocess.CompletedProcess:
    code = LAUNCH.format(forbidden=FORBIDDEN if blocked else (), scripts=str(SCRIPT.parent), script=str(SCRIPT))
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, env=plain_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == returncode, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_tiny_run_on_cpu(tmp_path):
    out = tmp_path / "g.json"
    proc = run_script("--scale", "tiny", "--device", "cpu", "--train-steps", "3", "--decodes", "2",
                      "--max-new-tokens", "12", "--fsdp-procs", "2", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["errors"] == {} and r["failures"] == []
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


def test_each_failed_check_is_one_line():
    """failures() on planted results: flex's gradients past KERNEL_TOLERANCE (and a NaN) fail, values within it and
    near-ties pass, and a section's error, a non-finite loss and wrong outputs each add their line."""
    check = runpy.run_path(str(SCRIPT), run_name="gpu_check")  # its definitions only: main() is not run
    tolerance = check["KERNEL_TOLERANCE"]
    assert 0 < tolerance["out"] <= tolerance["grad"] <= 1e-2  # float32: loose enough for sums reordered, not more
    near = {"kind": "near_tie", "position": 3, "logprob_gap": 0.1}
    wrong = {"kind": "wrong", "position": 5, "logprob_gap": 2.5}
    passing = {"errors": {}, "config": {"kernel_tolerance": [tolerance["out"], tolerance["grad"]]},
               "kernels": {"flex_ms": 3.0, "flex_out_rel_diff": 1e-6, "flex_grad_rel_diff": 1e-4,
                           "sdpa_sliced_out_rel_diff": 0.0, "sdpa_sliced_grad_rel_diff": tolerance["grad"]},
               "train": {"losses_finite": True, "losses": [1.0]},
               "decodes": {"decodes": [near, {"kind": "identical", "position": None, "logprob_gap": None}]},
               "dflash2": {"spec_vs_plain": [near], "hf_vs_plain": None}}
    assert check["failures"](passing) == []
    failing = json.loads(json.dumps(passing))
    failing["errors"]["fsdp"] = "RuntimeError: boom"
    failing["kernels"].update(flex_grad_rel_diff=2 * tolerance["grad"], sdpa_sliced_out_rel_diff=float("nan"))
    failing["train"].update(losses_finite=False, losses=[1.0, float("nan")])
    failing["decodes"]["decodes"].append(wrong)
    failing["dflash2"].update(spec_vs_plain=[near, wrong], hf_vs_plain=[wrong])
    lines = check["failures"](failing)
    assert lines == [
        "fsdp: RuntimeError: boom",
        f"kernels: flex's gradients differ from eager's by {2 * tolerance['grad']:.2e} of the largest entry, over "
        f"{tolerance['grad']:g} (--kernel-tolerance, KERNEL_TOLERANCE)",
        f"kernels: sdpa_sliced's output differs from eager's by nan of the largest entry, over {tolerance['out']:g} "
        "(--kernel-tolerance, KERNEL_TOLERANCE)",
        "train: a loss is not finite: [1.0, nan]",
        "decodes: decode 3's speculative output differs from the autoregressive one at token 5 beyond a near-tie "
        "(gap 2.5)",
        "dflash2: prompt 2: vLLM's speculative output differs from its plain one at token 5 beyond a near-tie "
        "(gap 2.5)",
        "dflash2: prompt 1: vLLM's plain output differs from transformers' greedy one at token 5 beyond a near-tie "
        "(gap 2.5)"]


@pytest.mark.slow
def test_a_kernel_past_its_tolerance_fails_the_run(tmp_path):
    """The exit path end to end: the kernels section at a tolerance no float32 sum meets exits 1, one FAILED line
    per difference, and records them."""
    out = tmp_path / "g.json"
    proc = run_script("--scale", "tiny", "--device", "cpu", "--skip", "costs", "train", "decodes", "fsdp", "dflash2",
                      "--kernel-tolerance", "1e-12", "1e-12", "--out", str(out), returncode=1)
    r = json.loads(out.read_text())
    assert r["errors"] == {} and len(r["failures"]) == 4  # sdpa and sdpa in slices, output and gradients
    assert all(line.startswith("kernels: sdpa") and "over 1e-12" in line for line in r["failures"])
    assert proc.stdout.splitlines()[-4:] == [f"FAILED {line}" for line in r["failures"]]

"""Side by side with the peer DFlash trainers, SpecForge and vLLM's speculators, on this project's teacher data.

    python scripts/bench_peers.py --setup                                  # the peers' virtualenvs, once
    python scripts/bench_peers.py --teacher runs/smollm2_ref/teacher --steps 200 --out runs/peers

Converts the teacher dataset's training split into each peer's format (data/peers.py), trains this project's drafter
and each peer's on it, converts every export into this project's layout (models/peers.py) and scores them all with
this project's evaluator (dflash-eval: held-out teacher-forced a_k and tau_offline with the bootstrap interval,
online tau on MT-Bench and HumanEval with the exact loop). Two recipes (--recipes):

- matched: the same drafter (1 layer at the target's width, MLP 768, block 8, the teacher's taps, MASK token), 8
  sequences x 48 anchors per step (speculators: packed rows of 8 mean-length sequences, 384 anchors), CE with decay
  weights (gamma 4), AdamW at lr 1e-3, no weight decay (SpecForge has none), warmup then cosine, clip 1.0, the same
  steps and seed, float32. What cannot be matched is listed in the results (schedule floor, AdamW betas).
- default: each trainer's own defaults as its users run them, at the same data and steps: this project's
  smollm2_ref recipe; SpecForge's schema defaults; speculators' defaults. Only what the data or this CPU forces is
  set: the teacher's taps, float32, sdpa attention, and for speculators bidirectional attention inside the block
  (its default is causal there, which this project's drafter, and so its evaluator, does not run).

Time per step is (wall time of an S-step run - wall time of a 1-step run) / (S - 1), so start-up, data loading and
export are left out alike for every trainer; peak memory is the training process's maximum RSS (/usr/bin/time) and its peak anonymous memory (RSS minus
file-backed pages, sampled: max RSS also counts the memory-mapped teacher data).
Each peer lives in a virtualenv of its own under <cache>/peers/<peer>/venv (--setup makes it; nothing of theirs is
imported here). Every run folder is resumable: a finished training or evaluation is not redone.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from functools import cached_property
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = {"specforge": "0.2.0", "speculators": "0.9.0"}
TRAINERS = ("ours", "specforge", "speculators")
# What each peer needs besides itself. SpecForge pins sglang (not used for offline training) and torch/transformers
# versions of its own: it installs without its dependency list, then these. speculators installs with its own list;
# the torchvision/torchaudio it pulls break `import transformers` beside a CPU torch and are never used by DFlash.
SPECFORGE_DEPS = ["transformers==5.8.1", "datasets", "tqdm", "accelerate", "huggingface-hub", "numpy",
                  "openai-harmony", "pydantic", "psutil", "pyyaml", "safetensors", "requests", "tensorboard",
                  "typing-extensions", "wandb", "yunchang"]
MATCHED = {"num_layers": 1, "intermediate_size": 768, "block_size": 8, "batch_sequences": 8,
           "anchors_per_sequence": 48, "lr": 1e-3, "warmup_steps": 30, "gamma": 4.0, "grad_clip": 1.0, "seed": 0}


def log(msg: str) -> None:
    print(f"[bench_peers {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list[str], *, log_file: Path | None = None, env: dict | None = None, cwd: Path | None = None,
        memory: dict | None = None) -> float:
    """Run a command (its output to log_file), exit on failure naming the log; returns its wall time. With `memory`,
    also its peak anonymous memory (resident minus file-backed pages, over the process tree, sampled twice a
    second) in memory["peak_anon_gb"]: max RSS alone counts memory-mapped files (the teacher shards) as well."""
    import psutil

    start = time.perf_counter()
    with open(log_file, "a") if log_file else open(os.devnull, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out if log_file else None,
                                stderr=subprocess.STDOUT if log_file else None, env={**os.environ, **(env or {})},
                                cwd=cwd)
        peak = 0
        while proc.poll() is None:
            try:
                tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
                peak = max(peak, sum(m.rss - m.shared for m in (p.memory_info() for p in tree)))
            except psutil.Error:
                pass
            time.sleep(0.5)
    if proc.returncode:
        sys.exit(f"error: {' '.join(map(str, cmd[:6]))} ... exited with {proc.returncode}"
                 + (f"; see {log_file}" if log_file else ""))
    if memory is not None:
        memory["peak_anon_gb"] = peak / 2**30
    return time.perf_counter() - start


# -- the peers' virtualenvs ----------------------------------------------------------------------------------------
def venv_python(peers_dir: Path, peer: str) -> Path:
    return peers_dir / peer / "venv" / "bin" / "python"


def setup(peers_dir: Path, peer: str) -> None:
    """A virtualenv with the peer at its benchmarked version; torch pinned to the CPU build where there is no GPU."""
    folder = peers_dir / peer
    py = venv_python(peers_dir, peer)
    if not py.exists():
        run([sys.executable, "-m", "venv", str(folder / "venv")])
    import torch

    torch_req = f"torch=={torch.__version__.split('+')[0]}"  # the project's own torch: never a second download
    (folder / "constraints.txt").write_text(torch_req + "\n")
    pip = [str(py), "-m", "pip", "install", "-c", str(folder / "constraints.txt")]
    logf = folder / "setup.log"
    log(f"setting up {peer} {VERSIONS[peer]} in {folder / 'venv'} (log: {logf})")
    run(pip + [torch_req], log_file=logf)
    if peer == "specforge":
        run(pip + ["--no-deps", f"specforge=={VERSIONS[peer]}"], log_file=logf)
        run(pip + SPECFORGE_DEPS, log_file=logf)
    else:
        run(pip + [f"speculators=={VERSIONS[peer]}"], log_file=logf)
        run([str(py), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio"], log_file=logf)
    run([str(py), "-c", f"import {peer}"], log_file=logf)
    log(f"{peer} ready")


# -- configuration -------------------------------------------------------------------------------------------------
def compose(overrides: list[str]):
    from hydra import compose as hydra_compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    from dflash_pipeline.conf.schema import register

    register()
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="dflash_pipeline.conf", version_base=None):
        return hydra_compose(config_name="config", overrides=overrides)


def ours_overrides(args, recipe: str, steps: int) -> list[str]:
    """dflash-train overrides of a recipe: smollm2_ref as it is (default), or the matched settings."""
    base = [f"experiment={args.experiment}", f"trainer.data_dir={args.teacher}", f"trainer.steps={steps}",
            f"trainer.eval_every={steps}", f"trainer.save_every={steps}", "logger=none",
            f"trainer.heldout_samples={args.heldout}"]
    if recipe == "default":
        return base
    m = MATCHED
    return base + [f"drafter.num_layers={m['num_layers']}", f"drafter.intermediate_size={m['intermediate_size']}",
                   f"drafter.block_size={m['block_size']}", f"trainer.batch_sequences={m['batch_sequences']}",
                   f"trainer.anchors_per_sequence={m['anchors_per_sequence']}", f"trainer.lr={m['lr']}",
                   f"trainer.warmup_steps={min(m['warmup_steps'], steps - 1)}", "trainer.loss=decay",
                   f"trainer.gamma={m['gamma']}", "trainer.weight_decay=0", "trainer.feature_noise=0",
                   "trainer.draft_vocab_size=null", f"trainer.grad_clip={m['grad_clip']}", f"seed={m['seed']}"]


class Bench:
    """The shared inputs: the teacher data, its training split in each peer's format, the target folder."""

    def __init__(self, args):
        from dflash_pipeline.data.shards import TeacherDataset
        from dflash_pipeline.data.splits import split_heldout
        from dflash_pipeline.models.target_sources import resolve_pretrained

        args.teacher = str(Path(args.teacher).resolve())
        self.args, self.out = args, Path(args.out).resolve()
        self.peers_dir = Path(args.peers_dir).expanduser()
        self.cfg = compose(ours_overrides(args, "matched", 2))
        self.data = TeacherDataset(args.teacher)
        self.train_idx, self.held_idx = split_heldout(self.data.ids, args.heldout)
        self.lengths = [len(self.data[i]["input_ids"]) for i in self.train_idx]
        t = self.cfg.target
        if t.kind == "tiny":  # built in memory: the peers read it from a folder
            self.target_dir = str(self.out / "target")
            if not (self.out / "target" / "config.json").is_file():
                self.target.model.save_pretrained(self.target_dir)
                self.target.tokenizer.save_pretrained(self.target_dir)
        else:
            self.target_dir = resolve_pretrained(t.kind, t.path, t.get("gguf_file"), self.cfg.cache_dir)

    @cached_property
    def target(self):
        """The target, loaded when first needed (a finished bench reads only its records)."""
        from dflash_pipeline.models.target import load_target

        return load_target(self.cfg.target, self.cfg.cache_dir)

    def peer_data(self, peer: str) -> Path:
        """The training split in the peer's format (converted once; data/peers.py says how)."""
        from dflash_pipeline.data import peers

        folder = self.out / "data" / peer
        if folder.is_dir():
            return folder
        samples, dropped = peers.peer_samples(self.data, self.train_idx)
        log(f"converting {len(samples)} training sequences to {peer}'s format ({dropped} without a reply left out)")
        if peer == "specforge":
            return peers.write_specforge(samples, folder)
        final = peers.prenorm_final_hidden(self.target.model, [s["input_ids"].tolist() for s in samples],
                                           pad_id=self.target.tokenizer.pad_token_id)
        # speculators keeps the last rows of its data as a validation split (at least one): a copy of the first
        # training sequence stands there, so every training sequence is trained on
        return peers.write_speculators(samples + samples[:1], final + final[:1], folder)

    @cached_property
    def mask_token_id(self) -> int:
        """This project's MASK token for the target (train/drafter.py: choose_mask_token), given to every trainer."""
        from dflash_pipeline.train.drafter import drafter_config

        return drafter_config(self.cfg, self.target, self.data.layer_ids).mask_token_id

    def drafter_json(self, recipe: str, folder: Path) -> Path:
        """A draft config in this project's export layout (both peers read it): the recipe's drafter shape."""
        from dflash_pipeline.train.drafter import drafter_config

        overrides = ours_overrides(self.args, "matched", 2)
        if recipe == "default":  # the peers' own default shape: the target's MLP width, block 16
            overrides += ["drafter.intermediate_size=null", "drafter.block_size=16"]
        conf = drafter_config(compose(overrides), self.target, self.data.layer_ids)
        d = conf.to_dict()
        # as transformers' Qwen3Config spells it too (speculators reads the file as one): every layer bidirectional
        d.update({"layer_types": ["full_attention"] * conf.num_hidden_layers, "use_sliding_window": False,
                  "sliding_window": None,
                  "rope_parameters": {"rope_type": "default", **(conf.rope_scaling or {}), "rope_theta": conf.rope_theta}})
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "draft_config.json").write_text(json.dumps(d, indent=2))
        return folder / "draft_config.json"


# -- training, one function per trainer: (command, where its export will be) ---------------------------------------
def ours_command(bench: Bench, recipe: str, folder: Path, steps: int) -> tuple[list[str], Path]:
    from dflash_pipeline.runtime.stages import export_dir, recorded_stage_dir

    return ([shutil.which("dflash-train") or "dflash-train", *ours_overrides(bench.args, recipe, steps),
             f"hydra.run.dir={folder}"], export_dir(recorded_stage_dir(folder, "train")))


def specforge_command(bench: Bench, recipe: str, folder: Path, steps: int) -> tuple[list[str], Path]:
    data = bench.peer_data("specforge")
    m, n = MATCHED, len(list(data.glob("*.ckpt")))
    batch = min(n, m["batch_sequences"] if recipe == "matched" else 1)  # SpecForge drops an incomplete batch
    training = {"strategy": "dflash", "attention_backend": "sdpa", "fsdp_sharding": "NO_SHARD", "max_steps": steps,
                "log_interval": 10, "save_interval": steps}
    if recipe == "matched":
        training.update({"batch_size": batch, "num_anchors": m["anchors_per_sequence"],
                         "learning_rate": m["lr"], "lr_scheduler": "cosine",
                         "warmup_ratio": min(m["warmup_steps"], steps - 1) / steps, "max_grad_norm": m["grad_clip"],
                         "loss_decay_gamma": m["gamma"], "seed": m["seed"]})
    training["num_epochs"] = math.ceil(steps / (n // batch)) + 1  # max_steps ends the run
    longest = max(bench.lengths)  # data.max_length truncates: never here
    cfg = {"run_id": "bench", "output_dir": str(folder / "out"),
           "model": {"target_model_path": bench.target_dir, "torch_dtype": "float32",
                     "draft_model_config": str(bench.drafter_json(recipe, folder))},
           "data": {"hidden_states_path": str(data), "max_length": longest, "dataloader_num_workers": 0},
           "training": training}
    (folder / "run.json").write_text(json.dumps(cfg, indent=2))  # YAML is a superset of JSON
    py = venv_python(bench.peers_dir, "specforge")
    return [str(py), "-m", "specforge.cli", "train", "-c", str(folder / "run.json")], folder / "export"


def speculators_command(bench: Bench, recipe: str, folder: Path, steps: int) -> tuple[list[str], Path]:
    data = bench.peer_data("speculators")
    m = MATCHED
    ids = [str(i + 1) for i in bench.data.layer_ids]  # hidden_states indices
    cmd = [str(venv_python(bench.peers_dir, "speculators")), str(ROOT / "scripts" / "peers" / "speculators_cpu.py"),
           "--speculator-type", "dflash", "--verifier-name-or-path", bench.target_dir, "--data-path", str(data),
           "--save-path", str(folder / "ckpt"), "--log-dir", str(folder / "logs"), "--draft-attn-impl", "sdpa",
           "--loss-implementation", "eager", "--num-workers", "0", "--hidden-states-dtype", "float32",
           "--on-missing", "raise", "--target-layer-ids", *ids, "--mask-token-id", str(bench.mask_token_id), "--max-steps", str(steps),
           "--train-data-ratio", str(1 - 0.5 / (len(bench.train_idx) + 1))]
    tokens = sum(bench.lengths)
    if recipe == "matched":
        row = max(max(bench.lengths), int(m["batch_sequences"] * tokens / len(bench.lengths)))  # 8 mean-length rows
        cmd += ["--block-size", str(m["block_size"]), "--draft-config", str(bench.drafter_json(recipe, folder)),
                "--optimizer", "adamw", "--lr", str(m["lr"]), "--weight-decay", "0", "--scheduler-type", "cosine",
                "--scheduler-warmup-steps", str(min(m["warmup_steps"], steps - 1)),
                "--per-position-loss-weight", "fixed-exp-decay", "--dflash-decay-gamma", str(m["gamma"]),
                "--max-anchors", str(m["batch_sequences"] * m["anchors_per_sequence"]), "--total-seq-len", str(row),
                "--seed", str(m["seed"])]
    else:
        row, layers = 8192, 5  # its defaults: packed rows of 8192 tokens, 5 layers
        cmd += ["--full-attention-indices", *map(str, range(layers))]
    # --max-steps only ends the epoch it falls in (each later epoch still runs a step): just enough epochs
    cmd += ["--epochs", str(max(1, math.ceil(steps / max(1, tokens // row))))]
    return cmd, folder / "ckpt"


COMMANDS = {"ours": ours_command, "specforge": specforge_command, "speculators": speculators_command}


def peer_env(peer: str) -> dict:
    """CPU settings for a peer's process: SpecForge picks its device from SPECFORGE_DEVICE (and starts a 1-rank gloo
    group itself); both see no GPU when the project runs on the CPU."""
    import torch

    env = {"PYTHONPATH": ""}
    if not torch.cuda.is_available():
        env.update({"SPECFORGE_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""})
    return env


def train(bench: Bench, trainer: str, recipe: str, steps: int) -> dict:
    """Train (or find trained) one run; its time per step from an S-step and a 1-step run, its peak memory."""
    folder = bench.out / f"{trainer}-{recipe}"
    record = folder / "train.json"
    folder.mkdir(parents=True, exist_ok=True)
    full = COMMANDS[trainer](bench, recipe, folder, steps)  # (command, export) of the S-step run
    command = full[0]
    if record.is_file() and json.loads(record.read_text()).get("command") == command:
        return json.loads(record.read_text())
    shutil.rmtree(folder / "eval", ignore_errors=True)  # another run's evaluation
    times, memory = {}, {}
    for n, sub in ((1, folder / "one-step"), (steps, folder)):
        shutil.rmtree(sub / "out", ignore_errors=True)
        shutil.rmtree(sub / "ckpt", ignore_errors=True)
        shutil.rmtree(sub / "train", ignore_errors=True)
        sub.mkdir(parents=True, exist_ok=True)
        cmd, export = full if sub == folder else COMMANDS[trainer](bench, recipe, sub, n)
        log(f"training {trainer} ({recipe}) for {n} steps: {sub}")
        times[n] = run(["/usr/bin/time", "-v", "-o", str(sub / "time.txt"), *cmd], log_file=sub / "train.log",
                       env=None if trainer == "ours" else peer_env(trainer), memory=memory)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", (folder / "time.txt").read_text())
    result = {"trainer": trainer, "recipe": recipe, "steps": steps, "command": command, "wall_s": times[steps], "one_step_s": times[1],
              "s_per_step": (times[steps] - times[1]) / max(1, steps - 1),
              "peak_rss_gb": int(rss.group(1)) / 2**20 if rss else None, **memory,
              "export": str(project_export(bench, trainer, recipe, folder, export))}
    record.write_text(json.dumps(result, indent=2))
    return result


def project_export(bench: Bench, trainer: str, recipe: str, folder: Path, export: Path) -> Path:
    """The run's drafter in this project's export layout (models/peers.py converts the peers')."""
    if trainer == "ours":
        return export
    from dflash_pipeline.models.peers import to_project

    if trainer == "specforge":
        run([str(venv_python(bench.peers_dir, "specforge")), "-m", "specforge.cli", "export", "--to", "hf",
             "--checkpoint", str(folder / "out"), "--draft-config", str(folder / "draft_config.json"),
             "--output-dir", str(export)], log_file=folder / "export.log", env=peer_env(trainer))
    else:  # the checkpoint of the last epoch
        last = max((p for p in export.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
        state = json.loads((last / "training_state.json").read_text())
        log(f"speculators ran {state['global_step']} steps")
        export = last
    return to_project(trainer, export, folder / "export-project", num_target_layers=bench.target.num_layers,
                      extra_config={"dflash_pipeline": {"teacher_config_hash": bench.data.manifest["config_hash"],
                                                         "trained_by": f"{trainer} {VERSIONS[trainer]}",
                                                         "recipe": recipe}})


# -- evaluation ----------------------------------------------------------------------------------------------------
def evaluate(bench: Bench, result: dict) -> dict:
    """dflash-eval on the run's export: held-out teacher sequences, MT-Bench and HumanEval (chain, exact loop)."""
    a = bench.args
    folder = bench.out / f"{result['trainer']}-{result['recipe']}"
    out = folder / "eval"
    if not (out / "eval_results.json").is_file():
        log(f"evaluating {folder.name}")
        run([shutil.which("dflash-eval") or "dflash-eval", f"experiment={a.experiment}",
             f"trainer.data_dir={a.teacher}", f"trainer.heldout_samples={a.heldout}",
             f"eval.drafter_dir={result['export']}", f"hydra.run.dir={folder}", "eval.out_dir=eval", "logger=none",
             "eval.datasets=[mtbench,humaneval]", "eval.turns=1", f"eval.num_prompts={a.eval_prompts}",
             f"eval.online_prompts={a.online_prompts}", f"eval.max_new_tokens={a.max_new_tokens}",
             "eval.baseline_dtypes=[]", f"eval.cost_repeats={a.cost_repeats}", "eval.methods=[chain]"],
            log_file=folder / "eval.log")
    res = json.loads((out / "eval_results.json").read_text())
    held = res["offline"]["teacher_heldout"] or {}
    row = {"heldout_tau": held.get("tau_offline"), "heldout_ci": held.get("tau_offline_ci95"),
           "heldout_a": held.get("a_k", [])[:3]}
    for name, sets in res["methods"]["chain"].items() if "methods" in res else []:
        row[f"{name}_tau_online"] = sets.get("tau_online")
        row[f"{name}_tau_offline"] = sets.get("tau_offline")
        row[f"{name}_speedup"] = sets.get("speedup")
        row[f"{name}_exact"] = sets.get("exact")
    return row


def loaders(bench: Bench, results: list[dict]) -> list[dict]:
    """This project's exports loaded with each peer's own loader (scripts/peers/load_export.py)."""
    checks = []
    for r in results:
        if r["trainer"] != "ours":
            continue
        for peer in VERSIONS:
            py = venv_python(bench.peers_dir, peer)
            proc = subprocess.run([str(py), str(ROOT / "scripts" / "peers" / "load_export.py"), peer, r["export"],
                                   bench.target_dir], capture_output=True, text=True, env={**os.environ, **peer_env(peer)})
            line = proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 and proc.stdout.strip() else None
            checks.append({"export": f"ours-{r['recipe']}", "peer": peer,
                           **(json.loads(line) if line else {"error": (proc.stderr.strip().splitlines() or ["?"])[-1]})})
    return checks


def table(rows: list[dict]) -> str:
    head = ("| trainer | recipe | steps | held-out tau_offline [95% CI] | a_1 / a_2 / a_3 | MT-Bench tau off / on | "
            "HumanEval tau off / on | exact | s/step | peak RSS (anonymous) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    f = lambda x, d=3: "-" if x is None else f"{x:.{d}f}"
    for r in rows:
        ci = r.get("heldout_ci") or [None, None]
        r = {"heldout_tau": None, "heldout_a": [], **r}
        exact = "-" if not any(k.endswith("_exact") for k in r) else \
            "yes" if all(r[k] for k in r if k.endswith("_exact")) else "NO"
        lines.append(f"| {r['trainer']} | {r['recipe']} | {r['steps']} | {f(r['heldout_tau'])} [{f(ci[0])}, {f(ci[1])}] | "
                     f"{' / '.join(f(a) for a in r['heldout_a'])} | {f(r.get('mtbench_tau_offline'))} / "
                     f"{f(r.get('mtbench_tau_online'))} | {f(r.get('humaneval_tau_offline'))} / "
                     f"{f(r.get('humaneval_tau_online'))} | {exact} | {f(r['s_per_step'], 2)} | "
                     f"{f(r['peak_rss_gb'], 2)} ({f(r.get('peak_anon_gb'), 2)}) GB |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    cache = Path(os.environ.get("DFLASH_CACHE", "~/.cache/dflash-pipeline")).expanduser()
    ap.add_argument("--setup", action="store_true", help="create the peers' virtualenvs and exit")
    ap.add_argument("--peers-dir", default=str(cache / "peers"), help="where the peers' virtualenvs live")
    ap.add_argument("--teacher", help="a finished teacher dataset (teacher.mode=regenerate)")
    ap.add_argument("--experiment", default="smollm2_ref", help="the experiment whose target and recipe are used")
    ap.add_argument("--steps", type=int, default=800, help="optimizer steps of every training run")
    ap.add_argument("--default-steps", type=int, help="steps of the default recipes (default: --steps)")
    ap.add_argument("--heldout", type=int, default=16, help="held-out teacher sequences (trainer.heldout_samples)")
    ap.add_argument("--recipes", nargs="+", default=["matched", "default"], choices=["matched", "default"])
    ap.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=TRAINERS)
    ap.add_argument("--out", default="runs/peers")
    ap.add_argument("--batch-sequences", type=int, default=MATCHED["batch_sequences"],
                    help="matched recipe: sequences per step (speculators: packed rows of this many)")
    ap.add_argument("--anchors", type=int, default=MATCHED["anchors_per_sequence"],
                    help="matched recipe: anchors per sequence")
    ap.add_argument("--skip-eval", action="store_true", help="train only: time per step and peak memory")
    ap.add_argument("--eval-prompts", type=int, default=20, help="prompts per eval set, teacher-forced")
    ap.add_argument("--online-prompts", type=int, default=4, help="of which decoded online (exact loop)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--cost-repeats", type=int, default=6)
    args = ap.parse_args()
    peers_dir = Path(args.peers_dir).expanduser()
    if args.setup:
        for peer in VERSIONS:
            setup(peers_dir, peer)
        return
    if not args.teacher:
        ap.error("--teacher is required (or --setup)")
    missing = [p for p in args.trainers if p != "ours" and not venv_python(peers_dir, p).exists()]
    if missing:
        sys.exit(f"error: no virtualenv for {', '.join(missing)} under {peers_dir}: run "
                 "`python scripts/bench_peers.py --setup` first")
    MATCHED.update(batch_sequences=args.batch_sequences, anchors_per_sequence=args.anchors)
    bench = Bench(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    record = bench.out / "peers.json"
    rows = json.loads(record.read_text())["runs"] if record.is_file() else []  # earlier invocations' runs stay
    for recipe in args.recipes:
        steps = args.default_steps if recipe == "default" and args.default_steps else args.steps
        for trainer in args.trainers:
            result = train(bench, trainer, recipe, steps)
            rows = [r for r in rows if (r["trainer"], r["recipe"]) != (trainer, recipe)]
            rows.append({**result, **({} if args.skip_eval else evaluate(bench, result))})
            (bench.out / "peers.json").write_text(json.dumps({"runs": rows}, indent=2))
    checks = loaders(bench, rows)
    md = table(rows)
    (bench.out / "peers.json").write_text(json.dumps({"runs": rows, "loaders": checks, "versions": VERSIONS}, indent=2))
    (bench.out / "peers.md").write_text(md + "\n\n" + "\n".join(json.dumps(c) for c in checks) + "\n")
    print(md)
    for c in checks:
        print(json.dumps(c))


if __name__ == "__main__":
    main()

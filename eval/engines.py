"""The served ends as pairs of engines on the target, plain and with the exported drafter: vLLM (models/vllm_engine.py)
and llama.cpp (models/llamacpp_engine.py) behind one interface, so that the served eval (eval/served.py) and the
gates (eval/gates.py) never ask which engine runs: start both side by side, `run` greedy (A B B A per prompt, with
the speculative engine's counters), `run_sampled` at temperature > 0 (seeded, unseeded, batched), `close`."""
from __future__ import annotations

from pathlib import Path

from dflash_pipeline.eval.metrics import median
from dflash_pipeline.models import llamacpp_engine
from dflash_pipeline.models.vllm_engine import VLLMEngine, close_engines, speculative_config
from dflash_pipeline.runtime.progress import Progress


class EnginePair:
    """A plain and a speculative engine on the target, open for every eval set of a run; at temperature > 0 only the
    speculative one (plain None). Each engine answers `generate(prompts, max_tokens, stop_token_ids, batch=,
    temperature=, seeds=)` with {"outputs", "seconds", "spec"} and carries `version`, `checks` and `repaired` (its
    self-checks, models/vllm_worker.py); a subclass starts them."""

    name = "engine"
    plain = spec = None
    batches = True  # serves several requests at once (vLLM); llama.cpp's one slot does not
    budgeted = False  # drafts at most the tokens still to generate - 1 per round (llama.cpp; gates.own_counts)
    torch_kernels = True  # runs the target on torch's kernels (vLLM's CPU build): float32 counters match exactly

    def _start(self, start_plain, start_spec, wait: bool = True) -> None:
        """Both engines started side by side (each factory returns one started with wait=False), then waited for;
        a failure closes whichever had started."""
        self.plain = start_plain()
        try:
            self.spec = start_spec()
            for engine in (self.plain, self.spec) if wait else ():
                if engine is not None:
                    engine.ready()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        close_engines(self.plain, getattr(self, "spec", None))

    def files(self) -> dict | None:
        """The files this pair serves that the run converted for it (recorded in the results), if any."""
        return None

    def run_sampled(self, prompts: list[list[int]], max_new_tokens: int, eos_ids, temperature: float,
                    seeds: list[int], batch: int, label: str = "") -> dict:
        """Sampled decodes of `prompts` at batch 1: each prompt once per seed as a seeded request, and as many times
        unseeded; then (batch > 1) the unseeded requests `batch` at a time. Per decode its counters and output;
        per batch its counters (vLLM counts a batch as a whole)."""
        stop = sorted(eos_ids)
        out = {"seeded": [], "unseeded": [], "batched": []}
        bar = Progress(f"served T={temperature} {label}", 2 * len(seeds) * len(prompts), "decode")
        for kind, seed_list in (("seeded", seeds), ("unseeded", [None] * len(seeds))):
            for seed in seed_list:
                for p in prompts:
                    res = self.spec.generate([p], max_new_tokens, stop, temperature=temperature, seeds=[seed])
                    out[kind].append({**res["spec"][0], "output": res["outputs"][0], "seed": seed})
                    bar.update(1)
        bar.close()
        if batch > 1:
            requests = [p for _ in seeds for p in prompts]
            for i in range(0, len(requests), batch):
                res = self.spec.generate(requests[i: i + batch], max_new_tokens, stop, batch=True,
                                         temperature=temperature)
                out["batched"].append(res["spec"][0])
        return out

    def run(self, prompts: list[list[int]], max_new_tokens: int, eos_ids, repeats: int, batch: int,
            label: str = "") -> dict:
        """Greedy decodes of `prompts`: per prompt A B B A (plain, spec, spec, plain) x repeats after a warm-up of
        each, at batch 1; then `batch` prompts at a time, the same order (0: no batched timing). Counters and
        outputs of the first speculative run of each prompt."""
        stop = sorted(eos_ids)
        go = lambda engine, ps, batched=False: engine.generate(ps, max_new_tokens, stop, batch=batched)  # noqa: E731
        go(self.plain, prompts[:1]), go(self.spec, prompts[:1])
        plain_s, spec_s, plain_out, spec_out, counters = [], [], [], [], []
        bar = Progress(f"served {label}", len(prompts), "prompt")
        for p in prompts:
            for r in range(repeats):
                a1, s1, s2, a2 = go(self.plain, [p]), go(self.spec, [p]), go(self.spec, [p]), go(self.plain, [p])
                if r == 0:
                    plain_out.append(a1["outputs"][0])
                    spec_out.append(s1["outputs"][0])
                    counters.append(s1["spec"][0])
                for res, secs in ((a1, plain_s), (a2, plain_s), (s1, spec_s), (s2, spec_s)):
                    secs.append(res["seconds"][0] / max(1, len(res["outputs"][0])))
            bar.update(1)
        bar.close()
        out = {"outputs_plain": plain_out, "outputs_spec": spec_out, "counters": counters,
               "tokens_per_s_plain": 1 / median(plain_s) if plain_s else 0.0,
               "tokens_per_s_spec": 1 / median(spec_s) if spec_s else 0.0}
        out["speedup"] = out["tokens_per_s_spec"] / out["tokens_per_s_plain"] if plain_s else 0.0
        if batch > 1:
            group = (prompts * (batch // len(prompts) + 1))[:batch]  # a full batch even from few prompts
            runs = {"plain": [], "spec": []}
            for engine, key in ((self.plain, "plain"), (self.spec, "spec"), (self.spec, "spec"),
                                (self.plain, "plain")):
                res = go(engine, group, True)
                runs[key].append(sum(len(o) for o in res["outputs"]) / res["seconds"][0])
            out.update(batch=batch, tokens_per_s_plain_batched=median(runs["plain"]),
                       tokens_per_s_spec_batched=median(runs["spec"]))
            out["speedup_batched"] = out["tokens_per_s_spec_batched"] / out["tokens_per_s_plain_batched"]
        return out


class VLLMPair(EnginePair):
    """vLLM engines (models/vllm_engine.py). wait=False returns while the engines build (the first request waits for
    them): several pairs then build side by side."""

    name = "vLLM"

    def __init__(self, cache_dir, target_dir: Path, drafter_dir: Path, dtype: str, block_size: int,
                 max_model_len: int, threads: int, log_file: Path, plain: bool = True,
                 draft_sample_method: str = "greedy", repair: bool = False, wait: bool = True):
        common = dict(model=target_dir, dtype=dtype, max_model_len=max_model_len, threads=threads, log_file=log_file,
                      repair=repair)
        self.block_size, self.drafter_dir = block_size, drafter_dir
        self._start(lambda: VLLMEngine(cache_dir, wait=False, **common) if plain else None,
                    lambda: VLLMEngine(cache_dir, speculative=speculative_config(drafter_dir, block_size,
                                                                                 draft_sample_method),
                                       wait=False, **common), wait)


class LlamaCppPair(EnginePair):
    """llama.cpp: llama-server on the target's GGUF, plain and with the drafter's GGUF (`--spec-type draft-dflash`),
    both converted here by llama.cpp's own converter (models/llamacpp_engine.py), one request at a time."""

    name = "llama.cpp"
    batches = False
    budgeted = True
    torch_kernels = False

    def __init__(self, cache_dir, target_dir: Path, drafter_dir: Path, block_size: int, max_model_len: int,
                 threads: int, log_file: Path, outtype: str = "f32", plain: bool = True):
        self.block_size, self.drafter_dir = block_size, drafter_dir
        folder = Path(cache_dir) / "llamacpp" / "gguf"
        self.target_gguf = llamacpp_engine.to_gguf(cache_dir, target_dir, folder, outtype, log_file=log_file)
        self.drafter_gguf = llamacpp_engine.to_gguf(cache_dir, drafter_dir, folder, outtype, target_dir=target_dir,
                                                    log_file=log_file)
        common = dict(threads=threads, ctx=min(max_model_len, 8192), log_file=log_file, block_size=block_size)
        server = llamacpp_engine.LlamaServer
        self._start(lambda: server(cache_dir, self.target_gguf, wait=False, **common) if plain else None,
                    lambda: server(cache_dir, self.target_gguf, self.drafter_gguf, wait=False, **common))

    def files(self) -> dict:
        return {"target": str(self.target_gguf), "drafter": str(self.drafter_gguf)}

"""A vLLM engine behind a pipe, run by the python of vLLM's own virtual environment (models/vllm_engine.py starts it).

This file imports nothing of the project: vLLM pins a transformers the project cannot use, so it lives in a venv of
its own and this script is all of the project that runs there. Protocol: the first argument is a JSON object of the
engine settings; then one JSON request per line on stdin and one JSON reply per line on the original stdout
(vLLM's own prints go to stderr). Requests:

    {"op": "generate", "prompts": [[ids]], "max_tokens": n, "stop_token_ids": [..], "batch": false,
     "temperature": 0.0, "seeds": null or [seed or null per prompt]}
        -> {"outputs": [[ids]], "seconds": [per request or one for the batch], "spec": [per request counters]}
    {"op": "capture", "prompts": [[ids]], "paths": [file per prompt]}
        -> {"seconds": s}: one prefill of each prompt (one output token, discarded); the tapped layers' states of every
        prompt token written to its file (safetensors: hidden_states (T, taps, H) in the engine's dtype, token_ids
        (T,)), renamed into place when complete. Needs "capture_layers" in the settings.
    {"op": "quit"}

Temperature 0 (the default) is greedy: the project compares every output token for token. Above 0 the request
samples (no top-k / top-p); a seed per prompt makes it a seeded request (vLLM's per-request generator), null leaves
it to the engine's global generator. With "batch": false each prompt is its own generate call (batch 1; its seconds
and its speculative counters are its own); true submits all at once.
With "capture_layers" (vLLM's auxiliary layer ids: the project's tapped layer i is id i + 1) the engine runs vLLM's
`extract_hidden_states` method: the target caches those layers' states per token beside its KV cache, and
FileCapture, a KV connector defined here, copies a finished request's states to its file on the CPU (vLLM's example
connector stages them through pinned CUDA memory, which the CPU build does not have). The engine core runs
in-process (on a CPU always: start_engine() says why), so that the connector registered here is the one it builds.
Only requests that name a file are written.
The states live in cache blocks beside the KV cache, so with prefix caching a capture of a sequence the engine has
just generated reuses the states its generation computed: only the last, partial block is computed again.
Speculative counters are the deltas of LLM.get_metrics() over a call: drafts, draft tokens, accepted tokens and
accepted tokens per draft position (vLLM's spec_decode_* counters).

The ready reply carries vLLM's version and `checks`: probes of engine code the project found wrong, each true when
this engine computes it right. "rejection_temperature": the temperature the rejection sampler divides the target's
logits by at each draft position. vLLM 0.32's CPU build expands it with a C++ fallback that writes into an int64
copy and never back, so the target's probabilities at T > 0 are made with uninitialised memory (docs/results/vllm.md,
'At temperature'). Setting "repair": true replaces that one function with a torch equivalent before the engine is
built (in this process: vLLM's engine core then runs in-process) and reports it in "repaired".
"""
import json
import os
import sys
import time


def counters(llm) -> dict:
    """vLLM's cumulative speculative-decoding counters (all zero without a drafter)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            values = list(m.values)
            acc = out["accepted_per_pos"]
            out["accepted_per_pos"] = [a + b for a, b in zip(acc + [0] * len(values), values)]
    return out


def delta(after: dict, before: dict) -> dict:
    per_pos = before["accepted_per_pos"] + [0] * (len(after["accepted_per_pos"]) - len(before["accepted_per_pos"]))
    return {"drafts": after["drafts"] - before["drafts"], "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
            "accepted": after["accepted"] - before["accepted"],
            "accepted_per_pos": [a - b for a, b in zip(after["accepted_per_pos"], per_pos)]}


def expand_ok() -> bool:
    """Whether the rejection sampler's per-draft expansion of per-request values (temperature, top-k, top-p) is
    right here, with the kernels and overrides the engine itself registers."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler as rs
    current_platform.import_kernels()
    if hasattr(current_platform, "register_triton_kernel_overrides"):
        current_platform.register_triton_kernel_overrides()
    got = rs.expand_batch_to_tokens(torch.tensor([0.7, 1.0]), torch.tensor([2, 3], dtype=torch.int32), 3,
                                    replace_from=rs.GREEDY_TEMPERATURE, replace_to=1)
    return got.tolist() == torch.tensor([0.7, 0.7, 1.0]).tolist()


def repair_expand() -> None:
    """The expansion in torch: each request's value repeated over its draft tokens, `replace_from` mapped first."""
    import torch
    from vllm.v1.sample import rejection_sampler as rs

    def expand(x, cu_num_tokens, num_tokens, replace_from=0, replace_to=0):
        counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
        x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
        return x.repeat_interleave(counts, output_size=num_tokens)

    rs.expand_batch_to_tokens = expand


def register_file_capture() -> None:
    """Define FileCapture (module attribute, so vLLM's connector factory finds it by name) and register it."""
    import torch
    from safetensors.torch import save_file
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as example

    class FileCapture(example.ExampleHiddenStatesConnector):
        """The example connector's bookkeeping with a synchronous CPU copy: extract, write, rename, done."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._written: set[str] = set()  # requests written since the last get_finished

        def request_finished(self, request, block_ids):
            if not (request.kv_transfer_params or {}).get("hidden_states_path"):
                self._request_filenames.pop(request.request_id, None)
                return False, None  # a reply request: nothing to keep, free its blocks now
            return super().request_finished(request, block_ids)

        def _submit_async_write(self, pending) -> None:
            if not self._is_tp_rank_zero:
                return
            blocks = torch.tensor(pending.block_ids, dtype=torch.long)
            slots = (torch.arange(self._block_size)[None] + blocks[:, None] * self._block_size).flatten()
            states = example.extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0])
            states = states.to("cpu", copy=True)  # off the cache (and off a GPU) before its blocks are freed
            tmp = pending.filename + ".part"
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, tmp)
            os.replace(tmp, pending.filename)
            self._written.add(pending.req_id)

        def get_finished(self, finished_req_ids):
            if self.has_connector_metadata():
                meta = self._get_connector_metadata()
                if isinstance(meta, example.ExampleHiddenStatesConnectorMetadata):
                    for pending in meta.pending_saves:
                        self._submit_async_write(pending)
            done, self._written = self._written, set()
            return done or None, None

    globals()["FileCapture"] = FileCapture
    KVConnectorFactory.register_connector("FileCapture", __name__, "FileCapture")


def main() -> None:
    settings = json.loads(sys.argv[1])
    reply_fd = os.dup(1)  # the protocol's channel; everything printed from here on goes to stderr
    os.dup2(2, 1)
    replies = os.fdopen(reply_fd, "w", buffering=1)

    llm, ready = start_engine(settings)
    replies.write(json.dumps(ready) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        reply = capture(llm, req) if req["op"] == "capture" else generate(llm, req)
        replies.write(json.dumps(reply) + "\n")


def start_engine(settings: dict):
    """vLLM's LLM built on the settings, and the ready reply. The engine code is probed (and with "repair" mended)
    before the engine is built, so that the engine runs what the checks report."""
    capture_layers = settings.get("capture_layers")
    import torch

    # The engine core and its worker run in this process: what is patched or registered here (repair, FileCapture)
    # must be what the engine core runs, and on a CPU vLLM's default of one process each (three python processes,
    # each importing vLLM) starts 2.3x slower and decodes slower (20.3 s vs 8.8 s to ready, 440 vs 340 ms for 128
    # tokens of the tiny target on 2 Zen 4 cores). A GPU keeps vLLM's own processes unless this process patches.
    if settings.get("repair") or capture_layers or not torch.cuda.is_available():
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import vllm
    from vllm import LLM

    checks = {"rejection_temperature": expand_ok()}
    repaired = []
    if settings.get("repair") and not checks["rejection_temperature"]:
        repair_expand()
        repaired.append("rejection_temperature")
    if capture_layers:
        register_file_capture()
    llm = LLM(**engine_args(settings))
    return llm, {"ready": True, "version": vllm.__version__, "checks": checks, "repaired": repaired}


def engine_args(settings: dict) -> dict:
    """LLM's keyword arguments: eager, seeded, with statistics (the speculative counters); with "capture_layers" the
    extract_hidden_states method and the FileCapture connector (registered first: register_file_capture)."""
    kwargs = dict(model=settings["model"], dtype=settings["dtype"], max_model_len=settings["max_model_len"],
                  enforce_eager=True, seed=0, disable_log_stats=False, max_num_seqs=settings.get("max_num_seqs", 64))
    if settings.get("speculative"):
        kwargs["speculative_config"] = settings["speculative"]
    if settings.get("capture_layers"):
        kwargs["speculative_config"] = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                        "draft_model_config": {"hf_config": {
                                            "eagle_aux_hidden_state_layer_ids": settings["capture_layers"]}}}
        kwargs["kv_transfer_config"] = {"kv_connector": "FileCapture", "kv_role": "kv_producer",
                                        "kv_connector_extra_config": {"allow_custom_save_path": True,
                                                                      "use_synchronization_lock": False}}
        # prefix caching on: the states sit in cache blocks like the KV, so a capture of a sequence the engine has
        # just generated reads the states generation computed, and only its last, partial block is computed again
        kwargs["enable_prefix_caching"] = True
    return kwargs


def capture(llm, req: dict) -> dict:
    """The capture request: one prefill of each prompt (one discarded output token), waiting until FileCapture has
    written every prompt's file."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    params = [SamplingParams(temperature=0.0, max_tokens=1, detokenize=False,
                             extra_args={"kv_transfer_params": {"hidden_states_path": path}})
              for path in req["paths"]]
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in req["prompts"]], params, use_tqdm=False)
    for _ in range(100):  # a finished request's states are written on the engine's next step
        if all(os.path.exists(path) for path in req["paths"]):
            break
        llm.llm_engine.step()
    return {"seconds": time.perf_counter() - t0}


def generate(llm, req: dict) -> dict:
    """The generate request: replies, seconds and speculative counters per generate call (one per prompt, or one
    for the whole batch with "batch": true)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    seeds = req.get("seeds") or [None] * len(req["prompts"])
    params = [SamplingParams(temperature=req.get("temperature", 0.0), seed=seed, max_tokens=req["max_tokens"],
                             stop_token_ids=req["stop_token_ids"], detokenize=False) for seed in seeds]
    prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
    groups = [list(range(len(prompts)))] if req.get("batch") else [[i] for i in range(len(prompts))]
    outputs, seconds, spec = [], [], []
    for group in groups:
        before = counters(llm)
        t0 = time.perf_counter()
        done = llm.generate([prompts[i] for i in group], [params[i] for i in group], use_tqdm=False)
        seconds.append(time.perf_counter() - t0)
        spec.append(delta(counters(llm), before))
        outputs += [list(o.outputs[0].token_ids) for o in done]
    return {"outputs": outputs, "seconds": seconds, "spec": spec}


if __name__ == "__main__":
    main()

"""A vLLM engine behind a pipe, run by the python of vLLM's own virtual environment (models/vllm_engine.py starts it).

This file imports nothing of the project: vLLM pins a transformers the project cannot use, so it lives in a venv of
its own and this script is all of the project that runs there. Protocol: the first argument is a JSON object of the
engine settings; then one JSON request per line on stdin and one JSON reply per line on the original stdout
(vLLM's own prints go to stderr). Requests:

    {"op": "generate", "prompts": [[ids]], "max_tokens": n, "stop_token_ids": [..], "batch": false}
        -> {"outputs": [[ids]], "seconds": [per request or one for the batch], "spec": [per request counters]}
    {"op": "quit"}

Greedy only (temperature 0): the project compares every output token for token. With "batch": false each prompt is
its own generate call (batch 1; its seconds and its speculative counters are its own); true submits all at once.
Speculative counters are the deltas of LLM.get_metrics() over a call: drafts, draft tokens, accepted tokens and
accepted tokens per draft position (vLLM's spec_decode_* counters).
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


def main() -> None:
    settings = json.loads(sys.argv[1])
    reply_fd = os.dup(1)  # the protocol's channel; everything printed from here on goes to stderr
    os.dup2(2, 1)
    replies = os.fdopen(reply_fd, "w", buffering=1)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=settings["model"], dtype=settings["dtype"], max_model_len=settings["max_model_len"],
                  enforce_eager=True, seed=0, disable_log_stats=False, max_num_seqs=settings.get("max_num_seqs", 64))
    if settings.get("speculative"):
        kwargs["speculative_config"] = settings["speculative"]
    llm = LLM(**kwargs)
    replies.write(json.dumps({"ready": True}) + "\n")

    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "quit":
            break
        params = SamplingParams(temperature=0.0, max_tokens=req["max_tokens"], stop_token_ids=req["stop_token_ids"],
                                detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in req["prompts"]]
        groups = [prompts] if req.get("batch") else [[p] for p in prompts]
        outputs, seconds, spec = [], [], []
        for group in groups:
            before = counters(llm)
            t0 = time.perf_counter()
            done = llm.generate(group, params, use_tqdm=False)
            seconds.append(time.perf_counter() - t0)
            spec.append(delta(counters(llm), before))
            outputs += [list(o.outputs[0].token_ids) for o in done]
        replies.write(json.dumps({"outputs": outputs, "seconds": seconds, "spec": spec}) + "\n")


if __name__ == "__main__":
    main()

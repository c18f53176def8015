"""vLLM's own DFlash2 modules on an export, run by the python of vLLM's virtual environment (eval/engine_parity.py
starts it): the engine's side of the DFlash2 parity check.

Like models/vllm_worker.py, this file imports nothing of the project. It builds vLLM's `DFlashGroupedConv` (its
CPU path: the Triton kernel is CUDA-only) for every layer's `attention_conv` / `mlp_conv` and vLLM's
`CandidateSelector`, loads the export's tensors into them through vLLM's weight loaders, and runs them on the
inputs the project wrote.

    python models/vllm_dflash2.py EXPORT_DIR INPUTS.safetensors OUT.safetensors BLOCK_SIZE

Inputs: `x.{i}.{conv}` and `y.{i}.{conv}` (rows, H): a sublayer's input and output, blocks of BLOCK_SIZE rows one
after another; `cand_ids` (N, P, K) int64, `U` (N, P, K), `hidden` (N, P, H), `anchors` (N,) int64.
Outputs: `prepared.{i}.{conv}` (conv.prepare's hidden), `deltas.{i}.{conv}` (its second return),
`finished.{i}.{conv}` (conv.finish(y, deltas)), `scores` (N, P, K, K): the selector's edge scores, row a of
position t the candidates' scores after predecessor a (position 0: every row the anchor).
"""
import json
import os
import sys
import tempfile


def load(module, tensors: dict) -> None:
    """The export's tensors into a vLLM module by its own weight loaders, then its post-load processing (on CPU a
    linear layer prepares its GEMM there)."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    params = dict(module.named_parameters())
    if set(params) != set(tensors):
        raise SystemExit(f"tensors {sorted(tensors)} do not match vLLM's parameters {sorted(params)}")
    for name, param in params.items():
        getattr(param, "weight_loader", default_weight_loader)(param, tensors[name])
    for sub in module.modules():
        method = getattr(sub, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(sub)


def main(export: str, inputs_file: str, out_file: str, block_size: int) -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.models import qwen3_dflash2

    with open(os.path.join(export, "config.json")) as f:
        config = json.load(f)
    if config.get("architectures") != ["DFlash2DraftModel"]:
        raise SystemExit(f"{export} is not a DFlash2DraftModel export: {config.get('architectures')}")
    dc, H = config["dflash_config"], config["hidden_size"]
    weights, inputs, out = load_file(os.path.join(export, "model.safetensors")), load_file(inputs_file), {}
    vllm_config = VllmConfig()
    with set_current_vllm_config(vllm_config), tempfile.TemporaryDirectory() as tmp:
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tmp}/rendezvous")
        initialize_model_parallel(1, 1)
        with torch.no_grad():
            for i in range(config["num_hidden_layers"]):
                for name in ("attention_conv", "mlp_conv"):
                    prefix = f"layers.{i}.{name}"
                    conv = qwen3_dflash2.DFlashGroupedConv(
                        hidden_size=H, taps=int(dc["conv_kernel_size"]), group_size=int(dc["conv_group_size"]),
                        block_size=block_size, params_dtype=torch.float32, prefix=prefix)
                    load(conv, {k[len(prefix) + 1:]: v for k, v in weights.items() if k.startswith(prefix + ".")})
                    key = f"{i}.{name}"
                    out[f"prepared.{key}"], out[f"deltas.{key}"] = conv.prepare(inputs[f"x.{key}"])
                    out[f"finished.{key}"] = conv.finish(inputs[f"y.{key}"], out[f"deltas.{key}"])
            selector = qwen3_dflash2.CandidateSelector(
                hidden_size=H, vocab_size=config["vocab_size"], rank=int(dc["selector_rank"]),
                top_k=int(dc["selector_top_k"]), params_dtype=torch.float32, prefix="candidate_selector")
            load(selector, {k[len("candidate_selector."):]: v for k, v in weights.items()
                            if k.startswith("candidate_selector.")})
            out["scores"] = selector(inputs["cand_ids"], inputs["U"], inputs["hidden"], inputs["anchors"])
    save_file({k: v.contiguous() for k, v in out.items()}, out_file)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))

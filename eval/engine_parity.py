"""DFlash2's math against the engine's own: the grouped convolution and the selector's edge scores of one export,
computed by this project's modules and by vLLM's (models/vllm_dflash2.py, run in vLLM's venv: its CPU path), on
the same random inputs, float32.

vLLM's CPU build cannot run DFlash2 end to end (its DFlash2 proposer lives in the GPU model runner; on CPU it
refuses "DFlash candidate-head drafts"), so this checks the pieces it would run: every layer's `attention_conv`
and `mlp_conv` (prepare and finish), the selector's K x K edge scores, and the engine's greedy walk over them
(its kernel's indexing, written out here) against the project's `greedy_walk`. Planted mismatches show the
comparison can fail: our modules with the taps reversed, the two sides swapped, the group size doubled, the
convolution running across block boundaries, and the selector's codebooks swapped.

    python scripts/dflash2_parity.py EXPORT_DIR
"""
from __future__ import annotations

import copy
import json
import subprocess
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dflash_pipeline.models.drafter import GroupedConv
from dflash_pipeline.models.selector import SELECTOR_PREFIX, PairSelector
from dflash_pipeline.models.vllm_engine import VLLMError, vllm_python

ENGINE_SIDE = Path(__file__).resolve().parent.parent / "models" / "vllm_dflash2.py"
TOLERANCE = 1e-5  # max |ours - vLLM's| / max |vLLM's|, float32
CONVS = ("attention_conv", "mlp_conv")


def load_modules(export: Path) -> tuple[dict, dict[str, GroupedConv], PairSelector]:
    """(config.json, {"{layer}.{conv}": GroupedConv}, PairSelector) of a DFlash2 export."""
    config = json.loads((export / "config.json").read_text())
    if config.get("architectures") != ["DFlash2DraftModel"]:
        raise ValueError(f"{export} is not a DFlash2DraftModel export (architectures {config.get('architectures')}): "
                         "train with drafter.conv_kernel_size > 0 or a selector over the full vocabulary")
    dc, H, tensors = config["dflash_config"], config["hidden_size"], load_file(str(export / "model.safetensors"))
    convs = {}
    for i in range(config["num_hidden_layers"]):
        for name in CONVS:
            conv = GroupedConv(H, dc["conv_kernel_size"], dc["conv_group_size"], config["block_size"])
            prefix = f"layers.{i}.{name}."
            conv.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
            convs[f"{i}.{name}"] = conv
    selector = PairSelector(config["vocab_size"], H, dc["selector_rank"], dc["selector_top_k"])
    selector.load_state_dict({k[len(SELECTOR_PREFIX):]: v for k, v in tensors.items() if k.startswith(SELECTOR_PREFIX)})
    return config, convs, selector


def shared_inputs(config: dict, convs: dict, selector: PairSelector, blocks: int, seed: int) -> dict:
    """Random inputs both sides run on: per convolution a sublayer input x and output y of `blocks` blocks; for the
    selector K distinct candidates per position, their logits U in descending order, hidden states and anchors."""
    g = torch.Generator().manual_seed(seed)
    B, H, V, K = config["block_size"], config["hidden_size"], config["vocab_size"], selector.top_k
    inputs = {}
    for key in convs:
        inputs[f"x.{key}"] = torch.randn(blocks * B, H, generator=g)
        inputs[f"y.{key}"] = torch.randn(blocks * B, H, generator=g)
    P = B - 1
    inputs["cand_ids"] = torch.stack([torch.randperm(V, generator=g)[:K] for _ in range(blocks * P)]).view(blocks, P, K)
    inputs["U"] = torch.randn(blocks, P, K, generator=g).sort(-1, descending=True).values
    inputs["hidden"] = torch.randn(blocks, P, H, generator=g)
    inputs["anchors"] = torch.randint(0, V, (blocks,), generator=g)
    return inputs


def run_engine(export: Path, inputs: dict, block_size: int, cache_dir) -> dict:
    """vLLM's outputs on `inputs` (models/vllm_dflash2.py in vLLM's venv)."""
    python = vllm_python(cache_dir)
    with tempfile.TemporaryDirectory() as tmp:
        save_file(inputs, f"{tmp}/inputs.safetensors")
        done = subprocess.run([str(python), str(ENGINE_SIDE), str(export), f"{tmp}/inputs.safetensors",
                               f"{tmp}/out.safetensors", str(block_size)], capture_output=True, text=True)
        if done.returncode:
            raise VLLMError(f"vLLM's DFlash2 modules failed on {export}: {done.stderr.strip().splitlines()[-1:]}")
        return load_file(f"{tmp}/out.safetensors")


@torch.no_grad()
def our_outputs(convs: dict, selector: PairSelector, inputs: dict) -> dict:
    out = {}
    for key, conv in convs.items():
        out[f"prepared.{key}"], out[f"deltas.{key}"] = conv.prepare(inputs[f"x.{key}"])
        out[f"finished.{key}"] = conv.finish(inputs[f"y.{key}"], out[f"deltas.{key}"])
    cand, anchors = inputs["cand_ids"], inputs["anchors"]
    K = cand.shape[-1]
    prev = torch.cat([anchors[:, None, None].expand(-1, 1, K), cand[:, :-1]], 1)  # row t: the candidates of t - 1
    out["scores"] = selector.scores(inputs["U"], inputs["hidden"], prev, cand)
    out["walk"] = selector.greedy_walk(cand, inputs["U"], inputs["hidden"], anchors)
    return out


def engine_walk(scores: torch.Tensor, cand_ids: torch.Tensor) -> torch.Tensor:
    """vLLM's greedy selector walk (its Triton kernel's indexing): at position t the candidates' scores in row
    `previous` (0 at the first position, whose rows all hold the anchor), the argmax becomes the next `previous`."""
    N, P, K, _ = scores.shape
    tokens = torch.empty(N, P, dtype=torch.long)
    for n in range(N):
        previous = 0
        for t in range(P):
            previous = int(scores[n, t, previous].argmax())
            tokens[n, t] = cand_ids[n, t, previous]
    return tokens


def relative_error(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    if ours.shape != theirs.shape:  # e.g. deltas of another group count
        return float("inf")
    return float((ours.float() - theirs.float()).abs().max() / theirs.float().abs().max().clamp_min(1e-30))


def planted(convs: dict, selector: PairSelector, blocks: int) -> dict[str, tuple[dict, PairSelector]]:
    """Our modules with one mistake each, as an exporter or a reader could make it."""
    def each(change):
        changed = {k: copy.deepcopy(c) for k, c in convs.items()}
        for conv in changed.values():
            change(conv)
        return changed, selector

    def reverse_taps(conv):
        w = conv.kernel_projection.weight.data.view(2, conv.kernel_size, conv.num_groups, -1)
        conv.base_kernel.data = conv.base_kernel.data.flip(1)
        conv.kernel_projection.weight.data = w.flip(1).reshape(-1, w.shape[-1])

    def swap_sides(conv):
        conv.base_kernel.data = conv.base_kernel.data.flip(0)
        conv.kernel_projection.weight.data = conv.kernel_projection.weight.data.view(2, -1, conv.base_kernel.shape[-1]
                                                                                     ).flip(0).reshape_as(
            conv.kernel_projection.weight)

    def double_groups(conv):  # each delta shared by twice the channels (every other group's projection rows)
        w = conv.kernel_projection.weight.data.view(2, conv.kernel_size, conv.num_groups, -1)[:, :, ::2]
        conv.group_size, conv.num_groups = conv.group_size * 2, w.shape[2]
        conv.kernel_projection = torch.nn.Linear(w.shape[-1], w[..., 0].numel(), bias=False)
        conv.kernel_projection.weight.data = w.reshape(-1, w.shape[-1])

    def across_blocks(conv):
        conv.block_size = conv.block_size * blocks

    swapped = copy.deepcopy(selector)
    swapped.predecessor_codebook.data, swapped.successor_codebook.data = (selector.successor_codebook.data,
                                                                          selector.predecessor_codebook.data)
    plants = {"taps reversed": each(reverse_taps), "sides swapped": each(swap_sides),
              "across block boundaries": each(across_blocks), "codebooks swapped": (convs, swapped)}
    if all(c.num_groups % 2 == 0 for c in convs.values()):
        plants["group size doubled"] = each(double_groups)
    return plants


def compare(ours: dict, theirs: dict, inputs: dict) -> dict:
    """Per output kind the worst relative error, and whether the walks pick the same tokens."""
    errors: dict[str, float] = {}
    for key, value in theirs.items():
        kind = key.split(".")[0]
        errors[kind] = max(errors.get(kind, 0.0), relative_error(ours[key], value))
    return {"errors": errors, "walk_equal": bool(torch.equal(ours["walk"], engine_walk(theirs["scores"],
                                                                                        inputs["cand_ids"])))}


def agrees(result: dict) -> bool:
    return result["walk_equal"] and all(e <= TOLERANCE for e in result["errors"].values())


def parity(export: Path, cache_dir, blocks: int = 3, seed: int = 0) -> dict:
    """{"engine": compare(ours, vLLM's), "plants": {name: compare(planted, vLLM's)}, "agrees": bool,
    "caught": {name: bool}} for one DFlash2 export."""
    export = Path(export)
    config, convs, selector = load_modules(export)
    inputs = shared_inputs(config, convs, selector, blocks, seed)
    theirs = run_engine(export, inputs, config["block_size"], cache_dir)
    result = {"engine": compare(our_outputs(convs, selector, inputs), theirs, inputs), "plants": {}}
    for name, (changed, sel) in planted(convs, selector, blocks).items():
        result["plants"][name] = compare(our_outputs(changed, sel, inputs), theirs, inputs)
    result["agrees"] = agrees(result["engine"])
    result["caught"] = {name: not agrees(r) for name, r in result["plants"].items()}
    return result

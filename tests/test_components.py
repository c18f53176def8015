"""The catalogue contract: every registered component trains on tiny, resumes to the losses of an uninterrupted run,
exports, and its export reloads into the eval methods it brings; plus the selector's speculative sampling."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chi2
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_pipeline.eval.decode import speculative
from dflash_pipeline.models.drafter import DFlashDrafter, DFlashDrafterConfig
from dflash_pipeline.models.selector import PairSelector
from dflash_pipeline.models.target import load_target
from dflash_pipeline.train import catalogue
from dflash_pipeline.train.loop import run_train
from dflash_pipeline.train.selector import SelectorMethod

from conftest import make_config, metrics


@pytest.fixture(scope="module")
def tiny_drafter_run(tiny_teacher, tmp_path_factory):
    """A trained tiny drafter stage (the frozen drafter of the other components)."""
    out = tmp_path_factory.mktemp("drafter") / "train"
    return run_train(make_config("trainer.steps=2"), out, data_dir=tiny_teacher)


@pytest.mark.parametrize("name", list(catalogue.COMPONENTS))
def test_every_component_trains_resumes_exports_and_reloads(name, tiny_teacher, tiny_drafter_run, tmp_path):
    own = [] if name == "drafter" else [f"{name}.warmup_steps=0"]
    steps = "trainer.steps" if name == "drafter" else f"{name}.steps"

    def train(folder, *extra):
        out = folder if name == "drafter" else folder / name
        return run_train(make_config(*own, "trainer.save_every=1", *extra), out, data_dir=tiny_teacher,
                         component=name, drafter_dir=None if name == "drafter" else tiny_drafter_run / "export")

    straight = train(tmp_path / "straight", f"{steps}=2")
    train(tmp_path / "resumed", f"{steps}=1")
    resumed = train(tmp_path / "resumed", f"{steps}=2", "trainer.resume=true")
    losses = [[row["loss"] for row in metrics(run)] for run in (straight, resumed)]
    assert len(losses[0]) == 2 and losses[1] == pytest.approx(losses[0], rel=1e-5)

    export = resumed / "export"
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()
    cfg = make_config()
    tgt = load_target(cfg.target, cfg.cache_dir).model
    drafter = DFlashDrafter.from_pretrained(str(export if name == "drafter" else tiny_drafter_run / "export"),
                                            tgt.get_input_embeddings(), tgt.get_output_embeddings())
    methods = {m: entry for m, (owner, entry) in catalogue.methods().items() if owner == name}
    assert methods, f"{name} brings no eval method"
    for method_name, entry in methods.items():
        if entry.also_needs:  # uses another component's export too: covered by the tiny pipeline test
            continue
        method = entry.make(drafter, {} if name == "drafter" else {name: export})
        ids = torch.randint(0, drafter.config.vocab_size, (3, drafter.config.block_size - 1, method.top_k))
        hidden = torch.randn(3, drafter.config.block_size, drafter.config.hidden_size)
        tokens, _ = method.path(ids, torch.randn(ids.shape), hidden, torch.tensor([1, 2, 3]))
        assert tokens.shape == (3, drafter.config.block_size - 1)
    if name != "drafter":  # the drafter's tensors travel with the component's, unchanged
        mine, base = load_file(str(export / "model.safetensors")), load_file(str(tiny_drafter_run / "export" /
                                                                                 "model.safetensors"))
        assert all(torch.equal(mine[k], v) for k, v in base.items()) and set(mine) > set(base)


def test_selector_sampling_keeps_the_target_distribution():
    """As the chain's test (tests/test_eval.py): the joint of the first 3 sampled tokens against the target's exact
    joint, with the selector walking over the top-4 of 6 tokens with strong random pair scores."""
    V, T, N = 6, 1.0, 2000
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.3, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()
    tgt = SimpleNamespace(model=model, eos_ids=set())
    conf = DFlashDrafterConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64, vocab_size=V, block_size=3,
        target_hidden_size=32, target_layer_ids=[0], num_target_layers=2, mask_token_id=V - 1)
    drafter = DFlashDrafter(conf, model.get_input_embeddings(), model.get_output_embeddings()).eval()
    selector = PairSelector(V, 32, rank=8, top_k=4)
    with torch.no_grad():
        selector.successor_codebook.normal_(0, 1.0)
    method = SelectorMethod(drafter, selector.eval(), "greedy")
    prompt = [1, 2, 3, 0]
    P = len(prompt)
    with torch.no_grad():
        seqs = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        probs = torch.softmax(model(input_ids=seqs).logits.double() / T, -1)
    joint = (probs[0, P - 1][:, None, None] * probs[:, P].view(V, V, V)[:, 0][:, :, None]
             * probs[:, P + 1].view(V, V, V)).flatten()
    gen = torch.Generator().manual_seed(3)
    counts, accepted = torch.zeros(V ** 3, dtype=torch.float64), []
    for _ in range(N):
        res = speculative(tgt, method, prompt, 3, 3, temperature=T, generator=gen)
        a, b, c = res.tokens
        counts[(a * V + b) * V + c] += 1
        accepted += res.accepted
    hist = torch.bincount(torch.tensor(accepted), minlength=3).tolist()
    assert min(hist) > 0.05 * len(accepted), f"rejections and acceptances must both occur: {hist}"
    expected = joint * N
    big = expected >= 5
    e = torch.cat([expected[big], expected[~big].sum()[None]])
    o = torch.cat([counts[big], counts[~big].sum()[None]])
    stat = float(((o - e) ** 2 / e).sum())
    assert chi2.sf(stat, len(e) - 1) > 1e-3, f"chi2 {stat:.1f} on {len(e) - 1} dof"

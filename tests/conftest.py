"""Shared fixtures: the REAL config composed with Hydra (experiment=tiny) and a teacher dataset built once."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module
from hydra.core.global_hydra import GlobalHydra

from dflash_pipeline.conf.schema import register

from allowed_skips import pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401  (CI's skip policy)

os.environ.setdefault("WANDB_MODE", "offline")
register()


def pytest_configure(config):
    """Under pytest-xdist (`-n 2`, the README's test command) each worker is one of the cores' worth of work: torch and
    the processes tests start use one thread, and vLLM engines are not pinned to core 0 (where every worker's engine
    would otherwise meet)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        os.environ["OMP_NUM_THREADS"] = "1"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        torch.set_num_threads(1)


# The modules holding the longest runs (vLLM engines, each family's pipeline): collected first. Under
# `--dist loadscope` each module runs whole on one worker (its module fixtures built once) and modules are handed out
# in collection order, so the two workers start on the long ones and end together.
# test_llamacpp (its tiny_llamacpp run and the DFlash2 walk, about 300 s in all) is among them.
LONGEST_FIRST = ("test_served", "test_targets", "test_llamacpp", "test_producer", "test_pipeline", "test_sweeps",
                 "test_train")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__, len(rank)))  # stable: each module's order kept


def make_config(*overrides: str, return_hydra_config: bool = False):
    """Compose conf/config.yaml with experiment=tiny and the given overrides, as the console scripts do."""
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="dflash_pipeline.conf", version_base=None):
        return compose(config_name="config", overrides=["experiment=tiny", *overrides],
                       return_hydra_config=return_hydra_config)


@pytest.fixture(scope="module")
def target():
    """The tiny target, with torch at one thread while the module's tests use it: batch-1 decoding of tiny models is
    dominated by thread synchronisation on a busy 2-core machine."""
    import torch

    from dflash_pipeline.models.target import load_target

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    cfg = make_config()
    yield load_target(cfg.target, cfg.cache_dir)
    torch.set_num_threads(before)


def chat_prompt_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text as a one-turn chat prompt, token ids, as the eval stage builds them."""
    return [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                                    tokenize=False), add_special_tokens=False)["input_ids"]
            for t in texts]


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory) -> Path:
    """A finished tiny teacher dataset (8 samples, 2 shards, 2 turns, top-k log-probs)."""
    from dflash_pipeline.data.teacher import run_teacher

    out = tmp_path_factory.mktemp("tiny") / "teacher"
    return run_teacher(make_config(), out)


ROOT = Path(__file__).parents[1]


def user_env() -> dict:
    """The environment of the commands tests run: wandb offline, one thread per process (several processes share
    the machine)."""
    return dict(os.environ, WANDB_MODE="offline", OMP_NUM_THREADS="1")


def run_command(cmd: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    """Run a command from the repository root as a user would; fail the test with its stderr when it fails."""
    proc = subprocess.run(cmd, cwd=ROOT, env=user_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def free_port() -> int:
    """A TCP port free on this machine now: each launch its own rendezvous, so launches of parallel test workers
    (pytest -n) never meet on accelerate's default 29500."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def accelerate_launch(n: int, *module_and_args: str, config_file: Path | None = None) -> list[str]:
    """`accelerate launch` with n CPU processes (gloo when n > 1), e.g. accelerate_launch(2, "-m",
    "dflash_pipeline.train", ...); with `config_file`, the launch it describes (e.g.
    scripts/accelerate/cpu_2proc_fsdp.yaml)."""
    how = ["--config_file", str(config_file)] if config_file else [
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
        *(["--multi_gpu"] if n > 1 else [])]
    return [sys.executable, "-m", "accelerate.commands.launch", *how, "--num_processes", str(n),
            "--main_process_port", str(free_port()), *module_and_args]


def metrics(train_dir: Path) -> list[dict]:
    """The rows a training run logged to metrics.jsonl."""
    return [json.loads(line) for line in (train_dir / "metrics.jsonl").read_text().splitlines()]


def sampling_case(V: int = 6, T: float = 1.0):
    """A 6-token random target, a 1-layer drafter on it with block 3, a prompt, and the target's exact joint
    distribution of the first 3 sampled tokens (V**3 cells): the ground truth of speculative sampling tests."""
    from types import SimpleNamespace

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from dflash_pipeline.models.drafter import DFlashDrafter, DFlashDrafterConfig

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64, initializer_range=0.3, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()
    conf = DFlashDrafterConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=64, vocab_size=V, block_size=3,
        target_hidden_size=32, target_layer_ids=[0], num_target_layers=2, mask_token_id=V - 1)
    drafter = DFlashDrafter(conf, model.get_input_embeddings(), model.get_output_embeddings()).eval()
    prompt = [1, 2, 3, 0]
    P = len(prompt)
    with torch.no_grad():  # exact joint p(a) p(b|a) p(c|a,b)
        seqs = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        probs = torch.softmax(model(input_ids=seqs).logits.double() / T, -1)
    p1 = probs[0, P - 1]
    joint = (p1[:, None, None] * probs[:, P].view(V, V, V)[:, 0][:, :, None] * probs[:, P + 1].view(V, V, V)).flatten()
    return SimpleNamespace(model=model, eos_ids=set()), drafter, prompt, p1, joint


def chi_square_p(counts, expected) -> float:
    """p-value of observed counts against expected ones, cells with expectation < 5 pooled into one."""
    import torch
    from scipy.stats import chi2

    big = expected >= 5
    e = torch.cat([expected[big], expected[~big].sum()[None]])
    o = torch.cat([counts[big], counts[~big].sum()[None]])
    return float(chi2.sf(float(((o - e) ** 2 / e).sum()), len(e) - 1))


class Oracle:
    """A decoding method that proposes the target's greedy continuation, each draft replaced by a wrong token with
    probability `corrupt`: the expected accepted count of a round (`expected`) is the index of its first corrupted
    draft, and rounds accept some drafts and reject the rest (every rollback length). With `tree`, each depth holds
    the (possibly corrupted) draft and a wrong sibling in random order, as a draft tree."""

    name = "oracle"

    def __init__(self, continuation: list[int], block: int, vocab: int, corrupt: float = 0.0, seed: int = 0,
                 tree: bool = False):
        import torch

        self.continuation, self.max_block_size, self.vocab, self.corrupt = continuation, block, vocab, corrupt
        self.tree, self.layer_ids = tree, [1]
        self.gen = torch.Generator().manual_seed(seed)
        self.expected: list[int] = []

    def start(self):
        self.expected = []

    def check(self, block_size, temperature):
        pass

    def propose(self, state, block_size, temperature=0.0, generator=None):
        import torch

        from dflash_pipeline.eval.protocol import Proposal
        from dflash_pipeline.eval.tree import DraftTree

        n = len(state.output)
        drafts = list(self.continuation[n: n + block_size - 1])
        drafts += [0] * (block_size - 1 - len(drafts))
        expected = block_size - 1
        for k in range(block_size - 1):
            if float(torch.rand((), generator=self.gen)) < self.corrupt:
                drafts[k] = (drafts[k] + 1) % self.vocab
                expected = min(expected, k)
        self.expected.append(expected)
        if not self.tree:
            return Proposal(torch.tensor(drafts))
        tokens, parents, depths, parent = [], [], [], -1
        for d, tok in enumerate(drafts):
            pair = [tok, (tok + 7) % self.vocab]
            if float(torch.rand((), generator=self.gen)) < 0.5:
                pair.reverse()
            for t in pair:
                tokens.append(t), parents.append(parent), depths.append(d + 1)
            parent = len(tokens) - (2 if pair[0] == tok else 1)
        tree = DraftTree(torch.tensor(tokens), torch.tensor(parents), torch.tensor(depths))
        return Proposal(tree.tokens, tree=tree)

"""The evaluation's record, typed: what each step of the eval stage computes, built by the step that computes it and
assembled in eval/stage.py `_evaluate`. eval/report.py alone turns a record into eval_results.json (`as_json`: the
same keys in every version, so dflash-compare and wandb read old and new runs alike), results.md and the plot; no
step reads back a dict another step wrote.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dflash_pipeline.eval.gates import OwnSet


@dataclass(frozen=True)
class Header:
    """What was evaluated, how and on what: the record's first keys."""

    config_hash: str
    not_run: dict[str, str]  # {method: why} of those this target cannot run
    target: str
    drafter_dir: str
    block_size: int
    trained_block_size: int
    temperature: float
    acceptance_rule: str | None  # the own loop's rule at temperature > 0; None (and not written) at 0
    max_new_tokens: int
    datasets: list[str]
    prompts: dict[str, dict[str, int]]  # {set: {"offline": n, "online": n}}
    references: dict  # the autoregressive reference cache: folder, reused, generated
    timing: dict  # the timing protocol, device, threads, repeats
    numerics: dict  # the target's dtype, machine, near-tie tolerance, the teacher's dtype
    methods: list[str]  # the methods evaluated, in the catalogue's order (the order of "methods" in the file)

    @classmethod
    def of(cls, s, digest: str, prompts: dict[str, list[dict]], references, numerics: dict) -> Header:
        """s: eval/stage.py's Setup; references: the ReferenceCache the replies came from."""
        e = s.cfg.eval
        return cls(
            config_hash=digest, not_run=s.not_run, target=s.target.ref, drafter_dir=str(s.drafter_dir),
            block_size=s.block_size, trained_block_size=s.drafter.config.block_size, temperature=e.temperature,
            acceptance_rule=str(e.acceptance_rule) if e.temperature > 0 else None, max_new_tokens=e.max_new_tokens,
            datasets=list(prompts),
            prompts={label: {"offline": len(ps), "online": len(ps[: e.online_prompts])}
                     for label, ps in prompts.items()},
            references={"folder": str(references.folder), "reused": references.reused,
                        "generated": references.generated},
            timing={"protocol": "one warm-up per eval set, then per prompt AR, spec, spec, AR x timing_repeats "
                                "(plain decoding in each other dtype of eval.baseline_dtypes after the first AR and "
                                "after the second spec); medians of per-run time per output token",
                    "device": str(s.device), "num_threads": torch.get_num_threads(), "repeats": e.timing_repeats},
            numerics=numerics, methods=list(s.methods))


@dataclass
class MethodOnSet:
    """One method's figures on one eval set (online decode beside its teacher-forced path, as eval_results.json
    holds them) and its first runs, which the served gate compares with the engine's."""

    figures: dict
    own: OwnSet


@dataclass
class SetResult:
    """One eval set: teacher-forced metrics on the target's replies, the cost curve measured just before its timing,
    and every method's figures."""

    offline: dict
    costs: dict
    methods: dict[str, MethodOnSet] = field(default_factory=dict)


@dataclass
class Served:
    """The served step's figures: the engine, the settings it ran at, and per set the served figures with the gate's
    verdict (eval/gates.py)."""

    engine: str
    target_dir: str
    threads: int
    dtype: str
    tolerance: float
    gguf: dict | None  # llama.cpp: the GGUF files served
    sets: dict[str, dict] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(r["gate"]["pass"] for r in self.sets.values())

    def failures(self) -> list[str]:
        return [r["gate"]["line"] for r in self.sets.values() if not r["gate"]["pass"]]


@dataclass
class EvalRecord:
    """The whole evaluation. heldout: teacher-forced metrics on the held-out teacher sequences (None when there are
    none, offline_note says why); costs and policies: the calibration on those sequences."""

    header: Header
    heldout: dict | None
    offline_note: str
    costs: dict
    policies: dict[str, dict]
    sets: dict[str, SetResult] = field(default_factory=dict)
    served: Served | None = None

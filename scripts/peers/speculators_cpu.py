"""`speculators train ...` (speculators 0.9.0) on a machine without an accelerator, run with the peer's own python.

speculators' trainer assumes a GPU in three places; this patches them in memory (the installed package is not
edited) and then runs its own CLI with the given arguments:
1. torch.accelerator.synchronize, called by its step timer every logged step, raises without an accelerator: a no-op
   there.
2. get_local_rank() is used as the model's and the batches' device (the int 0, i.e. cuda:0): the CPU instead.
3. Trainer.device_type falls back to "cuda" without an accelerator and is what torch.autocast gets: "cpu" instead.
Other CPU needs are plain flags (scripts/bench_peers.py passes them): --draft-attn-impl sdpa (flex attention has no CPU
backward), --loss-implementation eager (the fused loss needs Triton), --num-workers 0.
"""
import sys

import torch

if not torch.accelerator.is_available():
    torch.accelerator.synchronize = lambda *args, **kwargs: None

    import speculators.train.trainer as trainer

    trainer.get_local_rank = lambda: torch.device("cpu")
    _init = trainer.Trainer.__init__

    def _cpu_init(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        self.device_type = "cpu"

    trainer.Trainer.__init__ = _cpu_init

if __name__ == "__main__":
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    main(TrainConfig.resolve(sys.argv[1:]))

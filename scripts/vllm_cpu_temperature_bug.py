"""The smallest reproduction of vLLM's CPU rejection sampler dividing by uninitialised memory at temperature > 0,
for the engine's maintainers: it imports vLLM alone (run it with the python of vLLM's venv).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ~/.cache/dflash-pipeline/vllm/venv/bin/python \\
        scripts/vllm_cpu_temperature_bug.py

vllm/v1/sample/rejection_sampler.py apply_sampling_constraints divides the target's logits at every draft position
by expand_batch_to_tokens(sampling_metadata.temperature, ...), which calls the `expand_kernel` Triton kernel. On a
CPU without Triton's CPU backend, vllm/platforms/cpu.py registers vllm/utils/cpu_triton_utils.py
_expand_kernel_impl in its place; that passes `_ensure_int64(output)`, a new int64 copy of the float32 output, to
the C++ kernel and never copies it back (and truncates the float temperature to an integer on the way in), so the
returned tensor is whatever `new_empty` held. Exit status 1 and the values where the bug is present, 0 where fixed.
"""
import sys

import torch
import vllm
from vllm.platforms import current_platform

current_platform.import_kernels()
current_platform.register_triton_kernel_overrides()  # what the engine does at start on a CPU
from vllm.v1.sample.rejection_sampler import GREEDY_TEMPERATURE, expand_batch_to_tokens  # noqa: E402

temperature = torch.tensor([0.7, 1.0])  # two requests
cu_num_draft_tokens = torch.tensor([3, 6], dtype=torch.int32)  # three draft tokens each
got = expand_batch_to_tokens(temperature, cu_num_draft_tokens, 6, replace_from=GREEDY_TEMPERATURE, replace_to=1)
want = torch.tensor([0.7, 0.7, 0.7, 1.0, 1.0, 1.0])
print(f"vllm {vllm.__version__}: expected {want.tolist()}, got {got.tolist()}")
sys.exit(0 if torch.equal(got, want) else 1)

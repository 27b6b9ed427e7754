"""How many bytes the KV cache gets: ``--kv-cache-memory auto`` (the default) sizes it
from the device, a size (``2GiB``) fixes it, ``--num-kv-blocks`` overrides both.

On a GPU (vLLM's rule): this engine may use ``--gpu-memory-utilization`` of the
device's total memory (0.9 by default). What is in use once the weights are loaded
(by this process and any other), plus the activation peak of a profiling forward at
the largest batch a step can hold, is spent; the rest is the cache's. A budget at or
below zero is a ConfigError that states the numbers.

On a CPU: a quarter of the memory the OS reports available, at most 4 GiB. The cache
is allocated zero-filled by the OS (see :func:`allocate_zeros`), so the pages of blocks
never used are never committed and a large budget costs nothing until it fills.

The probes are parameters, so the rule is tested with mocked devices.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from pyagent_framework.engine.errors import ConfigError

logger = logging.getLogger("pyagent_framework.engine")

#: The share of available RAM the CPU cache takes under ``auto``, and its cap.
CPU_FRACTION = 0.25
CPU_CAP = 4 << 30


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes of a device's memory: its ``total`` and what is ``free`` (a CPU's
    ``MemAvailable``) at the time of the probe."""

    total: int
    free: int


def probe_memory(device: Any) -> DeviceMemory:
    """The device's memory now: ``torch.cuda.mem_get_info`` on a GPU, ``/proc/meminfo``
    (else ``sysconf``) on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return DeviceMemory(total=int(total), free=int(free))
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                fields[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if "MemTotal" in fields and "MemAvailable" in fields:
        return DeviceMemory(total=fields["MemTotal"], free=fields["MemAvailable"])
    page = os.sysconf("SC_PAGE_SIZE")
    return DeviceMemory(total=page * os.sysconf("SC_PHYS_PAGES"), free=page * os.sysconf("SC_AVPHYS_PAGES"))


def _gib(size: float) -> str:
    return f"{size / 2**30:.2f} GiB"


def auto_budget(
    device: Any,
    *,
    gpu_memory_utilization: float,
    probe: Callable[[Any], DeviceMemory] | None = None,
    profile: Callable[[], int] | None = None,
) -> tuple[int, str]:
    """The KV cache's bytes under ``auto`` on ``device`` and how they were found (for
    the log). ``probe`` reads the device's memory (default :func:`probe_memory`);
    ``profile`` runs the profiling forward and returns its activation peak in bytes
    (GPU only; None: no forward is profiled)."""
    probe = probe or probe_memory
    if torch.device(device).type != "cuda":
        memory = probe(device)
        budget = int(min(memory.free * CPU_FRACTION, CPU_CAP))
        return budget, f"{CPU_FRACTION:.0%} of {_gib(memory.free)} available RAM, at most {_gib(CPU_CAP)}"
    peak = profile() if profile is not None else 0
    memory = probe(device)
    allowed = memory.total * gpu_memory_utilization
    in_use = memory.total - memory.free  # weights, the CUDA context, other processes
    budget = int(allowed - in_use - peak)
    how = (f"{gpu_memory_utilization:.0%} of {_gib(memory.total)} = {_gib(allowed)}, less {_gib(in_use)} in use "
           f"and a {_gib(peak)} activation peak")
    if budget <= 0:
        raise ConfigError(
            f"no GPU memory is left for the KV cache: {how}; raise gpu_memory_utilization, lower "
            "max_num_batched_tokens or max_num_seqs, or free the device",
            field="gpu_memory_utilization",
        )
    return budget, how


def allocate_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: Any) -> torch.Tensor:
    """A zero-filled tensor; on the CPU from ``calloc`` (through numpy), whose large
    blocks are fresh pages the OS zero-fills when first touched, so memory is committed
    as the cache fills rather than all at once."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(shape, dtype={1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize])
    return torch.from_numpy(raw).view(dtype)


def profile_forward(model: Any, device: Any, *, num_tokens: int, num_seqs: int, max_model_len: int,
                    block_size: int) -> int:
    """Run the model once on ``num_tokens`` dummy prompt tokens cut into up to
    ``num_seqs`` sequences (the largest step the scheduler builds), with no KV cache
    written, and return the CUDA allocator's peak above what was allocated before."""
    from pyagent_framework.engine.model_runner import StepInputs, run_step

    num_seqs = max(1, min(num_seqs, num_tokens))
    per_seq = min(max_model_len, -(-num_tokens // num_seqs))
    lengths = []
    left = num_tokens
    while left > 0 and len(lengths) < num_seqs:
        lengths.append(min(per_seq, left))
        left -= lengths[-1]
    total = sum(lengths)
    starts = [0]
    for length in lengths:
        starts.append(starts[-1] + length)
    positions = torch.cat([torch.arange(length) for length in lengths])
    inputs = StepInputs(
        input_ids=torch.zeros(total, dtype=torch.long),
        positions=positions,
        slot_mapping=torch.full((total,), -1, dtype=torch.long),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lengths, dtype=torch.int32),
        block_tables=torch.full((len(lengths), 1), -1, dtype=torch.int32),
        max_query_len=max(lengths),
        max_seq_len=max(lengths),
        logit_rows=[torch.tensor([start - 1 for start in starts[1:]])],
    )
    layers = model.kv_cache_shape(1, block_size)[0]
    empty = [torch.empty(0, device=device) for _ in range(layers)]
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        run_step(model, empty, block_size, inputs, device)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return int(peak)

"""Decode steps replayed from CUDA graphs.

On a GPU a decode step of a small model is bound by the host: each kernel launch costs
0.05-0.18 ms of Python and driver time, a few hundred launches per step. A CUDA graph
records the launches of one step once and replays them with one call. Here:

- **What is captured:** the model's forward and its logits for a pure-decode batch (one
  new token per sequence, every sequence sampled; no prompt logprobs, drafts or LoRA
  adapters), one graph per batch-size bucket (1, 2, 4, 8, ... up to ``max_num_seqs``).
  Each graph is captured the first time its bucket runs.
- **Static buffers:** a graph reads its inputs from fixed device tensors: token ids,
  positions, cache slots, sequence lengths and block tables as wide as
  ``max_model_len``. A step copies its batch into them and pads the rest of its bucket
  with rows that write into a reserved pad block (one block the pool never hands out)
  and read it, so a padded step is still a pure decode for every attention backend.
  The metadata says every slot is written (``all_slots_written``) and gives the
  buckets' fixed upper bound as ``max_seq_len``, so the backends plan without asking
  the device anything (a host sync is an error during a capture).
- **Safety:** a capture that fails (a model or backend that syncs with the host, say)
  turns the graphs off with one logged warning, and the step runs eagerly. The first
  replay of each bucket is checked against an eager run of the same step; logits that
  differ by more than float rounding turn the graphs off too. ``--enforce-eager`` never
  builds them.

``capture=False`` runs the same padded static-buffer step eagerly: the CPU twin that
the tests compare with the plain step (the padding, the pad block, the logits rows).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from pyagent_framework.types import AttentionMetadata, ForwardContext

logger = logging.getLogger("pyagent_framework.engine")


def buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes with a graph: powers of two below ``max_num_seqs``, then it."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """The captured decode steps of one model and cache (see the module docstring)."""

    #: The first replay of a bucket must match the eager step within this (relative to
    #: the largest logit); beyond it the graphs are turned off.
    CHECK_TOLERANCE = 1e-3

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int, device: Any, *,
                 max_num_seqs: int, max_model_len: int, pad_block: int, capture: bool = True) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self.capture = capture
        self.buckets = buckets(max_num_seqs)
        self.max_blocks = -(-max_model_len // block_size)
        self.pad_slot = pad_block * block_size
        self.pad_block = pad_block
        size = self.buckets[-1]
        self.input_ids = torch.empty(size, dtype=torch.long, device=self.device)
        self.positions = torch.empty(size, dtype=torch.long, device=self.device)
        self.slots = torch.empty(size, dtype=torch.long, device=self.device)
        self.seq_lens = torch.empty(size, dtype=torch.int32, device=self.device)
        self.block_tables = torch.empty((size, self.max_blocks), dtype=torch.int32, device=self.device)
        self._pad(0, size)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=self.device)
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self.checked: set[int] = set()
        self.disabled: str | None = None
        self._pool = None

    # ------------------------------------------------------------------ the step

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def takes(self, inputs: Any, rows: int) -> bool:
        """Whether ``inputs`` (a StepInputs of ``rows`` sequences, all sampled) is a plain
        decode step a graph can run."""
        return (
            self.disabled is None
            and inputs.max_query_len == 1
            and inputs.lora_slots is None
            and inputs.input_ids.shape[0] == rows
            and self.bucket(rows) is not None
            and inputs.block_tables.shape[1] <= self.max_blocks
            and bool((inputs.slot_mapping >= 0).all())  # host tensors: no device sync
        )

    def run(self, inputs: Any) -> torch.Tensor | None:
        """The logits ``[rows, vocab]`` of a step :meth:`takes`, or None (then the caller
        runs it eagerly: the graphs are off)."""
        rows = inputs.input_ids.shape[0]
        size = self.bucket(rows)
        self._load(inputs, rows, size)
        if not self.capture:
            return self._forward(size)[:rows]
        entry = self.graphs.get(size)
        if entry is None:
            entry = self._capture(size)
            if entry is None:
                return None
            self._load(inputs, rows, size)  # the capture ran the pad rows through the buffers
        graph, logits = entry
        graph.replay()
        if size not in self.checked:
            self.checked.add(size)
            eager = self._forward(size)
            scale = float(eager.abs().max().clamp(min=1.0))
            error = float((logits - eager).abs().max()) / scale
            if error > self.CHECK_TOLERANCE:
                self._disable(f"the replayed step of {size} rows differs from the eager one by {error:.2e}")
                return eager[:rows].clone()
        return logits[:rows].clone()

    def _load(self, inputs: Any, rows: int, size: int) -> None:
        """This step's rows into the static buffers, pad rows after them."""
        width = inputs.block_tables.shape[1]
        self.input_ids[:rows].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:rows].copy_(inputs.positions, non_blocking=True)
        self.slots[:rows].copy_(inputs.slot_mapping, non_blocking=True)
        self.seq_lens[:rows].copy_(inputs.seq_lens, non_blocking=True)
        tables = torch.full((rows, self.max_blocks), -1, dtype=torch.int32)
        tables[:, :width] = inputs.block_tables
        self.block_tables[:rows].copy_(tables, non_blocking=True)
        self._pad(rows, size)

    def _forward(self, size: int) -> torch.Tensor:
        metadata = AttentionMetadata(
            slot_mapping=self.slots[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=self.max_blocks * self.block_size,
            all_slots_written=True,
        )
        context = ForwardContext(metadata=metadata, kv_caches=self.kv_caches)
        hidden = self.model(self.input_ids[:size], self.positions[:size], context)
        return self.model.compute_logits(hidden)

    # ------------------------------------------------------------------ capture

    def _capture(self, size: int):
        """The graph of bucket ``size`` and its output buffer, or None (graphs off)."""
        self._pad(0, size)
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles and autotunes the kernels outside the capture
                    self._forward(size)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self._forward(size)
        except Exception as exc:  # the capture is an optimization: any failure means eager steps
            self._disable(f"capturing the decode step of {size} rows failed: {type(exc).__name__}: {exc}")
            return None
        self._pool = graph.pool()
        self.graphs[size] = (graph, logits)
        logger.info("CUDA graph captured for decode batches of up to %d sequences", size)
        return self.graphs[size]

    def _pad(self, start: int, end: int) -> None:
        """Rows ``start:end`` of the buffers as pad rows: one token that writes and reads
        the pad block."""
        if end <= start:
            return
        self.input_ids[start:end] = 0
        self.positions[start:end] = 0
        self.slots[start:end] = self.pad_slot
        self.seq_lens[start:end] = 1
        self.block_tables[start:end] = -1
        self.block_tables[start:end, 0] = self.pad_block

    def _disable(self, why: str) -> None:
        self.disabled = why
        self.graphs.clear()
        logger.warning("CUDA graphs off, decode runs eagerly: %s", why)

"""Builds the flattened batch of one step and runs the model on it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pyagent_framework.engine.scheduler import ScheduledBatch
from pyagent_framework.engine.sequence import Sequence
from pyagent_framework.types import AttentionMetadata, ForwardContext


@dataclass
class StepLogits:
    """Logits of the rows the sampler needs: one per sequence that completes its
    scheduled tokens this step (``sample_seqs``), plus prompt rows for sequences that
    asked for prompt logprobs (``prompt_rows``: seq -> (first prompt position, logits))."""

    sample_seqs: list[Sequence]
    sample_logits: torch.Tensor | None
    prompt_rows: dict[int, tuple[int, torch.Tensor]]
    # Sequences carrying a speculative draft: seq_id -> logits [1 + len(draft), vocab] at
    # its pending token and each draft token (they are not in sample_seqs).
    spec_rows: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class StepInputs:
    """One step's batch as tensors: all the model needs to run it, and the rows whose
    logits are wanted (``logit_rows``: index groups, each given to ``compute_logits``
    in this order). A tensor-parallel worker receives exactly this (see
    :mod:`pyagent_framework.engine.tensor_parallel`), so every rank runs the same
    collectives in the same order."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    logit_rows: list[torch.Tensor]
    lora_slots: torch.Tensor | None = None  # each token row's LoRA slot (-1: none), when the batch has adapters


def run_step(model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int, inputs: StepInputs, device) -> list[torch.Tensor]:
    """The model's forward over ``inputs`` and the logits of each row group (on the
    model's device)."""
    device = torch.device(device)

    def to_device(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if device.type == "cpu" else tensor.to(device)

    metadata = AttentionMetadata(
        slot_mapping=to_device(inputs.slot_mapping),
        query_start_loc=to_device(inputs.query_start_loc),
        seq_lens=to_device(inputs.seq_lens),
        block_tables=to_device(inputs.block_tables),
        block_size=block_size,
        max_query_len=inputs.max_query_len,
        max_seq_len=inputs.max_seq_len,
    )
    context = ForwardContext(metadata=metadata, kv_caches=kv_caches, lora_slots=inputs.lora_slots)
    hidden = model(to_device(inputs.input_ids), to_device(inputs.positions), context)
    return [model.compute_logits(hidden[to_device(rows)]) for rows in inputs.logit_rows]


class ModelRunner:
    """The batch is laid out on the CPU and copied to the model's device in one go per
    tensor; the logits stay on that device (the engine masks and samples them). Under
    tensor parallelism ``workers`` (ranks 1 and up) receive each step's inputs before
    this rank runs them."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int, device=None, workers=None,
                 lora=None) -> None:
        self.model = model
        self.lora = lora  # the LoRA layers' shared state (row_slots set before each step), or None
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device or "cpu")
        self.workers = workers
        self.graphs = None  # DecodeGraphs (engine/cuda_graphs.py) where decode steps replay from CUDA graphs

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepLogits:
        input_ids, positions, slots, starts, seq_lens, tables = [], [], [], [0], [], []
        sample_rows, sample_seqs = [], []
        spec_spans: dict[int, tuple[int, int]] = {}  # seq_id -> (first row, rows)
        prompt_spans: dict[int, tuple[int, int, int]] = {}  # seq_id -> (row0, first pos, count)
        max_blocks = max(len(seq.block_ids) for seq, _ in batch.items)
        for seq, num_new in batch.items:
            begin, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            row0 = starts[-1]
            input_ids.extend(seq.token_ids[begin:end])
            pos = torch.arange(begin, end)
            positions.append(pos)
            block_ids = torch.tensor(seq.block_ids, dtype=torch.long)
            slots.append(block_ids[pos // self.block_size] * self.block_size + pos % self.block_size)
            starts.append(row0 + num_new)
            seq_lens.append(end)
            tables.append(seq.block_ids + [-1] * (max_blocks - len(seq.block_ids)))
            if end == seq.num_tokens and seq.spec_tokens:
                rows = len(seq.spec_tokens) + 1
                spec_spans[seq.seq_id] = (row0 + num_new - rows, rows)
            elif end == seq.num_tokens:
                sample_rows.append(row0 + num_new - 1)
                sample_seqs.append(seq)
            if seq.params.prompt_logprobs is not None and begin < seq.num_prompt_tokens - 1:
                last = min(end, seq.num_prompt_tokens - 1)  # position whose next token is still prompt
                prompt_spans[seq.seq_id] = (row0, begin, last - begin)

        if spec_spans and all(n == 1 or seq.spec_tokens for seq, n in batch.items):
            # Decodes and drafts only: every token becomes a one-token "sequence" of its
            # own, as long as its position + 1, reading its sequence's blocks. The step
            # is then a pure decode for the attention backends (batched decode kernels,
            # fused decode steps), and each draft token attends exactly what it would
            # had it been decoded alone.
            per_token = [n for _, n in batch.items]
            tables = [table for table, n in zip(tables, per_token) for _ in range(n)]
            seq_lens = (torch.cat(positions) + 1).tolist()
            starts = list(range(len(input_ids) + 1))
        # The row groups whose logits are wanted, in a fixed order: the sampled rows,
        # each prompt-logprobs span, every draft row of the batch in one group.
        groups: list[torch.Tensor] = []
        if sample_rows:
            groups.append(torch.tensor(sample_rows, dtype=torch.long))
        groups += [torch.arange(row0, row0 + count) for row0, _, count in prompt_spans.values()]
        if spec_spans:
            groups.append(torch.cat([torch.arange(first, first + rows) for first, rows in spec_spans.values()]))
        inputs = StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.long),
            positions=torch.cat(positions),
            slot_mapping=torch.cat(slots),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            max_query_len=max(b - a for a, b in zip(starts, starts[1:])),
            max_seq_len=max(seq_lens),
            logit_rows=groups,
            lora_slots=self.lora.row_slots if self.lora is not None else None,
        )
        if self.workers is not None:
            self.workers.send_step(inputs)
        elif self.graphs is not None and not spec_spans and not prompt_spans and self.graphs.takes(inputs, len(sample_rows)):
            replayed = self.graphs.run(inputs)
            if replayed is not None:
                return StepLogits(sample_seqs, replayed, {}, {})
        logits = iter(run_step(self.model, self.kv_caches, self.block_size, inputs, self.device))
        sample_logits = next(logits) if sample_rows else None
        prompt_rows = {seq_id: (first, next(logits)) for seq_id, (_, first, _) in prompt_spans.items()}
        spec_rows = {}
        if spec_spans:
            sizes = [rows for _, rows in spec_spans.values()]
            spec_rows = dict(zip(spec_spans, next(logits).split(sizes)))
        return StepLogits(sample_seqs, sample_logits, prompt_rows, spec_rows)

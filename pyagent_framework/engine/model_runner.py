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


class ModelRunner:
    """The batch is laid out on the CPU and copied to the model's device in one go per
    tensor; the logits stay on that device (the engine masks and samples them)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int, device=None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device or "cpu")

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
        to_device = self._to_device
        metadata = AttentionMetadata(
            slot_mapping=to_device(torch.cat(slots)),
            query_start_loc=to_device(torch.tensor(starts, dtype=torch.int32)),
            seq_lens=to_device(torch.tensor(seq_lens, dtype=torch.int32)),
            block_tables=to_device(torch.tensor(tables, dtype=torch.int32)),
            block_size=self.block_size,
            max_query_len=max(b - a for a, b in zip(starts, starts[1:])),
            max_seq_len=max(seq_lens),
        )
        hidden = self.model(
            to_device(torch.tensor(input_ids, dtype=torch.long)),
            to_device(torch.cat(positions)),
            ForwardContext(metadata=metadata, kv_caches=self.kv_caches),
        )
        sample_logits = self.model.compute_logits(hidden[sample_rows]) if sample_rows else None
        prompt_rows = {
            seq_id: (first, self.model.compute_logits(hidden[row0 : row0 + count]))
            for seq_id, (row0, first, count) in prompt_spans.items()
        }
        spec_rows = {}
        if spec_spans:  # one head matmul for every draft row of the batch
            index = torch.cat([torch.arange(first, first + rows) for first, rows in spec_spans.values()])
            drafted = self.model.compute_logits(hidden[index.to(hidden.device)])
            sizes = [rows for _, rows in spec_spans.values()]
            spec_rows = dict(zip(spec_spans, drafted.split(sizes)))
        return StepLogits(sample_seqs, sample_logits, prompt_rows, spec_rows)

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return tensor
        return tensor.to(self.device)

"""A conformance kit for attention backends, to subclass in a plugin's tests.

```python
from pyagent_framework.testing.attention import AttentionBackendContract

class TestMyBackend(AttentionBackendContract):
    backend_name = "my-backend"
    atol = rtol = 1e-5  # float32 against the reference
```

Every case is run twice on the same inputs, by the backend and by the reference
(the built-in ``torch`` backend, :class:`pyagent_framework.paged_attention.TorchAttention`),
on a paged cache whose blocks are shuffled, and both the output and the whole cache
afterwards are compared. Cases, each with several seeds:

- batches of fresh prefills, of decodes (one new token after a cached context), mixed
  batches, prefill chunks that continue a cached context, and a speculative step laid
  out as one-token sequences sharing a block table (as the engine lays drafts out);
- multi-head, grouped-query and multi-query heads, head sizes 8 to 128, block sizes 4
  and 16;
- ``sliding_window`` and ``logit_softcap`` when the backend's constructor takes them
  (the engine only passes them to a backend that does);
- a slot of ``-1`` is not written (the cache is compared; the output of a sequence
  with such slots is not, as the interface leaves it open).
"""

from __future__ import annotations

import inspect
import random
from typing import Any

import pytest
import torch

from pyagent_framework import registries
from pyagent_framework.interfaces import AttentionBackend
from pyagent_framework.testing.registration import check_interface
from pyagent_framework.types import AttentionMetadata

#: (num_heads, num_kv_heads, head_size, block_size)
HEADS = ((4, 4, 16, 4), (6, 2, 8, 4), (4, 1, 32, 16), (8, 2, 64, 16), (2, 1, 128, 16))
SEEDS = tuple(range(3))
KINDS = ("prefill", "decode", "mixed", "chunked", "drafts")


def shapes(kind: str, seed: int) -> list[tuple[int, int]]:
    """(cached context, new tokens) per sequence; lengths cross block boundaries."""
    rng = random.Random(seed)
    if kind == "prefill":
        return [(0, rng.randint(1, 40)) for _ in range(rng.randint(1, 4))]
    if kind == "decode":
        return [(rng.randint(0, 60), 1) for _ in range(rng.randint(1, 7))]
    if kind == "chunked":
        return [(rng.randint(1, 40), rng.randint(2, 20)) for _ in range(rng.randint(1, 3))]
    if kind == "drafts":
        return [(rng.randint(1, 40), rng.randint(2, 6))]
    return [(0, 7), (5, 4), (8, 1), (13, 1), (3, 9), (rng.randint(0, 30), 1), (0, rng.randint(1, 20))]


def make_case(kind: str, seed: int, num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
              *, dtype: torch.dtype = torch.float32, unwritten: bool = False) -> dict[str, Any]:
    """Inputs of one forward pass: query/key/value of the new tokens, a cache holding
    the cached context (shuffled blocks; zeros elsewhere) and the metadata. With
    ``unwritten``, the first sequence's new tokens get slot -1."""
    g = torch.Generator().manual_seed(seed * 7919 + len(kind))
    seqs = shapes(kind, seed)
    blocks_needed = [-(-(c + n) // block_size) for c, n in seqs]
    num_blocks = sum(blocks_needed) + 3
    free = torch.randperm(num_blocks, generator=g).tolist()
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_size, dtype=dtype)
    flat = cache.view(2, -1, num_kv_heads, head_size)
    tables, queries, keys, values, slots, starts, lens = [], [], [], [], [], [0], []
    for i, ((ctx, new), count) in enumerate(zip(seqs, blocks_needed)):
        blocks = [free.pop() for _ in range(count)]
        seq_slots = [blocks[p // block_size] * block_size + p % block_size for p in range(ctx + new)]
        k = torch.randn(ctx + new, num_kv_heads, head_size, generator=g).to(dtype)
        v = torch.randn(ctx + new, num_kv_heads, head_size, generator=g).to(dtype)
        flat[0, seq_slots[:ctx]], flat[1, seq_slots[:ctx]] = k[:ctx], v[:ctx]  # written by earlier steps
        queries.append(torch.randn(new, num_heads, head_size, generator=g).to(dtype))
        keys.append(k[ctx:])
        values.append(v[ctx:])
        new_slots = [-1] * new if unwritten and i == 0 else seq_slots[ctx:]
        if kind == "drafts":  # one one-token sequence per new token, sharing the table
            for j in range(new):
                tables.append(blocks)
                lens.append(ctx + j + 1)
                starts.append(starts[-1] + 1)
        else:
            tables.append(blocks)
            lens.append(ctx + new)
            starts.append(starts[-1] + new)
        slots += new_slots
    width = max(len(t) for t in tables)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=block_size,
        max_query_len=max(b - a for a, b in zip(starts, starts[1:])),
        max_seq_len=max(lens),
    )
    first_rows = seqs[0][1] if unwritten else 0
    return {"query": torch.cat(queries), "key": torch.cat(keys), "value": torch.cat(values), "cache": cache,
            "metadata": metadata, "skip_rows": first_rows}


def _on(metadata: AttentionMetadata, device: str) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=metadata.slot_mapping.to(device), query_start_loc=metadata.query_start_loc.to(device),
        seq_lens=metadata.seq_lens.to(device), block_tables=metadata.block_tables.to(device),
        block_size=metadata.block_size, max_query_len=metadata.max_query_len, max_seq_len=metadata.max_seq_len,
    )


def takes(backend_cls: Any, keyword: str) -> bool:
    """Whether the backend's constructor takes ``keyword`` (by name or ``**kwargs``)."""
    try:
        params = inspect.signature(backend_cls).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == keyword or p.kind is p.VAR_KEYWORD for p in params)


def check_against_reference(backend_cls: Any, case: dict[str, Any], num_heads: int, num_kv_heads: int, head_size: int,
                            *, scale: float = 0.3, device: str = "cpu", atol: float = 1e-5, rtol: float = 1e-5,
                            label: str = "", **options: Any) -> None:
    """The backend and the reference on the same inputs: output within tolerance, and
    the same cache afterwards (new keys/values in their slots, nothing else touched)."""
    reference_cls = registries.attention_backends.load("torch")
    ref_cache = case["cache"].clone()
    expected = reference_cls(num_heads, head_size, num_kv_heads, scale, **options).forward(
        case["query"], case["key"], case["value"], ref_cache, case["metadata"])
    backend = backend_cls(num_heads, head_size, num_kv_heads, scale, **options)
    cache = case["cache"].clone().to(device)
    got = backend.forward(case["query"].to(device), case["key"].to(device), case["value"].to(device), cache,
                          _on(case["metadata"], device))
    where = f"{label} (heads {num_heads}/{num_kv_heads}, head size {head_size}{''.join(f', {k}={v}' for k, v in options.items())})"
    assert tuple(got.shape) == tuple(expected.shape), f"{where}: output shape\n  expected: {tuple(expected.shape)}\n  actual:   {tuple(got.shape)}"
    cache = cache.cpu()
    if not torch.equal(cache, ref_cache):
        differs = (cache != ref_cache).flatten(2).any(-1)  # [2, blocks, block_size]
        where_slots = (differs.any(0).flatten().nonzero().flatten()).tolist()
        written = case["metadata"].slot_mapping.tolist()
        raise AssertionError(
            f"{where}: the cache after forward differs from the reference's\n"
            f"  expected: new keys/values at slots {sorted(s for s in written if s >= 0)[:20]}, nothing else changed\n"
            f"  actual:   slots that differ: {where_slots[:20]}"
        )
    got = got.cpu()
    rows = case["skip_rows"]
    try:
        torch.testing.assert_close(got[rows:].float(), expected[rows:].float(), atol=atol, rtol=rtol)
    except AssertionError as exc:
        raise AssertionError(f"{where}: the output differs from the torch reference backend's\n{exc}") from None


class AttentionBackendContract:
    """Subclass with ``backend_name`` set; loosen ``atol``/``rtol`` for a backend that
    computes in lower precision; ``device = "cuda"`` for a GPU backend."""

    backend_name: str = ""
    atol: float = 1e-5
    rtol: float = 1e-5
    device: str = "cpu"
    #: Head layouts ((num_heads, num_kv_heads, head_size, block_size)) and seeds tried.
    heads: tuple[tuple[int, int, int, int], ...] = HEADS
    seeds: tuple[int, ...] = SEEDS

    def backend_cls(self) -> Any:
        assert self.backend_name, "set backend_name on the test class"
        cls = registries.attention_backends.load(self.backend_name)
        if self.device == "cuda" and not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        return cls

    def check(self, kind: str, seed: int, heads: tuple[int, int, int, int], *, unwritten: bool = False, **options: Any) -> None:
        num_heads, num_kv_heads, head_size, block_size = heads
        case = make_case(kind, seed, num_heads, num_kv_heads, head_size, block_size, unwritten=unwritten)
        check_against_reference(self.backend_cls(), case, num_heads, num_kv_heads, head_size, device=self.device,
                                atol=self.atol, rtol=self.rtol, label=f"{kind} batch, seed {seed}", **options)

    def test_is_an_attention_backend(self):
        backend = self.backend_cls()(4, 16, 2, 0.25)
        check_interface(backend, AttentionBackend)

    @pytest.mark.parametrize("kind", KINDS)
    def test_matches_the_reference(self, kind):
        for heads in self.heads:
            for seed in self.seeds:
                self.check(kind, seed, heads)

    def test_slot_minus_one_is_not_written(self):
        for seed in self.seeds:
            self.check("mixed", seed, self.heads[min(1, len(self.heads) - 1)], unwritten=True)

    @pytest.mark.parametrize("option, value", [("sliding_window", 5), ("sliding_window", 16), ("logit_softcap", 2.0)])
    def test_declared_options_match_the_reference(self, option, value):
        if not takes(self.backend_cls(), option):
            pytest.skip(f"the backend does not take {option}")
        for kind in KINDS:
            for heads in self.heads[:3]:
                self.check(kind, self.seeds[0], heads, **{option: value})


__all__ = ["AttentionBackendContract", "HEADS", "KINDS", "check_against_reference", "make_case", "shapes", "takes"]

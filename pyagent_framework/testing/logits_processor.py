"""A conformance kit for logits processors, to subclass in a plugin's tests.

```python
from pyagent_framework.testing.logits_processor import LogitsProcessorContract

class TestMyProcessor(LogitsProcessorContract):
    processor_name = "my-processor"
    args = [{"window": 1}, {"window": 3}]  # argument sets requests may give
    bad_args = [{"window": 0}, {"colour": "red"}]  # ones it must refuse
```

Checked, on random histories and logits:

- each argument set builds an instance (``cls(**args)``), each bad one raises
  ``ValueError`` or ``TypeError``;
- ``apply`` changes the logits in place, keeps their shape and dtype, and leaves no
  NaN where there was none;
- rows are independent: a batch equals its rows applied one by one (the engine
  retries row by row after a failure) and equals the batch in another order;
- it keeps no state between calls: the same rows give the same logits every time (a
  sequence may be seen again after a preemption), and neither the histories nor the
  rows are changed.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from pyagent_framework import registries
from pyagent_framework.interfaces import LogitsProcessor, missing_members
from pyagent_framework.types import LogitsRow

VOCAB = 64


def make_rows(cls: Any, args: Sequence[dict[str, Any]], seed: int, count: int = 6) -> list[LogitsRow]:
    """Rows of random histories over a small vocabulary (with repeats), each with one
    of the argument sets."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        alphabet = rng.sample(range(VOCAB), rng.choice([3, 10, VOCAB]))
        prompt = [rng.choice(alphabet) for _ in range(rng.randint(1, 12))]
        output = [rng.choice(alphabet) for _ in range(rng.choice([0, 1, rng.randint(2, 30)]))]
        rows.append(LogitsRow(cls(**args[i % len(args)]), tuple(prompt), tuple(output), frozenset({VOCAB - 1})))
    return rows


def applied(cls: Any, logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
    out = logits.clone()
    result = cls.apply(out, list(rows))
    assert result is None, f"apply() changes the logits in place and returns None, got {type(result).__name__}"
    return out


def check_processor(cls: Any, args: Sequence[dict[str, Any]], seed: int) -> None:
    rows = make_rows(cls, args, seed)
    histories = [(r.prompt_token_ids, r.output_token_ids) for r in rows]
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(seed))
    batch = applied(cls, logits, rows)
    assert batch.shape == logits.shape and batch.dtype == torch.float32
    assert not torch.isnan(batch).any(), "apply() made NaN logits"
    assert applied(cls, logits, rows).equal(batch), "apply() on the same rows gave other logits the second time"
    for i, row in enumerate(rows):
        alone = applied(cls, logits[i : i + 1], [row])
        assert alone.equal(batch[i : i + 1]), (
            f"row {i} applied alone differs from row {i} of the batch\n"
            f"  expected: {batch[i].tolist()}\n  actual:   {alone[0].tolist()}"
        )
    order = list(range(len(rows)))[::-1]
    reversed_out = applied(cls, logits[order], [rows[i] for i in order])
    assert reversed_out.equal(batch[order]), "the batch in another order gives other logits for the same rows"
    assert [(r.prompt_token_ids, r.output_token_ids) for r in rows] == histories, "apply() changed a row's history"


class LogitsProcessorContract:
    """Subclass with ``processor_name``, ``args`` (argument sets) and ``bad_args``."""

    processor_name: str = ""
    args: Sequence[dict[str, Any]] = ({},)
    bad_args: Sequence[dict[str, Any]] = ()

    def cls(self) -> Any:
        assert self.processor_name, "set processor_name on the test class"
        return registries.logits_processors.load(self.processor_name)

    def test_is_a_logits_processor(self):
        missing = missing_members(self.cls(), LogitsProcessor)
        assert not missing, f"not a LogitsProcessor: missing {missing}"

    def test_bad_arguments_are_refused(self):
        for args in self.bad_args:
            with pytest.raises((ValueError, TypeError)):
                self.cls()(**args)

    @pytest.mark.parametrize("seed", range(8))
    def test_rows_are_independent_and_stateless(self, seed):
        check_processor(self.cls(), list(self.args), seed)


__all__ = ["LogitsProcessorContract", "VOCAB", "applied", "check_processor", "make_rows"]

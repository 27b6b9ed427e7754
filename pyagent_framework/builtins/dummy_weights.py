from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from pyagent_framework.interfaces import WeightFormat


def _config_file(path: str) -> Path:
    p = Path(path)
    return p / "config.json" if p.is_dir() else p


def _random_like(name: str, param: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    if param.dim() == 1:
        # Norm scales at one, biases at zero: a random model that still behaves sanely.
        return torch.ones(param.shape) if "norm" in name else torch.zeros(param.shape)
    return torch.empty(param.shape).normal_(0.0, 0.02, generator=generator)


class DummyWeights(WeightFormat):
    """Random weights for the architecture a ``config.json`` names: models of any size
    for tests and benchmarks without a checkpoint. Seeded, so repeatable; tensors are
    named after the model's own parameters."""

    seed = 0

    def matches(self, path: str) -> bool:
        file = _config_file(path)
        return file.name.endswith(".json") and file.is_file()

    def load_config(self, path: str) -> dict:
        file = _config_file(path)
        if not file.is_file():
            raise ValueError(f"dummy weights need a config.json; {path} has none")
        return json.loads(file.read_text(encoding="utf-8"))

    def iter_weights(self, path: str) -> Iterator[tuple[str, torch.Tensor]]:
        from pyagent_framework import registries

        config = self.load_config(path)
        arch = registries.model_architectures.load(config["architectures"][0])
        with torch.device("meta"):  # shapes only, no memory
            model = arch(config, attention_backend=registries.attention_backends.load("torch"))
        generator = torch.Generator().manual_seed(self.seed)
        for name, param in model.named_parameters():
            yield name, _random_like(name, param, generator)

    def load_into(self, model, path: str, packed: frozenset[str] = frozenset()) -> set[str]:
        generator = torch.Generator().manual_seed(self.seed)
        loaded = set()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(_random_like(name, param, generator))
                loaded.add(name)
        return loaded

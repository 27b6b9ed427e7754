"""torch profiler traces of the engine core, started and stopped between steps
(``/start_profile`` and ``/stop_profile`` on a server run with ``--profiler-dir``).

The profile is taken where the model runs: in the engine core's process (each
data-parallel replica writes its own file). The directory is the operator's, never a
request's.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


class Profiler:
    def __init__(self, device: Any) -> None:
        self.device = device
        self._profile = None
        self._directory: Path | None = None

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self, directory: str) -> str:
        import torch

        if self._profile is not None:
            raise RuntimeError("a profile is already running; stop it first")
        target = Path(directory)
        target.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if getattr(self.device, "type", "cpu") == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(activities=activities, record_shapes=True)
        profile.start()
        self._profile, self._directory = profile, target
        return str(target)

    def stop(self) -> str:
        """Stop and write the trace (Chrome trace JSON); returns its path."""
        if self._profile is None:
            raise RuntimeError("no profile is running; start one first")
        profile, directory = self._profile, self._directory
        self._profile = self._directory = None
        profile.stop()
        path = directory / f"pyagent-core-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}-{time.time_ns() % 10**6}.json"
        profile.export_chrome_trace(str(path))
        return str(path)

"""Where the kernels can run, decided once per process.

Triton compiles for a GPU; with ``TRITON_INTERPRET=1`` (read when a kernel is
decorated, so before :mod:`pyagent_triton.attention` or :mod:`pyagent_triton.ops` is
imported) it instead runs the same kernels on CPU tensors in its interpreter, which is
how the tests check them on a machine without a GPU. Anywhere else (no triton, CPU
tensors without the interpreter) the backend computes with the torch twins and says
so once.
"""

from __future__ import annotations

import os
import warnings

_TRUE = {"1", "true", "yes", "on"}
_state: dict[str, object] = {}


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET``)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def _triton_problem() -> str | None:
    """Why Triton cannot be used at all in this process, or None."""
    if "problem" not in _state:
        try:
            import triton  # noqa: F401
        except Exception as exc:  # ImportError, or a broken install
            _state["problem"] = f"triton cannot be imported ({exc})"
        else:
            _state["problem"] = None
    return _state["problem"]  # type: ignore[return-value]


def usable(tensor) -> bool:
    """Whether the kernels can run on ``tensor``'s device; the first time they cannot,
    one warning says why and that the torch twins compute instead."""
    device = tensor.device.type
    problem = _triton_problem()
    if problem is None:
        if interpreted() and device == "cpu":
            return True
        if not interpreted() and device == "cuda":
            return True
        if interpreted():
            problem = f"TRITON_INTERPRET is set, and the interpreter runs kernels on CPU tensors, not {device} ones"
        else:
            problem = f"the tensors are on {device}; Triton compiles for GPUs (TRITON_INTERPRET=1 runs it on the CPU, slowly)"
    if not _state.get("warned"):
        _state["warned"] = True
        warnings.warn(
            f"pyagent-triton: {problem}; the attention backend 'triton' computes with its torch reference ops",
            RuntimeWarning,
            stacklevel=3,
        )
    return False


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for ``n <= 1``), for tile sizes. Plain
    Python: ``triton.next_power_of_2`` goes through Triton's constexpr wrapper, which
    costs several microseconds a call on every launch's host path."""
    return 1 << max(0, int(n) - 1).bit_length()

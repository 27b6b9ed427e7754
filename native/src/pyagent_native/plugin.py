"""Hook implementations of pyagent-native.

The entry point ``native`` in the ``pyagent_framework`` group names this module. The
compiled core is imported when the hooks run, not when the entry point is listed: if
it cannot be imported (no compiler at install time, a CPU or platform it was not
built for, or PYAGENT_NATIVE_ISA naming a build of the kernels this CPU cannot run),
the plugin registers nothing and warns once, naming itself, and the
framework's Python entries serve as before.
"""

from __future__ import annotations

import warnings

from pyagent_framework import hookimpl
from pyagent_framework.errors import PluginWarning

# The pyagent_framework plugin API versions this plugin works with.
PYAGENT_API = ">=1.0,<2"

_core_error: str | None = None
_warned = False


def PYAGENT_DETAILS() -> str:
    """The line ``pyagent plugins`` shows: which build of the kernels runs here."""
    if not core_available():
        return f"compiled core unavailable ({_core_error})"
    from pyagent_native import _core

    return f"kernels: {_core.best_isa()} (this CPU runs {', '.join(_core.available_isas())}; PYAGENT_NATIVE_ISA overrides)"


def core_available() -> bool:
    """Whether the compiled core imports here and has the build of its kernels that
    PYAGENT_NATIVE_ISA names, if set (warns once, naming the plugin, if not)."""
    global _core_error, _warned
    try:
        from pyagent_native import _core

        _core.best_isa()  # PYAGENT_NATIVE_ISA naming a build this CPU cannot run: ValueError
    except (ImportError, ValueError) as exc:
        _core_error = f"{type(exc).__name__}: {exc}"
        if not _warned:
            _warned = True
            warnings.warn(
                f"pyagent-native: the compiled core is unavailable ({_core_error}); "
                "its entries (attention backend and quantizer 'native', eviction policies 'native-lru', "
                "'native-arc' and 'native-s3fifo') are unavailable",
                PluginWarning,
                stacklevel=2,
            )
        return False
    return True


@hookimpl
def pyagent_register_attention_backends(register):
    if not core_available():
        return
    register(
        "native",
        "pyagent_native.attention:NativeAttention",
        description="paged attention with a C++ decode kernel reading the KV cache in place (CPU, float32)",
    )


@hookimpl
def pyagent_register_quantizers(register):
    if not core_available():
        return
    register(
        "native",
        "pyagent_native.linear:NativeQuantizer",
        description="unquantized float32; decode-sized matmuls (<= 32 rows) streamed by a C++ kernel (CPU)",
    )


@hookimpl
def pyagent_register_eviction_policies(register):
    if not core_available():
        return
    register(
        "native-lru",
        "pyagent_native._core:LRUPolicy",
        description="C++ twin of 'lru' (least recently released first); same victims, O(1)",
    )
    register(
        "native-arc",
        "pyagent_native._core:ARCPolicy",
        description="C++ twin of 'arc' from pyagent-eviction (adaptive T1/T2, p moved on rescues); same victims, O(1)",
    )
    register(
        "native-s3fifo",
        "pyagent_native._core:S3FIFOPolicy",
        description=(
            "C++ twin of 's3fifo' from pyagent-eviction (small + main FIFO, capped counters); same victims, O(log n)"
        ),
    )

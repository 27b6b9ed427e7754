"""The builds of the kernels (portable, AVX2, AVX-512): which one runs, the
PYAGENT_NATIVE_ISA override, and what ``pyagent plugins`` says. The kernels of every
build are checked against their references in the other test files (ISAS there is
every build this CPU runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from pyagent_native import _core

BUILDS = ("generic", "avx2", "avx512")


def _run(code: str, isa: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYAGENT_NATIVE_ISA"}
    if isa is not None:
        env["PYAGENT_NATIVE_ISA"] = isa
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_available_builds_start_portable_and_auto_is_the_widest():
    available = _core.available_isas()
    assert available[0] == "generic" and set(available) <= set(BUILDS)
    assert list(available) == [b for b in BUILDS if b in available]  # in order of width
    out = _run("from pyagent_native import _core; print(_core.best_isa())", None)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == available[-1]


@pytest.mark.parametrize("isa", ["portable", "generic", "avx2", "avx512", "auto"])
def test_environment_variable_picks_the_build_auto_runs(isa):
    if isa in ("avx2", "avx512") and isa not in _core.available_isas():
        pytest.skip(f"this CPU has no {isa} build")
    code = (
        "import numpy as np; from pyagent_native import _core\n"
        "x = np.ones((2, 64), np.float32); w = np.ones((8, 64), np.float32); out = np.empty((2, 8), np.float32)\n"
        "_core.linear(out, x, w, None, 1, 'auto')\n"
        "print(_core.best_isa(), float(out.sum()))"
    )
    out = _run(code, isa)
    assert out.returncode == 0, out.stderr
    name, total = out.stdout.split()
    expected = {"portable": "generic", "auto": _core.available_isas()[-1]}.get(isa, isa)
    assert name == expected and float(total) == 2 * 8 * 64


@pytest.mark.parametrize("isa", ["sse9", "AVX2", "avx1024"])
def test_a_build_that_cannot_run_is_a_clear_error_and_the_plugin_steps_aside(isa):
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "from pyagent_native import _core\n"
        "try:\n    _core.best_isa()\nexcept ValueError as exc:\n    print('error:', exc)\n"
        "from pyagent_framework import registries\n"
        "print('backends:', sorted(registries.attention_backends.names()))"
    )
    out = _run(code, isa)
    assert out.returncode == 0, out.stderr
    assert f"error: unknown isa '{isa}' (from PYAGENT_NATIVE_ISA)" in out.stdout
    assert "'native'" not in out.stdout.split("backends:")[1]  # the torch backend serves
    assert "pyagent-native: the compiled core is unavailable" in out.stderr and "PYAGENT_NATIVE_ISA" in out.stderr


def test_an_unavailable_build_by_name_is_refused():
    x = np.ones((1, 32), np.float32)
    w = np.ones((4, 32), np.float32)
    out = np.empty((1, 4), np.float32)
    for isa in BUILDS:
        if isa in _core.available_isas():
            _core.linear(out, x, w, None, 1, isa)
            assert np.all(out == 32)
        else:
            with pytest.raises(ValueError, match=f"isa '{isa}' is not available"):
                _core.linear(out, x, w, None, 1, isa)


def test_pyagent_plugins_names_the_build():
    cli = [sys.executable, "-m", "pyagent_framework", "plugins", "--json"]
    out = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    native = next(p for p in json.loads(out.stdout) if p["name"] == "native")
    assert native["details"].startswith(f"kernels: {_core.best_isa()} (this CPU runs ")

"""`pyagent plugins --check`, strict mode, trace tracebacks and the allowlist, on
deliberately broken plugin distributions.

Each fixture plugin is a real distribution (a ``.dist-info`` with its entry point)
in a folder put on ``PYTHONPATH`` of a fresh interpreter (tests/plugin_dist.py), so
it is discovered exactly as a pip-installed one, and never reaches this process.
"""

from __future__ import annotations

import ast
import json
import tomllib

import pytest

from pyagent_framework import plugins
from tests import plugin_dist
from tests.distributions import REPO, run_cli, run_python

GOOD = {
    "pyagent_check_good/__init__.py": "",
    "pyagent_check_good/plugin.py": """
        PYAGENT_API = ">=1.0,<2"


        def pyagent_register_eviction_policies(register):
            register("check_good_lru", "pyagent_framework.builtins.lru:LRUPolicy")
    """,
}

# A lazy eviction policy whose methods take the wrong arguments: found at first load.
BAD_SIGNATURE = {
    "pyagent_check_badsig/__init__.py": "",
    "pyagent_check_badsig/plugin.py": """
        PYAGENT_API = ">=1.0,<2"


        def pyagent_register_eviction_policies(register):
            register("check_badsig", "pyagent_check_badsig.policy:BadPolicy")
    """,
    "pyagent_check_badsig/policy.py": """
        class BadPolicy:
            def __init__(self, capacity):
                self.blocks = []

            def insert(self):
                pass

            def touch(self, block): ...
            def release(self, block): ...
            def remove(self, block): ...

            def evict(self, n):
                return self.blocks.pop(n)

            def __len__(self):
                return len(self.blocks)
    """,
}

# The same kind of fault given as an object: the plugin fails at load time.
EAGER_BAD_SIGNATURE = {
    "pyagent_check_eager/__init__.py": "",
    "pyagent_check_eager/plugin.py": """
        from pyagent_framework.interfaces import ToolParser

        PYAGENT_API = ">=1.0,<2"


        class ShortParser(ToolParser):
            def extract(self, text):
                return None

            def extract_streaming(self, *args, **kwargs):
                return None


        def pyagent_register_tool_parsers(register):
            register("check_eager", ShortParser)
    """,
}

# pluggy calls a hook with no parameters with no arguments: it registers nothing.
NO_ARG_HOOK = {
    "pyagent_check_noarg/__init__.py": "",
    "pyagent_check_noarg/plugin.py": """
        PYAGENT_API = ">=1.0,<2"


        def pyagent_register_eviction_policies():
            pass
    """,
}

# pluggy refuses a hook whose parameter is not named `register`.
WRONG_PARAMETER = {
    "pyagent_check_param/__init__.py": "",
    "pyagent_check_param/plugin.py": """
        PYAGENT_API = ">=1.0,<2"


        def pyagent_register_eviction_policies(reg):
            reg("check_param", "pyagent_framework.builtins.lru:LRUPolicy")
    """,
}

TYPO = {
    "pyagent_check_typo/__init__.py": "",
    "pyagent_check_typo/plugin.py": """
        PYAGENT_API = ">=1.0,<2"


        def pyagent_register_eviction_policies(register):
            register("check_typo", "pyagent_check_typo.plugin:Missin")
    """,
}

# plugin.py imports a helper module that imports a module that does not exist.
DEEP_IMPORT = {
    "pyagent_check_deep/__init__.py": "",
    "pyagent_check_deep/plugin.py": """
        from pyagent_check_deep import helpers

        PYAGENT_API = ">=1.0,<2"


        def pyagent_register_eviction_policies(register):
            register("check_deep", helpers.TARGET)
    """,
    "pyagent_check_deep/helpers.py": """
        TARGET = "pyagent_framework.builtins.lru:LRUPolicy"

        import pyagent_check_no_such_module  # line 3
    """,
}

FIXTURES = {
    "pyagent-check-good": GOOD,
    "pyagent-check-badsig": BAD_SIGNATURE,
    "pyagent-check-eager": EAGER_BAD_SIGNATURE,
    "pyagent-check-noarg": NO_ARG_HOOK,
    "pyagent-check-param": WRONG_PARAMETER,
    "pyagent-check-typo": TYPO,
    "pyagent-check-deep": DEEP_IMPORT,
}


def folder(tmp_path, *dists: str):
    for dist in dists:
        plugin_dist.write_plugin(tmp_path, dist, FIXTURES[dist])
    return str(tmp_path)


def check(tmp_path, *dists, **env):
    """``pyagent plugins --check`` with only the built-ins and ``dists``."""
    allow = ",".join(["-*", *dists])
    return run_cli("plugins", "--check", PYTHONPATH=folder(tmp_path, *dists), PYAGENT_PLUGINS=allow, **env)


def test_check_passes_on_a_clean_set(tmp_path):
    result = check(tmp_path, "pyagent-check-good")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 failure(s), 0 warning(s); all is well" in result.stdout


def test_check_reports_every_fault_with_its_traceback(tmp_path):
    broken = [d for d in FIXTURES if d != "pyagent-check-good"]
    result = check(tmp_path, "pyagent-check-good", *broken)
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "5 failure(s), 2 warning(s)" in out

    # bad signature (lazy): found by loading the entry; the offending def is shown
    [line] = [ln for ln in out.splitlines() if ln.startswith("FAILED  eviction_policy 'check_badsig'")]
    assert "evict(n) cannot be called as EvictionPolicy.evict() is" in line
    assert "pyagent_check_badsig/policy.py" in out and "def evict(self, n):" in out
    assert "insert() cannot be called as EvictionPolicy.insert(block) is" in out and "def insert(self):" in out
    # bad signature (eager): the plugin fails at load
    assert "FAILED  plugin 'pyagent_check_eager' from distribution pyagent-check-eager 0.0.1" in out
    assert "extract(text) cannot be called as ToolParser.extract(text, request=None) is" in out
    assert "def extract(self, text):" in out
    # the hook without parameters: two warnings (no `register`, nothing registered)
    assert "WARNING  plugin 'pyagent_check_noarg'" in out
    assert "hook pyagent_register_eviction_policies() takes no 'register' parameter" in out
    assert "registered nothing" in out
    # the hook whose parameter is not `register`
    assert "pyagent_register_eviction_policies(reg)" in out and "named 'register'" in out
    # the typo'd lazy target: the error, its traceback and the line that registered it
    assert "FAILED  eviction_policy 'check_typo'" in out
    assert "has no attribute 'Missin'" in out
    assert 'register("check_typo", "pyagent_check_typo.plugin:Missin")' in out
    # the deep import error: traceback through plugin.py into helpers.py line 3
    assert "FAILED  plugin 'pyagent_check_deep'" in out
    assert "ModuleNotFoundError: No module named 'pyagent_check_no_such_module'" in out
    assert 'pyagent_check_deep/helpers.py", line 3' in out
    assert "import pyagent_check_no_such_module  # line 3" in out
    assert "from pyagent_check_deep import helpers" in out
    assert "<frozen importlib" not in out
    assert "check_good_lru" not in out  # the good one has nothing to report


def test_check_json(tmp_path):
    result = run_cli(
        "plugins", "--check", "--json",
        PYTHONPATH=folder(tmp_path, "pyagent-check-good", "pyagent-check-typo", "pyagent-check-noarg"),
        PYAGENT_PLUGINS="-*,pyagent-check-good,pyagent-check-typo,pyagent-check-noarg",
    )
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["ok"] is False
    problems = {(p["distribution"], p["severity"], p["entry"]) for p in report["problems"]}
    assert problems == {
        ("pyagent-check-typo", "failure", "eviction_policy 'check_typo'"),
        ("pyagent-check-noarg", "warning", None),
    }
    [typo] = [p for p in report["problems"] if p["entry"]]
    assert "AttributeError" in typo["traceback"]
    assert "pyagent_check_typo/plugin.py" in typo["registered_at"]


def test_check_is_not_stopped_by_strict_mode(tmp_path):
    result = check(tmp_path, "pyagent-check-good", "pyagent-check-deep", PYAGENT_STRICT_PLUGINS="1")
    assert result.returncode == 1
    assert "FAILED  plugin 'pyagent_check_deep'" in result.stdout
    assert "1 failure(s), 0 warning(s)" in result.stdout


def test_strict_mode_collects_every_failure_and_still_lists(tmp_path):
    path = folder(tmp_path, "pyagent-check-good", "pyagent-check-deep", "pyagent-check-eager")
    env = dict(PYTHONPATH=path, PYAGENT_PLUGINS="-*,pyagent-check-good,pyagent-check-deep,pyagent-check-eager",
               PYAGENT_STRICT_PLUGINS="1")
    result = run_cli("plugins", "--json", **env)
    assert result.returncode == 1
    listed = {p["distribution"]: p for p in json.loads(result.stdout)}
    assert listed["pyagent-check-good"]["status"] == "loaded"
    assert listed["pyagent-framework"]["status"] == "loaded"
    assert listed["pyagent-check-deep"]["status"] == "failed"
    assert listed["pyagent-check-eager"]["status"] == "failed"
    assert "helpers.py" in listed["pyagent-check-deep"]["traceback"]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: 2 plugin failure(s) (PYAGENT_STRICT_PLUGINS=1):"]
    assert "pyagent: failed plugin 'pyagent_check_deep' from distribution pyagent-check-deep" in result.stderr
    assert "pyagent: failed plugin 'pyagent_check_eager' from distribution pyagent-check-eager" in result.stderr
    assert "skipped" not in result.stderr

    # the human listing too, and a host gets one PluginLoadError naming both
    human = run_cli("plugins", **env)
    assert human.returncode == 1 and "pyagent_check_good  [loaded]" in human.stdout
    assert "pyagent_check_deep  [failed]" in human.stdout
    host = run_python(
        """
        from pyagent_framework import registries
        from pyagent_framework.errors import PluginLoadError
        try:
            registries.eviction_policies.names()
        except PluginLoadError as exc:
            print(len(exc.failures), sorted(i.distribution for i in exc.infos if i.status == "failed"))
        """,
        **env,
    )
    assert host.stdout.split("\n")[0] == "2 ['pyagent-check-deep', 'pyagent-check-eager']", host.stderr


def test_strict_mode_fails_a_hook_without_register(tmp_path):
    env = dict(PYTHONPATH=folder(tmp_path, "pyagent-check-noarg"), PYAGENT_PLUGINS="-*,pyagent-check-noarg")
    lenient = run_cli("plugins", "--json", **env)
    assert lenient.returncode == 0
    [noarg] = [p for p in json.loads(lenient.stdout) if p["distribution"] == "pyagent-check-noarg"]
    assert noarg["status"] == "loaded" and len(noarg["warnings"]) == 2
    assert "takes no 'register' parameter" in lenient.stderr and "registered nothing" in lenient.stderr
    strict = run_cli("plugins", "--json", PYAGENT_STRICT_PLUGINS="1", **env)
    assert strict.returncode == 1
    [noarg] = [p for p in json.loads(strict.stdout) if p["distribution"] == "pyagent-check-noarg"]
    assert noarg["status"] == "failed"
    assert "takes no 'register' parameter" in strict.stderr


def test_trace_prints_the_traceback_of_a_skip(tmp_path):
    env = dict(PYTHONPATH=folder(tmp_path, "pyagent-check-deep"), PYAGENT_PLUGINS="-*,pyagent-check-deep")
    traced = run_cli("list", PYAGENT_TRACE_PLUGINS="1", **env)
    assert traced.returncode == 0
    assert "Traceback (most recent call last)" in traced.stderr
    assert 'helpers.py", line 3' in traced.stderr and "import pyagent_check_no_such_module" in traced.stderr
    quiet = run_cli("list", **env)
    assert "Traceback" not in quiet.stderr and "skipped plugin 'pyagent_check_deep'" in quiet.stderr


# --------------------------------------------------------------------------- allowlist


def test_first_party_set_is_the_repository_s_distributions():
    found = set()
    for pyproject in [*REPO.glob("plugins/*/pyproject.toml"), REPO / "kernels/pyproject.toml", REPO / "native/pyproject.toml"]:
        found.add(tomllib.loads(pyproject.read_text())["project"]["name"])
    assert plugins.FIRST_PARTY == found


@pytest.mark.parametrize(
    "value, loaded, excluded",
    [
        (None, {"pyagent-check-good", "pyagent-hf"}, set()),
        ("", {"pyagent-hf", "pyagent-eviction"}, {"pyagent-check-good"}),
        ("pyagent-check-good", {"pyagent-check-good", "pyagent-hf"}, set()),
        ("+pyagent_check_good", {"pyagent-check-good", "pyagent-hf"}, set()),  # the entry-point name
        ("-pyagent-hf", {"pyagent-check-good", "pyagent-eviction"}, {"pyagent-hf"}),
        ("pyagent-check-good,-pyagent-hf", {"pyagent-check-good", "pyagent-eviction"}, {"pyagent-hf"}),
        ("-*", set(), {"pyagent-check-good", "pyagent-hf", "pyagent-eviction"}),
        ("-*,pyagent-check-good", {"pyagent-check-good"}, {"pyagent-hf", "pyagent-eviction"}),
    ],
)
def test_allowlist_semantics(tmp_path, value, loaded, excluded):
    env = {"PYTHONPATH": folder(tmp_path, "pyagent-check-good")}
    if value is not None:
        env["PYAGENT_PLUGINS"] = value
    result = run_cli("plugins", "--json", **env)
    assert result.returncode == 0, result.stderr
    status = {p["distribution"]: p["status"] for p in json.loads(result.stdout)}
    assert status["pyagent-framework"] == "loaded"  # built-ins always
    assert {d for d in loaded if status[d] == "loaded"} == loaded
    assert {d for d in excluded if status[d] == "excluded"} == excluded


def test_parse_allowlist():
    info = plugins.PluginInfo("hf", "pyagent_hf.plugin", "pyagent-hf", "0.1.0")
    third = plugins.PluginInfo("fifo", "pyagent_fifo.plugin", "pyagent-fifo", "0.1.0")
    builtin = plugins.PluginInfo("builtins", "pyagent_framework.builtins", "pyagent-framework", "0.1.0", builtin=True)
    cases = {
        None: (True, True),
        "": (True, False),
        " , ": (True, False),
        "fifo": (True, True),
        "+Pyagent_Fifo": (True, True),
        "-pyagent-hf": (False, True),
        "-pyagent-hf,-fifo": (False, False),
        "-*": (False, False),
        "-*,+fifo": (False, True),
        "-*,hf": (True, False),
    }
    for raw, expected in cases.items():
        allow = plugins.parse_allowlist(raw)
        assert (allow.allows(info), allow.allows(third)) == expected, raw
        assert allow.allows(builtin)


def test_errors_name_the_excluded_plugin_that_provides_the_entry():
    result = run_python(
        """
        from pyagent_framework import registries
        from pyagent_framework.engine.loader import choose_weight_format
        try:
            registries.tokenizers.load("hf")
        except KeyError as exc:
            print(exc)
        try:
            choose_weight_format(".", None)
        except ValueError as exc:
            print(exc)
        print(registries.eviction_policies.names())
        """,
        PYAGENT_PLUGINS="-pyagent-hf",
    )
    tokenizer, weights, names = result.stdout.splitlines()
    assert tokenizer.startswith("unknown tokenizer 'hf' (available: ")
    assert tokenizer.endswith("; PYAGENT_PLUGINS excludes pyagent-hf, which provides tokenizer 'hf'")
    assert weights.startswith("no weight format recognizes . (available: ")
    assert "PYAGENT_PLUGINS excludes pyagent-hf (which provides weight_format 'safetensors', 'gguf')" in weights
    assert "'lfu'" in names  # first-party plugins stay loaded: "-name" removes only that one
    # nothing is said when the allowlist excluded nothing that provides the kind
    unset = run_python(
        """
        from pyagent_framework import registries
        try:
            registries.tokenizers.load("nope")
        except KeyError as exc:
            print(exc)
        """,
    )
    assert "PYAGENT_PLUGINS" not in unset.stdout and "unknown tokenizer 'nope'" in unset.stdout


def test_excluded_providers_register_nothing(tmp_path):
    result = run_python(
        """
        from pyagent_framework import plugins, registries
        print(plugins.excluded_providers("eviction_policy"))
        print("check_good_lru" in registries.eviction_policies)
        """,
        PYTHONPATH=folder(tmp_path, "pyagent-check-good", "pyagent-check-deep"),
        PYAGENT_PLUGINS="-*",
    )
    lines = result.stdout.splitlines()
    providers = ast.literal_eval(lines[0])
    assert providers["pyagent-check-good"] == ["check_good_lru"]
    assert "pyagent-check-deep" not in providers  # it cannot even be imported
    assert providers["pyagent-eviction"] == ["lfu", "arc", "s3fifo"]
    assert lines[1] == "False"

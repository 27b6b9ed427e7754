"""Throwaway plugin distributions, installed into this environment with pip and
discovered through their entry points, exercise the whole loading policy.

Every check runs in a fresh interpreter, so the broken plugins installed here can
never leak into the in-process registries of other tests; they are uninstalled when
the module ends.
"""

from __future__ import annotations

import pytest

from tests.distributions import cli_json, installed, pip_install, pip_uninstall, run_cli, run_python, write_distribution

PREFIX = "pyagent-throwaway-"

GOOD = """
    from pyagent_framework import hookimpl
    from pyagent_framework.interfaces import ToolParser
    from pyagent_framework.types import ExtractedToolCalls

    PYAGENT_API = ">=1.0,<2"


    class UpperParser(ToolParser):
        def extract(self, text, request=None):
            return ExtractedToolCalls(content=text.upper())

        def extract_streaming(self, previous_text, current_text, delta_text,
                              previous_ids, current_ids, delta_ids, request=None):
            return None


    @hookimpl
    def pyagent_register_tool_parsers(register):
        register("throwaway_upper", UpperParser, aliases=("tw_upper",), description="upper-cases", flavour="test")


    @hookimpl
    def pyagent_register_eviction_policies(register):
        register("throwaway_lazy_lru", "pyagent_framework.builtins.lru:LRUPolicy")
"""

VARIANTS = {
    "good": GOOD,
    "importerror": """
        import pyagent_no_such_dependency_xyz
        PYAGENT_API = ">=1.0,<2"
    """,
    "hookraises": """
        PYAGENT_API = ">=1.0,<2"

        def pyagent_register_eviction_policies(register):
            register("throwaway_partial", "pyagent_framework.builtins.lru:LRUPolicy")

        def pyagent_register_tool_parsers(register):
            raise RuntimeError("boom in hook")
    """,
    "badinterface": """
        PYAGENT_API = ">=1.0,<2"

        class NotAPolicy:
            def insert(self, block): ...

        def pyagent_register_eviction_policies(register):
            register("throwaway_bad", NotAPolicy)
    """,
    "oldapi": """
        PYAGENT_API = ">=0.1,<1"

        def pyagent_register_eviction_policies(register):
            register("throwaway_old", "pyagent_framework.builtins.lru:LRUPolicy")
    """,
    "noapi": """
        def pyagent_register_eviction_policies(register):
            register("throwaway_noapi", "pyagent_framework.builtins.lru:LRUPolicy")
    """,
    "unknownhook": """
        PYAGENT_API = ">=1.0,<2"

        def pyagent_register_eviction_policy(register):  # singular: a typo
            register("throwaway_typo", "pyagent_framework.builtins.lru:LRUPolicy")
    """,
    "badsignature": """
        from pyagent_framework import hookimpl
        PYAGENT_API = ">=1.0,<2"

        @hookimpl
        def pyagent_register_eviction_policies(register, extra):
            pass
    """,
    "clash": """
        PYAGENT_API = ">=1.0,<2"

        def pyagent_register_eviction_policies(register):
            register("lru", "pyagent_framework.builtins.lru:LRUPolicy")
    """,
    "override": """
        PYAGENT_API = ">=1.0,<2"

        def pyagent_register_chat_templates(register):
            from pyagent_framework.chat_templates import ChatTemplate
            register("chatml", ChatTemplate("chatml", "OVERRIDDEN"), override=True)
    """,
}

# What each broken variant's warning must say, besides its distribution name.
REASONS = {
    "importerror": "cannot import",
    "hookraises": "pyagent_register_tool_parsers raised RuntimeError: boom in hook",
    "badinterface": "missing __len__, evict, release, remove, touch",
    "oldapi": "supports pyagent_framework API >=0.1,<1, but this kernel provides API 1.0",
    "noapi": "declares no PYAGENT_API",
    "unknownhook": "pyagent_register_eviction_policy (did you mean pyagent_register_eviction_policies?)",
    "badsignature": "invalid hook implementation",
    "clash": "clashes with eviction_policy 'lru' from pyagent-framework",
}


def dist(variant: str) -> str:
    return PREFIX + variant


@pytest.fixture(scope="module")
def throwaways(tmp_path_factory):
    leftovers = installed(PREFIX)
    if leftovers:  # an earlier run died before cleaning up
        pip_uninstall(*leftovers)
    parent = tmp_path_factory.mktemp("throwaway")
    paths = [write_distribution(parent, dist(v), source) for v, source in VARIANTS.items()]
    pip_install(*paths)
    try:
        yield
    finally:
        pip_uninstall(*(dist(v) for v in VARIANTS))


def plugins_json(**env):
    return {p["distribution"]: p for p in cli_json("plugins", "--json", **env)}


def test_good_plugin_is_discovered_with_its_entries(throwaways):
    plugins = plugins_json(PYAGENT_PLUGINS=dist("good"))
    good = plugins[dist("good")]
    assert good["status"] == "loaded"
    assert good["version"] == "0.0.1"
    assert good["name"] == "pyagent_throwaway_good"  # the entry-point name
    assert good["hooks"] == ["pyagent_register_eviction_policies", "pyagent_register_tool_parsers"]
    assert good["entries"] == {"eviction_policy": ["throwaway_lazy_lru"], "tool_parser": ["throwaway_upper"]}

    parsers = {e["name"]: e for e in cli_json("list", "tool_parser", "--json", PYAGENT_PLUGINS=dist("good"))}
    upper = parsers["throwaway_upper"]
    assert upper["provider"]["distribution"] == dist("good")
    assert upper["aliases"] == ["tw_upper"]
    assert upper["metadata"] == {"flavour": "test"}
    assert upper["target"] == "pyagent_throwaway_good.plugin:UpperParser"

    policies = {e["name"]: e for e in cli_json("list", "eviction-policies", "--json", PYAGENT_PLUGINS=dist("good"))}
    assert policies["throwaway_lazy_lru"]["provider"]["distribution"] == dist("good")
    assert policies["lru"]["provider"]["distribution"] == "pyagent-framework"


def test_load_returns_the_plugin_object(throwaways):
    result = run_python(
        """
        from pyagent_framework import registries
        cls = registries.tool_parsers.load("tw_upper")
        print(cls.__module__, cls.__name__, cls().extract("abc").content)
        """,
        PYAGENT_PLUGINS=dist("good"),
        PYAGENT_STRICT_PLUGINS="1",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["pyagent_throwaway_good.plugin", "UpperParser", "ABC"]


def test_allowlist_excludes_plugins_and_accepts_entry_point_names(throwaways):
    first_party = plugins_json(PYAGENT_PLUGINS="")  # empty: the first-party distributions only
    assert first_party[dist("good")]["status"] == "excluded"
    assert first_party["pyagent-framework"]["status"] == "loaded"
    assert first_party["pyagent-hf"]["status"] == "loaded"
    parsers = cli_json("list", "tool_parser", "--json", PYAGENT_PLUGINS="")
    assert "throwaway_upper" not in [e["name"] for e in parsers]
    only_builtins = plugins_json(PYAGENT_PLUGINS="-*")
    assert only_builtins["pyagent-framework"]["status"] == "loaded"
    assert only_builtins["pyagent-hf"]["status"] == only_builtins[dist("good")]["status"] == "excluded"

    by_entry_point_name = plugins_json(PYAGENT_PLUGINS="pyagent_throwaway_good")
    assert by_entry_point_name[dist("good")]["status"] == "loaded"
    assert by_entry_point_name[dist("oldapi")]["status"] == "excluded"


def test_allowlisted_name_that_is_not_installed_warns(throwaways):
    result = run_cli("list", PYAGENT_PLUGINS=f"{dist('good')},pyagent-not-installed")
    assert result.returncode == 0
    assert "PYAGENT_PLUGINS names 'pyagent-not-installed', which is not an installed plugin" in result.stderr
    strict = run_cli("list", PYAGENT_PLUGINS="pyagent-not-installed", PYAGENT_STRICT_PLUGINS="1")
    assert strict.returncode == 1
    assert "pyagent-not-installed" in strict.stderr


def test_excluded_plugin_load_fails_with_unknown_name(throwaways):
    result = run_python(
        """
        from pyagent_framework import registries
        try:
            registries.tool_parsers.load("throwaway_upper")
        except KeyError as exc:
            print(exc)
        """,
        PYAGENT_PLUGINS="",
    )
    assert "unknown tool_parser 'throwaway_upper'" in result.stdout
    assert f"PYAGENT_PLUGINS excludes {dist('good')}, which provides tool_parser 'throwaway_upper'" in result.stdout


def test_every_broken_variant_is_skipped_with_a_warning_naming_it(throwaways):
    result = run_cli("plugins", "--json")  # no allowlist: everything installed
    assert result.returncode == 0, result.stderr
    import json

    plugins = {p["distribution"]: p for p in json.loads(result.stdout)}
    assert plugins[dist("good")]["status"] == "loaded"
    assert plugins[dist("override")]["status"] == "loaded"
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: pyagent: skipped")]
    assert len(warnings) == len(REASONS), result.stderr
    for variant, reason in REASONS.items():
        assert plugins[dist(variant)]["status"] == "skipped"
        assert reason in plugins[dist(variant)]["reason"]
        [line] = [w for w in warnings if f"distribution {dist(variant)} 0.0.1" in w]
        assert reason in line


def test_skipped_plugin_leaves_no_entries_behind(throwaways):
    # 'hookraises' registered an eviction policy before its second hook raised.
    names = [e["name"] for e in cli_json("list", "eviction_policy", "--json")]
    assert "throwaway_partial" not in names
    assert "throwaway_bad" not in names and "throwaway_old" not in names
    assert "throwaway_lazy_lru" in names and "lru" in names


@pytest.mark.parametrize("variant", sorted(REASONS))
def test_broken_variant_is_fatal_under_strict(throwaways, variant):
    result = run_cli("plugins", PYAGENT_PLUGINS=dist(variant), PYAGENT_STRICT_PLUGINS="1")
    assert result.returncode == 1
    assert dist(variant) in result.stderr
    assert REASONS[variant] in result.stderr
    assert f"pyagent: failed plugin {dist(variant).replace('-', '_')!r}" in result.stderr  # not "skipped"
    assert f"{dist(variant).replace('-', '_')}  [failed]" in result.stdout  # still listed
    assert "builtins  [loaded]" in result.stdout


def test_override_replaces_a_builtin_and_is_logged(throwaways):
    result = run_python(
        """
        from pyagent_framework import registries
        entry = registries.chat_templates.get("chatml")
        print(entry.provider.distribution, registries.chat_templates.load("chatml").source)
        """,
        PYAGENT_PLUGINS=dist("override"),
        PYAGENT_STRICT_PLUGINS="1",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [dist("override"), "OVERRIDDEN"]
    assert "overrides the one from pyagent-framework" in result.stderr


def test_trace_logs_every_hook_call(throwaways):
    result = run_cli("list", PYAGENT_PLUGINS=dist("good"), PYAGENT_TRACE_PLUGINS="1")
    assert result.returncode == 0
    trace = [line for line in result.stderr.splitlines() if line.startswith("pyagent trace:")]
    assert any("pyagent_register_tool_parsers" in line for line in trace)
    assert any(f"from distribution {dist('good')}" in line and "'throwaway_upper'" in line for line in trace)
    untraced = run_cli("list", PYAGENT_PLUGINS=dist("good"))
    assert "pyagent trace" not in untraced.stderr

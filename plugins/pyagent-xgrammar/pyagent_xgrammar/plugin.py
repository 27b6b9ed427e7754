"""Hook implementations of pyagent-xgrammar. The backend is registered as a lazy
``"module:attr"`` string, so listing plugins does not import xgrammar."""

from pyagent_framework import hookimpl

PYAGENT_API = ">=1.0,<2"


@hookimpl
def pyagent_register_grammar_backends(register):
    register(
        "xgrammar",
        "pyagent_xgrammar.backend:XGrammarBackend",
        description="xgrammar: JSON schema, JSON object, regex, choice and EBNF (GBNF dialect) via pushdown automata",
    )

"""One interface per registry kind. Plugins implement these; they never re-declare them.

Interfaces are abstract base classes: subclassing one gives early errors for missing
methods, but the kernel checks entries structurally (:func:`missing_members`), so an
object that has the required members is accepted without subclassing.
"""

from pyagent_framework.interfaces._check import missing_members, required_members, signature_problems
from pyagent_framework.interfaces.attention import AttentionBackend, LayerOps, layer_ops
from pyagent_framework.interfaces.chat_template import ChatTemplateSource
from pyagent_framework.interfaces.eviction import EvictionPolicy
from pyagent_framework.interfaces.grammar import GrammarBackend, GrammarMatcher, apply_token_bitmask, bitmask_words
from pyagent_framework.interfaces.kv_connector import KVConnector
from pyagent_framework.interfaces.logits_processor import LogitsProcessor
from pyagent_framework.interfaces.model import CrossEncoderArchitecture, EncoderArchitecture, ModelArchitecture
from pyagent_framework.interfaces.proposer import Proposer
from pyagent_framework.interfaces.quantizer import PackedParts, PackedWeight, Quantizer
from pyagent_framework.interfaces.reasoning_parser import ReasoningParser
from pyagent_framework.interfaces.tokenizer import Tokenizer
from pyagent_framework.interfaces.tool_parser import ToolParser
from pyagent_framework.interfaces.weights import WeightFormat

__all__ = [
    "AttentionBackend",
    "ChatTemplateSource",
    "CrossEncoderArchitecture",
    "EncoderArchitecture",
    "EvictionPolicy",
    "GrammarBackend",
    "GrammarMatcher",
    "KVConnector",
    "LayerOps",
    "LogitsProcessor",
    "ModelArchitecture",
    "PackedParts",
    "PackedWeight",
    "Proposer",
    "Quantizer",
    "ReasoningParser",
    "Tokenizer",
    "ToolParser",
    "WeightFormat",
    "apply_token_bitmask",
    "bitmask_words",
    "layer_ops",
    "missing_members",
    "required_members",
    "signature_problems",
]

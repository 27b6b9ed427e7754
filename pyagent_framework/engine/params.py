"""Sampling parameters of one request, validated with errors that name the field."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from pyagent_framework.engine.errors import InvalidRequestError
from pyagent_framework.engine.regex_guard import RegexCostError, check_regex_cost, schema_patterns
from pyagent_framework.types import GrammarSpec

MAX_N = 16
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 256
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
MAX_SEED = 2**63 - 1
MAX_GRAMMAR_CHARS = 128 * 1024  # a schema's JSON text, a regex or a grammar
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1024
OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain a request's output; give exactly one of the constraints (vLLM's names).

    ``json``: a JSON schema (a dict or its JSON text); ``json_object``: any JSON
    object; ``regex``: a pattern the whole output matches; ``choice``: the output is
    one of these strings; ``grammar``: an EBNF grammar in the GBNF dialect
    (``root ::= ...``); ``structural_tag``: free text with tagged JSON inside (a dict
    or its JSON text), as vLLM takes it, ``{"structures": [{"begin", "schema",
    "end"}], "triggers": [...]}``, or xgrammar's ``{"format": {...}}``. ``backend``
    picks a grammar backend by registry name for this request (default: the engine's
    ``grammar_backend``).
    """

    json: Any = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: Any = None
    backend: str | None = None
    _spec: GrammarSpec | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def coerce(cls, value: Any) -> "StructuredOutputsParams":
        """From an instance or a mapping with the same keys (an API request body)."""
        if isinstance(value, cls):
            return value
        if not isinstance(value, Mapping):
            raise InvalidRequestError(
                f"structured_outputs must be an object such as {{\"json\": {{...}}}}, got {type(value).__name__}",
                param="structured_outputs",
            )
        names = {f.name for f in fields(cls) if f.init}
        unknown = sorted(str(k) for k in value if k not in names)
        if unknown:
            raise InvalidRequestError(
                f"structured_outputs: unknown key(s) {', '.join(map(repr, unknown))}; use one of "
                f"{', '.join(sorted(names))}",
                param="structured_outputs",
            )
        return cls(**value)

    def spec(self) -> GrammarSpec:
        """The one constraint as a :class:`GrammarSpec`, checked for shape and size;
        raises :class:`InvalidRequestError` naming the problem. Checked once (a JSON
        schema against its metaschema included); later calls return the same spec."""
        if self._spec is None:
            object.__setattr__(self, "_spec", self._build_spec())
        return self._spec

    def _build_spec(self) -> GrammarSpec:
        given = [name for name in ("json", "regex", "choice", "grammar", "structural_tag") if getattr(self, name) is not None]
        if self.json_object not in (True, False):
            _fail("json_object must be true or false")
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            _fail(
                "give exactly one of json, json_object, regex, choice, grammar, structural_tag"
                + (f" (got {', '.join(given)})" if given else "")
            )
        if self.backend is not None and (not isinstance(self.backend, str) or not self.backend):
            _fail(f"backend must be a grammar backend name, got {self.backend!r}", "backend")
        kind = given[0]
        if kind == "json_object":
            return GrammarSpec("json_object")
        if kind == "json":
            schema = self.json
            text = schema if isinstance(schema, str) else None
            if text is not None:
                _check_size("json", text)
                try:
                    schema = json.loads(text)
                except (ValueError, RecursionError) as exc:
                    _fail(f"the JSON schema is not valid JSON: {exc}", "json")
            if not isinstance(schema, (dict, bool)):
                _fail(f"a JSON schema is an object, got {type(schema).__name__}", "json")
            if text is None:
                try:
                    text = json.dumps(schema)
                except (TypeError, ValueError, RecursionError) as exc:
                    _fail(f"the JSON schema cannot be written as JSON: {exc}", "json")
                _check_size("json", text)
            _check_schema(schema)
            for where, pattern in schema_patterns(schema):
                _check_regex_cost("json", pattern, f"the JSON schema's pattern at {where}: ")
            return GrammarSpec("json_schema", schema)
        if kind == "structural_tag":
            return GrammarSpec("structural_tag", _structural_tag(self.structural_tag))
        if kind == "choice":
            choices = self.choice
            if isinstance(choices, str) or not isinstance(choices, (list, tuple)) or not choices:
                _fail("choice must be a non-empty list of strings", "choice")
            if len(choices) > MAX_CHOICES:
                _fail(f"choice may have at most {MAX_CHOICES} entries, got {len(choices)}", "choice")
            for item in choices:
                if not isinstance(item, str) or not item or len(item) > MAX_CHOICE_CHARS:
                    _fail(f"each choice must be a non-empty string of at most {MAX_CHOICE_CHARS} characters, got {item!r:.80}", "choice")
            return GrammarSpec("choice", tuple(choices))
        text = getattr(self, kind)
        if not isinstance(text, str) or not text:
            _fail(f"{kind} must be a non-empty string", kind)
        _check_size(kind, text)
        if kind == "regex":
            _check_regex_cost("regex", text)
        return GrammarSpec(kind, text)


def _fail(message: str, key: str | None = None) -> None:
    raise InvalidRequestError(f"structured_outputs: {message}", param="structured_outputs" + (f".{key}" if key else ""))


def _structural_tag(value: Any) -> str:
    """A structural tag checked for shape (its schemas against their metaschema) and
    size, as canonical JSON text."""
    if isinstance(value, str):
        _check_size("structural_tag", value)
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as exc:
            _fail(f"the structural tag is not valid JSON: {exc}", "structural_tag")
    if not isinstance(value, dict):
        _fail(f"a structural tag is an object, got {type(value).__name__}", "structural_tag")
    if value.get("type", "structural_tag") != "structural_tag":
        _fail(f"a structural tag's type is 'structural_tag', got {value.get('type')!r}", "structural_tag")
    if "structures" in value:  # vLLM's form
        structures, triggers = value.get("structures"), value.get("triggers")
        if not isinstance(structures, list) or not structures:
            _fail("structural_tag.structures must be a non-empty list", "structural_tag")
        if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
            _fail("structural_tag.triggers must be a non-empty list of non-empty strings", "structural_tag")
        for index, item in enumerate(structures):
            if not isinstance(item, dict) or not all(isinstance(item.get(k), str) for k in ("begin", "end")):
                _fail(f"structural_tag.structures[{index}] needs 'begin' and 'end' strings and a 'schema'", "structural_tag")
            if not any(item["begin"].startswith(t) for t in triggers):
                _fail(f"structural_tag.structures[{index}]: begin {item['begin']!r} starts with none of the triggers",
                      "structural_tag")
            if not isinstance(item.get("schema"), (dict, bool)):
                _fail(f"structural_tag.structures[{index}].schema must be a JSON schema", "structural_tag")
            _check_schema(item["schema"], "structural_tag")
    elif not isinstance(value.get("format"), dict):
        _fail("a structural tag has 'structures' and 'triggers' (vLLM's form) or a 'format' object", "structural_tag")
    try:
        text = json.dumps(value, sort_keys=True)
    except (TypeError, ValueError, RecursionError) as exc:
        _fail(f"the structural tag cannot be written as JSON: {exc}", "structural_tag")
    _check_size("structural_tag", text)
    return text


def _check_schema(schema: Any, key: str = "json") -> None:
    """Against its draft's metaschema (``$schema``, else 2020-12), so a wrong schema is
    named as such whichever backend would have compiled it."""
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        _fail(f"invalid JSON schema{f' at {where}' if where else ''}: {exc.message}", key)
    except RecursionError:
        _fail("the JSON schema is nested too deeply", key)


def _check_regex_cost(key: str, pattern: str, where: str = "") -> None:
    """Refuse a pattern whose per-token matching cost cannot be bounded (see regex_guard)."""
    try:
        check_regex_cost(pattern)
    except RegexCostError as exc:
        _fail(f"{where}{exc}", key)


def _check_size(key: str, text: str) -> None:
    if len(text) > MAX_GRAMMAR_CHARS:
        _fail(f"{key} may have at most {MAX_GRAMMAR_CHARS} characters, got {len(text)}", key)


@dataclass
class SamplingParams:
    """How to sample one request (vLLM-compatible names and defaults).

    ``temperature=0`` (or ``top_k=1``) is greedy. ``top_k <= 0`` disables top-k.
    ``logprobs=k`` returns the chosen token's logprob and the top k alternatives per
    step; ``prompt_logprobs=k`` the same for every prompt token after the first.
    ``structured_outputs`` (a :class:`StructuredOutputsParams` or a mapping of its
    keys) constrains the output to a JSON schema, regex, choice list or grammar; the
    output then ends where the grammar does (``min_tokens`` and ``ignore_eos`` cannot
    extend it).
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    priority: int = 0
    structured_outputs: StructuredOutputsParams | Mapping[str, Any] | None = None
    speculative: bool = True  # False: never draft for this request (with --speculative-method)
    best_of: int | None = None  # draw this many samples, return the n of highest cumulative logprob
    bad_words: list[str] | None = None  # never generated: their last token is barred after the rest
    allowed_token_ids: list[int] | None = None  # only these may be generated
    # Registered logits processors, in order: [{"name": "no_repeat_ngram", "args": {"n": 3}}, ...]
    # (or LogitsProcessorSpec structs, or bare names); checked and built once by validate().
    logits_processors: list[Any] | None = None
    # What each output holds: "cumulative" (everything so far), "delta" (what is new since
    # the previous output: streaming in O(n)) or "final_only" (one output, at the end).
    output_kind: str = "cumulative"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def num_samples(self) -> int:
        """How many samples are drawn: ``best_of`` when set, else ``n``."""
        return self.best_of or self.n

    @property
    def ranked(self) -> bool:
        """Whether ``n`` of more samples are chosen (``best_of > n``)."""
        return self.best_of is not None and self.best_of > self.n

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Check every field; raise :class:`InvalidRequestError` naming the first bad one."""
        _int("n", self.n, low=1, high=MAX_N)
        if self.best_of is not None:
            _int("best_of", self.best_of, low=self.n, high=MAX_N)
            if self.ranked and self.output_kind == "delta":
                raise InvalidRequestError("best_of > n cannot be streamed: the samples are ranked once they have ended",
                                          param="best_of")
            if self.ranked and self.greedy:
                raise InvalidRequestError("best_of > n needs sampling (temperature > 0): greedy samples are all the same",
                                          param="best_of")
        if self.output_kind not in OUTPUT_KINDS:
            raise InvalidRequestError(f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}", param="output_kind")
        if not isinstance(self.speculative, bool):
            raise InvalidRequestError(f"speculative must be true or false, got {self.speculative!r}", param="speculative")
        if self.max_tokens is not None:
            _int("max_tokens", self.max_tokens, low=1)
        _int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})", param="min_tokens"
            )
        _float("temperature", self.temperature, low=0.0)
        _int("top_k", self.top_k, low=-1)
        _float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _float("min_p", self.min_p, low=0.0, high=1.0)
        _float("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        _float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        _float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        if self.seed is not None:
            _int("seed", self.seed, low=-MAX_SEED, high=MAX_SEED)
        if self.logprobs is not None:
            _int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _int("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        _int("priority", self.priority)
        stops = self.stop_strings
        if len(stops) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}", param="stop")
        for stop in stops:
            if not isinstance(stop, str) or not stop:
                raise InvalidRequestError(f"stop strings must be non-empty strings, got {stop!r}", param="stop")
            if len(stop) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(
                    f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters, got {len(stop)}", param="stop"
                )
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}", param="stop_token_ids"
            )
        for token in self.stop_token_ids or []:
            _token_id("stop_token_ids", token, vocab_size)
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise InvalidRequestError(
                    f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}", param="logit_bias"
                )
            for token, bias in self.logit_bias.items():
                _token_id("logit_bias", token, vocab_size)
                _float("logit_bias", bias, low=-100.0, high=100.0)
        if self.bad_words is not None:
            words = [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words
            if not isinstance(words, list) or len(words) > MAX_BAD_WORDS:
                raise InvalidRequestError(f"bad_words must be a list of at most {MAX_BAD_WORDS} strings", param="bad_words")
            for word in words:
                if not isinstance(word, str) or not word.strip() or len(word) > MAX_BAD_WORD_CHARS:
                    raise InvalidRequestError(f"bad_words must be non-blank strings of at most {MAX_BAD_WORD_CHARS} "
                                              f"characters, got {word!r}"[:300], param="bad_words")
            self.bad_words = list(words)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise InvalidRequestError("allowed_token_ids must be a non-empty list of token ids", param="allowed_token_ids")
            if vocab_size is not None and len(self.allowed_token_ids) > vocab_size:
                raise InvalidRequestError(f"allowed_token_ids has {len(self.allowed_token_ids)} entries; the vocabulary has "
                                          f"{vocab_size}", param="allowed_token_ids")
            for token in self.allowed_token_ids:
                _token_id("allowed_token_ids", token, vocab_size)
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
            self.structured_outputs.spec()
        if self.logits_processors is not None:
            from pyagent_framework.engine.logits_processors import check_logits_processors

            self.logits_processors = check_logits_processors(self.logits_processors)
        return self

    def replace(self, **changes: Any) -> "SamplingParams":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return SamplingParams(**values)


def _int(name: str, value: Any, *, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", param=name)
    if low is not None and value < low:
        raise InvalidRequestError(f"{name} must be >= {low}, got {value}", param=name)
    if high is not None and value > high:
        raise InvalidRequestError(f"{name} must be <= {high}, got {value}", param=name)


def _float(name: str, value: Any, *, low: float, high: float | None = None, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", param=name)
    if value < low or (low_open and value == low):
        bound = f"> {low}" if low_open else f">= {low}"
        raise InvalidRequestError(f"{name} must be {bound}, got {value}", param=name)
    if high is not None and value > high:
        raise InvalidRequestError(f"{name} must be <= {high}, got {value}", param=name)


def _token_id(name: str, token: Any, vocab_size: int | None) -> None:
    if isinstance(token, bool) or not isinstance(token, int):
        raise InvalidRequestError(f"{name}: token ids must be integers, got {token!r}", param=name)
    if token < 0 or (vocab_size is not None and token >= vocab_size):
        raise InvalidRequestError(f"{name}: token id {token} is outside the vocabulary (0..{(vocab_size or 0) - 1})", param=name)


@dataclass(frozen=True)
class PoolingParams:
    """How to make one embedding (vLLM's names).

    ``truncate_prompt_tokens``: keep only the last k tokens of a longer input (-1: as
    many as the model reads) rather than refusing it; ``normalize``: unit length (None:
    as the model's files say); ``dimensions``: the first k of them, for a model trained
    to allow it (Matryoshka), normalized again if normalized at all.
    """

    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    dimensions: int | None = None

    def check(self, hidden_size: int, matryoshka: bool, max_model_len: int) -> None:
        for key in ("truncate_prompt_tokens", "dimensions"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise InvalidRequestError(f"{key} must be an integer, got {value!r}", param=key)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise InvalidRequestError(f"normalize must be true or false, got {self.normalize!r}", param="normalize")
        k = self.truncate_prompt_tokens
        if k is not None and k != -1 and not 1 <= k <= max_model_len:
            raise InvalidRequestError(f"truncate_prompt_tokens must be -1 or 1..{max_model_len}, got {k}",
                                      param="truncate_prompt_tokens")
        if self.dimensions is not None:
            if not matryoshka:
                raise InvalidRequestError("dimensions: this model's embeddings cannot be cut to fewer dimensions (it "
                                          "declares no matryoshka_dimensions)", param="dimensions")
            if not 1 <= self.dimensions <= hidden_size:
                raise InvalidRequestError(f"dimensions must be 1..{hidden_size}, got {self.dimensions}", param="dimensions")


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter to generate with: ``name`` of one the engine has loaded, or with
    ``path`` (a PEFT directory) one it loads under that name the first time it is asked."""

    name: str
    path: str | None = None

"""Structured outputs on the embedded SmolLM2-135M-Instruct: a corpus of JSON schemas,
regexes and choice lists, each run as one batch per (grammar backend, sampling mode).
Every output must end because the grammar ended (``finish_reason == "stop"``) and
parse and validate: 100%, greedy and sampled, xgrammar and outlines.

Runs (one ``llm.generate`` call each, JSON schemas, regexes and choices together):

* ``xgrammar`` greedy and sampled: every spec;
* ``outlines`` greedy: the specs outlines accepts (the ones it refuses must fail with
  :class:`InvalidRequestError` naming the keyword before anything runs);
* ``auto`` sampled, outlines tried first: every spec is served, outlines' refusals
  by xgrammar.

The schemas keep strings and arrays bounded so the model cannot ramble past the
grammar's end; a failure names the spec's index, its text and its finish reason.
"""

from __future__ import annotations

import datetime
import json
import re
import time

import jsonschema
import pytest

from pyagent_framework import LLM, SamplingParams, registries
from pyagent_framework.engine import structured
from pyagent_framework.engine.errors import InvalidRequestError

pytestmark = pytest.mark.in_process  # reads the engine core's state

MAX_TOKENS = 256
TEMPERATURE = 0.8
SEED = 1000


def obj(properties: dict, required: list[str] | None = None, **extra) -> dict:
    """A closed object schema; every property is required unless ``required`` says."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


def text(max_length: int, **extra) -> dict:
    return {"type": "string", "minLength": 1, "maxLength": max_length, **extra}


def integer(low: int, high: int, **extra) -> dict:
    return {"type": "integer", "minimum": low, "maximum": high, **extra}


POINT = {"$defs": {"point": obj({"x": integer(-100, 100), "y": integer(-100, 100)})}}
SMALL = {"enum": [1, 2, 3, 4, 5, 10]}  # a bounded number outlines can enforce (it cannot enforce bounds)

# (prompt, schema): ask for the data in plain words; the grammar does the rest. Schemas
# where numeric bounds or formats are not the point avoid them, so outlines (which
# refuses what it cannot enforce) runs most of the corpus too.
JSON_CORPUS: list[tuple[str, dict]] = [
    # 0 nested array of enums, a patterned year
    ("Give a JSON object describing a book.", obj({
        "title": text(30), "author": text(24), "year": {"type": "string", "pattern": "^(1[5-9]|20)[0-9]{2}$"},
        "genres": {"type": "array", "items": {"enum": ["fiction", "history", "science", "poetry"]}, "minItems": 1, "maxItems": 3},
    })),
    # 1 nested object with a patterned string
    ("Give a JSON object describing a person and their home address.", obj({
        "name": text(24),
        "address": obj({"street": text(30), "city": text(20), "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    })),
    # 2 array of enums with minItems/maxItems
    ("List some colors you like as JSON.", obj({
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue", "yellow", "black"]}, "minItems": 2, "maxItems": 4},
    })),
    # 3 const
    ("Give the API status as JSON.", obj({"version": {"const": "1.0"}, "healthy": {"type": "boolean"}})),
    # 4 anyOf: a patterned string or a number from a list
    ("Give a JSON object with the id of a record.", obj({
        "id": {"anyOf": [{"type": "string", "pattern": "^[a-z]{3}-[0-9]{3}$"}, {"enum": [100, 200, 300]}]},
    })),
    # 5 oneOf, branches told apart by a const
    ("Describe a geometric shape as JSON.", {"oneOf": [
        obj({"kind": {"const": "circle"}, "radius": SMALL}),
        obj({"kind": {"const": "square"}, "side": SMALL}),
    ]}),
    # 6 minimum/maximum on a number and an integer
    ("Give today's weather as JSON.", obj({
        "temperature_c": {"type": "number", "minimum": -50, "maximum": 50}, "humidity": integer(0, 100),
    })),
    # 7 exclusiveMinimum on an integer and on a number
    ("Give a JSON object for an order line: quantity and unit price.", obj({
        "quantity": {"type": "integer", "exclusiveMinimum": 0, "maximum": 1000},
        "unit_price": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000},
    })),
    # 8 string patterns
    ("Give a product's stock code and a US phone number as JSON.", obj({
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "phone": {"type": "string", "pattern": "^\\+1-[0-9]{3}-[0-9]{3}-[0-9]{4}$"},
    })),
    # 9 format: date
    ("Give a JSON object for a calendar event.", obj({"event": text(30), "date": {"type": "string", "format": "date"}})),
    # 10 format: email
    ("Give a JSON object with a contact's name and email address.", obj({"name": text(24), "email": {"type": "string", "format": "email"}})),
    # 11 format: uuid
    ("Give a JSON object for a user account with a unique id.", obj({"id": {"type": "string", "format": "uuid"}, "active": {"type": "boolean"}})),
    # 12 format: date-time
    ("Give a JSON object for a log entry with a timestamp.", obj({"message": text(30), "timestamp": {"type": "string", "format": "date-time"}})),
    # 13 format: ipv4
    ("Give a JSON object describing a server's address and port.", obj({"host": {"type": "string", "format": "ipv4"}, "port": integer(1, 65535)})),
    # 14 $ref / $defs
    ("Give a JSON object with the billing and shipping contacts of an order.", {
        "$defs": {"contact": obj({"name": text(20), "phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}})},
        **obj({"billing": {"$ref": "#/$defs/contact"}, "shipping": {"$ref": "#/$defs/contact"}}),
    }),
    # 15 recursive $ref: a linked list, ended by null
    ("Write the linked list 7 -> 4 -> null as JSON.", {
        "$defs": {"node": obj({"value": {"enum": list(range(10))}, "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}})},
        "$ref": "#/$defs/node",
    }),
    # 16 recursive $ref through an optional property
    ("Give a JSON menu: a 'File' entry whose submenu is 'Open'.", {
        "$defs": {"entry": obj({"label": text(16), "submenu": {"$ref": "#/$defs/entry"}}, required=["label"])},
        "$ref": "#/$defs/entry",
    }),
    # 17 required vs optional
    ("Give a JSON object for a user profile.", obj(
        {"username": text(16), "bio": text(30), "verified": {"type": "boolean"}}, required=["username"],
    )),
    # 18 everything optional, nothing else allowed
    ("Give a JSON object with display settings.", obj(
        {"theme": {"enum": ["light", "dark"]}, "font_size": {"enum": [12, 14, 16]}}, required=[],
    )),
    # 19 booleans
    ("Give a user's permissions as JSON.", obj({"is_admin": {"type": "boolean"}, "can_edit": {"type": "boolean"}, "can_delete": {"type": "boolean"}})),
    # 20 nulls
    ("Give a JSON object for a person who has no middle name.", obj({
        "first_name": text(16), "middle_name": {"type": "null"}, "last_name": {"anyOf": [text(16), {"type": "null"}]},
    })),
    # 21 array of objects
    ("Give a shopping cart as JSON.", obj({
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": obj({
            "name": text(16), "qty": SMALL, "unit": {"enum": ["kg", "piece", "liter"]},
        })},
    })),
    # 22 an enum of mixed types
    ("Give the status of a job as JSON.", obj({"status": {"enum": ["queued", "running", "done", None, 0]}})),
    # 23 three levels of nesting
    ("Describe a company, one of its departments and its manager as JSON.", obj({
        "company": obj({"name": text(24), "department": obj({"name": text(20), "manager": obj({"name": text(24), "remote": {"type": "boolean"}})})}),
    })),
    # 24 array of bounded strings
    ("Give tags for a blog post about cooking as JSON.", obj({
        "tags": {"type": "array", "items": text(12), "minItems": 1, "maxItems": 4},
    })),
    # 25 a top-level array of bounded integers
    ("Roll three dice and give the results as a JSON array.", {
        "type": "array", "items": integer(1, 6), "minItems": 3, "maxItems": 3,
    }),
    # 26 a top-level enum
    ("Is the sky blue? Answer as a JSON string.", {"enum": ["yes", "no", "maybe"]}),
    # 27 a top-level bounded integer
    ("Pick a number from 1 to 10.", integer(1, 10)),
    # 28 a type list
    ("Give a JSON object with an optional comment.", obj({"comment": {"type": ["string", "null"], "maxLength": 20}})),
    # 29 prefixItems: a tuple
    ("Give a user name and role as a JSON array.", {
        "type": "array", "prefixItems": [text(16), {"enum": ["admin", "editor", "guest"]}], "minItems": 2, "maxItems": 2,
    }),
    # 30 oneOf over disjoint types
    ("Give a JSON object with one setting value.", obj({
        "value": {"oneOf": [{"type": "boolean"}, {"type": "string", "pattern": "^[a-z]{1,10}$"}, {"type": "null"}]},
    })),
    # 31 const number and const string
    ("Give a JSON event header.", obj({"schema_version": {"const": 2}, "kind": {"const": "event"}, "source": text(20)})),
    # 32 exclusiveMaximum on a number, negative integer bounds
    ("Give a JSON object for a diving spot: probability of seeing fish and depth.", obj({
        "probability": {"type": "number", "minimum": 0, "exclusiveMaximum": 1}, "depth_m": integer(-200, -1),
    })),
    # 33 array of objects that reuse a $def with bounded integers
    ("Give the corners of a triangle as JSON.", {
        **POINT, **obj({"corners": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 3, "maxItems": 3}}),
    }),
    # 34 minLength and maxLength, an enum of numbers
    ("Give a JSON object for a hotel review.", obj({"summary": {"type": "string", "minLength": 5, "maxLength": 40}, "stars": {"enum": [1, 2, 3, 4, 5]}})),
    # 35 array of arrays
    ("Give a 2 by 2 grid of zeros and ones as JSON.", {
        "type": "array", "minItems": 2, "maxItems": 2,
        "items": {"type": "array", "items": {"enum": [0, 1]}, "minItems": 2, "maxItems": 2},
    }),
    # 36 anyOf of objects
    ("Give a payment method as JSON.", obj({"payment": {"anyOf": [
        obj({"card_last4": {"type": "string", "pattern": "^[0-9]{4}$"}}),
        obj({"iban": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}[A-Z0-9]{4,12}$"}}),
    ]}})),
]

# (prompt, pattern): the output must match the whole pattern (Python's re.fullmatch).
REGEX_CORPUS: list[tuple[str, str]] = [
    ("Write a US phone number.", r"\(\d{3}\) \d{3}-\d{4}"),
    ("Write today's date.", r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"),
    ("Name a Python variable for a user count.", r"[A-Za-z_][A-Za-z0-9_]{0,15}"),
    ("Name an animal.", r"(cat|dog|bird|horse)s?"),
    ("Repeat the syllable ab a few times, then c.", r"(ab){2,4}c"),
    ("Write a word in Greek letters.", r"[α-ω]{3,6}"),
    ("Write a word with an accent or a Japanese word.", r"(café|naïve|日本語)"),
    ("Give a color as a hex code.", r"#[0-9a-f]{6}"),
    ("Give an IP address.", r"(\d{1,3}\.){3}\d{1,3}"),
    ("What time is it?", r"([01]\d|2[0-3]):[0-5]\d"),
    ("Write an email address.", r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"),
    ("Give a software version number.", r"v?\d{1,2}\.\d{1,2}\.\d{1,2}"),
    ("How is it spelled, color or colour?", r"colou?r"),
    ("Reply with a few emoji.", r"(😀|🎉|👍){1,3}"),
]

# (prompt, choices): the output must be one of them.
CHOICE_CORPUS: list[tuple[str, list[str]]] = [
    ("Say ab or abab.", ["ab", "abab"]),
    ("Give one, twelve or one hundred twenty three in digits.", ["1", "12", "123"]),
    ("Quote someone.", ['say "hi"', "it's", "a \\ b", "tab\tand space"]),
    ("Pick a word.", ["café", "naïve", "日本", "😀", "über"]),
    ("Pick a pattern.", ["a.b", "a*b", "(x)", "[y]", "\\d+", "^$", "a|b", "{1}", "#&-~"]),
    ("Is it red?", ["red", "red wine", "reddish", " red "]),
]

# Formats checked as the 2020-12 draft defines them, plus date-time (RFC 3339), which
# jsonschema checks only with an optional package.
FORMATS = jsonschema.FormatChecker(["date", "email", "ipv4", "uuid"])
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}[Tt]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})")


@FORMATS.checks("date-time", raises=ValueError)
def _date_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    if not _RFC3339.fullmatch(value):
        return False
    datetime.datetime.fromisoformat(value.upper().replace("Z", "+00:00"))  # a real day and time
    return True


def test_corpus_is_as_wide_as_promised():
    assert len(JSON_CORPUS) >= 30 and len(REGEX_CORPUS) >= 10 and len(CHOICE_CORPUS) >= 5
    for _, schema in JSON_CORPUS:
        jsonschema.Draft202012Validator.check_schema(schema)
    for _, pattern in REGEX_CORPUS:
        re.compile(pattern)
    assert any(a != b and b.startswith(a) for _, c in CHOICE_CORPUS for a in c for b in c)
    # The format checks check something.
    for value, fmt, ok in [("2023-02-28", "date", True), ("2023-02-31", "date", False), ("a@b.io", "email", True),
                           ("ab", "email", False), ("10.0.0.1", "ipv4", True), ("300.0.0.1", "ipv4", False),
                           ("12345678-1234-1234-1234-123456789abc", "uuid", True), ("12345678", "uuid", False),
                           ("2023-08-18T14:20:08Z", "date-time", True), ("2023-08-18T14:20:08+02:00", "date-time", True),
                           ("2023-08-18T14:20:08", "date-time", False), ("2023-04-31T10:00:00Z", "date-time", False)]:
        assert FORMATS.conforms(value, fmt) is ok, (value, fmt)
    # oneOf branches exclude each other: a valid instance matches exactly one.
    shapes = jsonschema.Draft202012Validator(JSON_CORPUS[5][1])
    assert shapes.is_valid({"kind": "circle", "radius": 3}) and not shapes.is_valid({"kind": "circle", "side": 3})


# ---------------------------------------------------------------- the runs


def has_outlines() -> bool:
    return "outlines" in registries.grammar_backends.names()


@pytest.fixture(scope="module")
def llm():
    # One batch holds a whole run. outlines' token indices over SmolLM2's 49k tokens are
    # 10 to 40 MB each: a cache that holds every grammar of a run (else the engine
    # compiles the evicted ones again when it queues them) and a compile timeout that
    # allows for a busy CPU.
    return LLM(max_num_seqs=64, grammar_cache_memory="2GiB", grammar_compile_timeout=120.0)


def json_spec(schema: dict, backend: str) -> dict:
    return {"json": schema, "backend": backend}


def compile_result(llm, spec: dict):
    """The compiled grammar for ``spec``, or the InvalidRequestError refusing it."""
    try:
        structured = SamplingParams(structured_outputs=spec).validate().structured_outputs
        return llm.engine.core.grammar.structured.submit(structured.spec(), structured.backend).result()
    except InvalidRequestError as exc:
        return exc


@pytest.fixture(scope="module")
def outlines_verdicts(llm):
    """Schema index -> compiled grammar or the refusal, when forced onto outlines."""
    if not has_outlines():
        pytest.skip("the outlines grammar backend is not installed")
    verdicts = {i: compile_result(llm, json_spec(schema, "outlines")) for i, (_, schema) in enumerate(JSON_CORPUS)}
    refused = {i: str(v) for i, v in verdicts.items() if isinstance(v, Exception)}
    print(f"\noutlines refuses {len(refused)} of {len(JSON_CORPUS)} schemas:")
    for i, message in refused.items():
        print(f"  #{i}: {message}")
    return verdicts


def specs_for(backend: str, skip: set[int] = frozenset()) -> list[tuple[str, int, str, dict]]:
    """(kind, index, prompt, structured_outputs) for every spec of a run."""
    specs = [("json", i, p, json_spec(s, backend)) for i, (p, s) in enumerate(JSON_CORPUS) if i not in skip]
    specs += [("regex", i, p, {"regex": r, "backend": backend}) for i, (p, r) in enumerate(REGEX_CORPUS)]
    specs += [("choice", i, p, {"choice": c, "backend": backend}) for i, (p, c) in enumerate(CHOICE_CORPUS)]
    return specs


def seed(kind: str, index: int) -> int:
    """The same seed for a spec in every sampled run, wherever it sits in the batch."""
    return SEED + 100 * ("json", "regex", "choice").index(kind) + index


class Run:
    def __init__(self, llm, backend: str, mode: str, skip: set[int] = frozenset()) -> None:
        self.backend, self.mode = backend, mode
        self.specs = specs_for(backend, skip)
        prompts = [llm.encode_chat([{"role": "user", "content": prompt}]) for _, _, prompt, _ in self.specs]
        if mode == "greedy":
            params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured_outputs=s) for *_, s in self.specs]
        else:
            params = [
                SamplingParams(max_tokens=MAX_TOKENS, temperature=TEMPERATURE, seed=seed(kind, i), structured_outputs=s)
                for kind, i, _, s in self.specs
            ]
        started = time.perf_counter()
        # Compiled here first (generate finds them in the cache) to see who serves each.
        self.served_by = [compile_result(llm, s).backend_name for *_, s in self.specs]
        results = llm.generate(prompts, params)
        self.seconds = time.perf_counter() - started
        self.outputs = [r.outputs[0] for r in results]
        tokens = sum(len(o.token_ids) for o in self.outputs)
        print(f"\n{backend} {mode}: {len(self.specs)} requests, {tokens} tokens in {self.seconds:.1f} s")

    def of_kind(self, kind: str):
        return [(i, spec, out) for (k, i, _, spec), out in zip(self.specs, self.outputs) if k == kind]


def describe(kind: str, index: int, run: Run, out, problem: str) -> str:
    return (f"{kind} #{index} ({run.backend}, {run.mode}): {problem}; finish_reason={out.finish_reason!r} "
            f"text={out.text!r}")


def json_failures(run: Run) -> list[str]:
    failures = []
    for i, spec, out in run.of_kind("json"):
        if out.finish_reason != "stop":
            failures.append(describe("schema", i, run, out, "did not end with the grammar"))
            continue
        try:
            value = json.loads(out.text)
        except ValueError as exc:
            failures.append(describe("schema", i, run, out, f"not JSON ({exc})"))
            continue
        try:
            jsonschema.validate(value, spec["json"], format_checker=FORMATS)
        except jsonschema.ValidationError as exc:
            failures.append(describe("schema", i, run, out, f"invalid at {'/'.join(map(str, exc.absolute_path)) or '(root)'}: {exc.message}"))
    return failures


def regex_and_choice_failures(run: Run) -> list[str]:
    failures = []
    for i, spec, out in run.of_kind("regex"):
        if out.finish_reason != "stop" or not re.fullmatch(spec["regex"], out.text):
            failures.append(describe("regex", i, run, out, f"does not match {spec['regex']!r}"))
    for i, spec, out in run.of_kind("choice"):
        if out.finish_reason != "stop" or out.text not in spec["choice"]:
            failures.append(describe("choice", i, run, out, f"not one of {spec['choice']!r}"))
    return failures


RUNS = [("xgrammar", "greedy"), ("xgrammar", "sampled"), ("outlines", "greedy"), ("auto", "sampled")]


@pytest.fixture(scope="module")
def runs(llm, request):
    """Each (backend, mode) run once, on first use."""
    done: dict[tuple[str, str], Run] = {}

    def get(backend: str, mode: str) -> Run:
        if (backend, mode) not in done:
            if backend == "xgrammar":
                done[backend, mode] = Run(llm, backend, mode)
            elif backend == "outlines":
                verdicts = request.getfixturevalue("outlines_verdicts")
                done[backend, mode] = Run(llm, backend, mode, skip={i for i, v in verdicts.items() if isinstance(v, Exception)})
            else:  # auto, outlines first: its refusals must fall back to xgrammar
                request.getfixturevalue("outlines_verdicts")
                with pytest.MonkeyPatch.context() as patch:
                    patch.setattr(structured, "PREFERRED_BACKENDS", ("outlines", "xgrammar"))
                    done[backend, mode] = Run(llm, backend, mode)
        return done[backend, mode]

    return get


@pytest.mark.parametrize("backend, mode", RUNS, ids=[f"{b}-{m}" for b, m in RUNS])
def test_every_json_output_validates(runs, backend, mode):
    run = runs(backend, mode)
    failures = json_failures(run)
    assert not failures, f"{len(failures)} of {len(run.of_kind('json'))} outputs fail:\n" + "\n".join(failures)


@pytest.mark.parametrize("backend, mode", RUNS, ids=[f"{b}-{m}" for b, m in RUNS])
def test_every_regex_and_choice_output_matches(runs, backend, mode):
    run = runs(backend, mode)
    failures = regex_and_choice_failures(run)
    assert not failures, "\n".join(failures)


# ---------------------------------------------------------------- outlines' refusals


KEYWORD_CONTAINERS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def schema_words(schema: object) -> set[str]:
    """The keywords a schema uses (not its property names) and its format names."""
    words: set[str] = set()
    if isinstance(schema, dict):
        for key, value in schema.items():
            words.add(key)
            if key == "format" and isinstance(value, str):
                words.add(value)
            if key in KEYWORD_CONTAINERS and isinstance(value, dict):
                for sub in value.values():
                    words |= schema_words(sub)
            else:
                words |= schema_words(value)
    elif isinstance(schema, list):
        for item in schema:
            words |= schema_words(item)
    return words


def test_outlines_refusals_name_a_keyword_and_fail_before_anything_runs(llm, outlines_verdicts):
    refused = {i: v for i, v in outlines_verdicts.items() if isinstance(v, Exception)}
    for i, error in refused.items():
        message = str(error)
        assert error.param == "structured_outputs", message
        assert message.startswith("structured_outputs: no grammar backend supports this spec (outlines: "), message
        reason = message.split("(outlines: ", 1)[1]
        named = [w for w in schema_words(JSON_CORPUS[i][1]) if re.search(rf"(?<![\w$-]){re.escape(w)}(?![\w-])", reason)]
        assert named, f"schema #{i}: the refusal names none of the schema's keywords: {message}"
        # Submitted for real beside a request that is fine, it fails before either is queued.
        prompt, schema = JSON_CORPUS[i]
        with pytest.raises(InvalidRequestError, match="no grammar backend supports this spec"):
            refused_params = SamplingParams(max_tokens=8, structured_outputs=json_spec(schema, "outlines"))
            llm.generate([prompt, prompt], [SamplingParams(max_tokens=8), refused_params])
        assert not llm.engine.has_unfinished_requests()


def test_auto_serves_every_schema_and_outlines_refusals_fall_back_to_xgrammar(runs, outlines_verdicts):
    run = runs("auto", "sampled")
    for (kind, i, _, _), backend in zip(run.specs, run.served_by):
        expected = "xgrammar" if kind == "json" and isinstance(outlines_verdicts[i], Exception) else "outlines"
        assert backend == expected, f"{kind} #{i} served by {backend}"

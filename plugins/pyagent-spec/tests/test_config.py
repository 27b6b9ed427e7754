"""Config checking: defaults, unknown keys, bad values (the error names the key)."""

import pytest

from pyagent_spec.ngram import NgramProposer
from pyagent_spec.suffix import SuffixProposer


def test_defaults():
    ngram = NgramProposer({})
    assert (ngram.n_min, ngram.n_max, ngram.k) == (2, 5, 5)
    suffix = SuffixProposer({})
    assert (suffix.k, suffix.max_depth, suffix.max_cached_outputs) == (8, 24, 256)
    assert (suffix.min_match, suffix.min_token_prob, suffix.min_count) == (2, 0.1, 1)
    assert (suffix.max_spec_factor, suffix.max_spec_offset, suffix.max_candidates) == (1.0, 0.0, 64)
    assert suffix.max_cached_tokens == 262144
    assert NgramProposer(None).k == 5 and SuffixProposer(None).k == 8


def test_values_are_taken():
    ngram = NgramProposer({"n_min": 1, "n_max": 3, "k": 7})
    assert (ngram.n_min, ngram.n_max, ngram.k) == (1, 3, 7)
    suffix = SuffixProposer({"k": 4, "max_depth": 10, "min_token_prob": 0.5, "max_spec_factor": 2})
    assert (suffix.k, suffix.max_depth, suffix.min_token_prob, suffix.max_spec_factor) == (4, 10, 0.5, 2.0)


@pytest.mark.parametrize("cls, known", [(NgramProposer, "n_min"), (SuffixProposer, "max_depth")])
def test_unknown_keys_are_named_with_the_known_ones(cls, known):
    with pytest.raises(ValueError) as info:
        cls({"bogus": 1, "also_bogus": 2, "k": 3})
    message = str(info.value)
    assert "'also_bogus'" in message and "'bogus'" in message
    assert "known keys" in message and known in message and "k" in message


@pytest.mark.parametrize(
    "cls, key, value",
    [
        (NgramProposer, "n_min", 0),
        (NgramProposer, "n_min", 2.0),
        (NgramProposer, "n_max", "5"),
        (NgramProposer, "k", 0),
        (NgramProposer, "k", True),
        (NgramProposer, "max_sequences", 0),
        (SuffixProposer, "k", -1),
        (SuffixProposer, "max_depth", 0),
        (SuffixProposer, "min_match", None),
        (SuffixProposer, "min_token_prob", 1.5),
        (SuffixProposer, "min_token_prob", float("nan")),
        (SuffixProposer, "min_count", 0),
        (SuffixProposer, "max_spec_factor", -1),
        (SuffixProposer, "max_spec_offset", float("inf")),
        (SuffixProposer, "max_candidates", 0),
        (SuffixProposer, "max_cached_outputs", -1),
        (SuffixProposer, "max_cached_tokens", 1.5),
        (SuffixProposer, "max_sequences", 0),
    ],
)
def test_bad_values_name_the_key(cls, key, value):
    with pytest.raises(ValueError, match=f"'{key}'"):
        cls({key: value})


def test_cross_key_checks_name_the_key():
    with pytest.raises(ValueError, match="'n_max'"):
        NgramProposer({"n_min": 4, "n_max": 3})
    with pytest.raises(ValueError, match="'min_match'"):
        SuffixProposer({"min_match": 5, "max_depth": 4})


@pytest.mark.parametrize("cls", [NgramProposer, SuffixProposer])
def test_config_must_be_a_mapping(cls):
    with pytest.raises(ValueError, match="mapping"):
        cls([("k", 3)])

"""pyagent-spec: model-free speculative-decoding proposers for pyagent-framework
(``pyagent_spec.ngram``: prompt lookup decoding; ``pyagent_spec.suffix``: suffix
decoding over the request's own context and recent finished outputs)."""

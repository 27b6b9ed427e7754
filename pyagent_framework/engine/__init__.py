"""The inference engine: scheduler, paged KV cache, model runner, sampler, outputs.

Every pluggable edge (tokenizer, weight format, model architecture, attention
backend, quantizer) is loaded by name from :mod:`pyagent_framework.registries`.
"""

"""pyagent-triton: Triton kernels for pyagent-framework.

- :mod:`pyagent_triton.attention`: paged attention over the engine's KV layout
  (varlen causal prefill over cached context; split-K grouped-query decode), over
  float caches and int8/fp8 ones (:mod:`pyagent_triton.kv_quant`);
- :mod:`pyagent_triton.ops`: writing new keys/values into their cache slots, RMSNorm
  with the residual add fused, rotary embedding, SiLU-and-mul, token bitmasks;
- :mod:`pyagent_triton.backend`: the attention backend ``triton`` and its layer ops,
  which use the kernels where Triton can run and the torch twins elsewhere.

Every kernel has a plain-torch twin beside it (``<name>_reference``), the reference
the tests hold it to.
"""

"""pyagent-quant: the int8, int4, gguf and fp8 quantizers of pyagent-framework."""

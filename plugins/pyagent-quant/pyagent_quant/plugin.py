"""Hook implementations of pyagent-quant.

The entry point ``quant`` in the ``pyagent_framework`` group names this module. The
quantizers and the ``hf-quantized`` weight format are registered as lazy
``"module:attr"`` strings: listing plugins imports neither torch nor the native core.
"""

from pyagent_framework import hookimpl

# The pyagent_framework plugin API versions this plugin works with.
PYAGENT_API = ">=1.0,<2"


@hookimpl
def pyagent_register_quantizers(register):
    register(
        "int8",
        "pyagent_quant.quantizers:Int8Quantizer",
        description="weight-only int8, symmetric per output channel (CPU: native fused GEMV/GEMM; GPU: Triton)",
    )
    register(
        "int4",
        "pyagent_quant.quantizers:Int4Quantizer",
        description="weight-only int4, asymmetric per group of 32/64/128 columns (option group_size; CPU and GPU)",
    )
    register(
        "gguf",
        "pyagent_quant.quantizers:GGUFQuantizer",
        description="a GGUF file's quantized tensors (Q2_K to Q8_0, IQ4_NL) computed as stored (default for GGUF files)",
    )
    register(
        "prequantized",
        "pyagent_quant.quantizers:PrequantizedQuantizer",
        description="a GPTQ/AWQ/compressed-tensors checkpoint's int4/int8 weights, repacked exactly (default for them)",
    )
    register(
        "fp8",
        "pyagent_quant.quantizers:FP8Quantizer",
        description="weight-only float8 e4m3, per-output-channel scale",
    )


@hookimpl
def pyagent_register_weight_formats(register):
    register(
        "hf-quantized",
        "pyagent_quant.prequantized:HFQuantizedFormat",
        description="HF safetensors checkpoint quantized with GPTQ, AWQ or compressed-tensors (int4/int8, repacked on load)",
    )

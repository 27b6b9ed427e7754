"""Shared helpers of the pyagent-quant tests: packed weights in every encoding, our
decoding of GGUF bytes and the ``gguf`` package's compared bit for bit, a writer of
tiny llama GGUF files whose tensors are quantized to chosen GGML types (with
``pyagent_quant.gguf_encode``, which encodes every type the engine reads), and the
prompts, text and scoring the SmolLM2 tests run.

The tests run with ``--import-mode=importlib``, where a test module cannot import this
file; the helpers reach them as the session fixture ``quant_helpers``. (The pyagent-hf
tests' ``_write_gguf`` lives in a test module of a directory that is no package, so it
cannot be imported either; this writer adds quantized tensors, which it lacks.)
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import math  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

#: Block size and bytes per block of the GGUF encodings, and where each block keeps
#: its f16 fields (byte offsets).
GGUF_BLOCKS = {
    "Q8_0": (32, 34, (0,)),
    "Q4_0": (32, 18, (0,)),
    "Q4_1": (32, 20, (0, 2)),
    "Q6_K": (256, 210, (208,)),
    "Q5_0": (32, 22, (0,)),
    "Q5_1": (32, 24, (0, 2)),
    "IQ4_NL": (32, 18, (0,)),
    "Q2_K": (256, 84, (80, 82)),
    "Q3_K": (256, 110, (108,)),
    "Q4_K": (256, 144, (0, 2)),
    "Q5_K": (256, 176, (0, 2)),
}


def finite_f16(rng: np.random.Generator, size, low: float | None = None, high: float | None = None) -> np.ndarray:
    """Random finite f16 values: any bit pattern but inf/NaN (subnormals, signed zeros
    and the extremes included), or uniform in ``[low, high)`` when given."""
    if low is not None:
        return rng.uniform(low, high, size).astype(np.float16)
    bits = rng.integers(0, 1 << 16, size, dtype=np.uint16)
    exponent = (bits >> 10) & 31
    bits = np.where(exponent == 31, bits & ~np.uint16(1 << 10), bits).astype(np.uint16)  # exponent 31 -> 30
    return bits.view(np.float16)


def random_gguf_bytes(encoding: str, rows: int, columns: int, rng: np.random.Generator, scale=None) -> np.ndarray:
    """``uint8 [rows, bytes_per_row]`` of random blocks whose f16 fields are finite:
    random f16 bit patterns, or uniform in ``scale = (low, high)``."""
    block, size, fields = GGUF_BLOCKS[encoding]
    assert columns % block == 0
    blocks = rng.integers(0, 256, (rows, columns // block, size), dtype=np.uint8)
    for at in fields:
        values = finite_f16(rng, (rows, columns // block), *(scale or ()))
        blocks[..., at : at + 2] = values.view(np.uint8).reshape(rows, columns // block, 2)
    return np.ascontiguousarray(blocks.reshape(rows, -1))


def reference(data: np.ndarray, encoding: str, shape) -> torch.Tensor:
    """The ``gguf`` package's float32 values of GGUF bytes, as a tensor of ``shape``."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(data, GGMLQuantizationType[encoding])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(shape))


def ours(data: np.ndarray, encoding: str, shape) -> torch.Tensor:
    """``pyagent_quant.encodings.dequantize`` of ``data`` packed as ``encoding``."""
    from pyagent_framework.interfaces import PackedWeight
    from pyagent_quant import encodings

    packed = PackedWeight(encoding, shape, torch.from_numpy(np.ascontiguousarray(data)), encodings.dequantize, "w")
    return encodings.dequantize(packed)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal float32 bit patterns (so -0.0 != 0.0, and no tolerance at all)."""
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    same = got.view(torch.int32) == want.view(torch.int32)
    if not bool(same.all()):
        where = (~same).nonzero()[0].tolist()
        raise AssertionError(f"{int((~same).sum())} values differ, first at {where}: {got[tuple(where)]} vs {want[tuple(where)]}")


def decoded(data: np.ndarray, encoding: str, shape) -> np.ndarray:
    """The gguf package's values of ``data``, after checking ours are the same bits."""
    want = reference(data, encoding, shape)
    assert_same_bits(ours(data, encoding, shape), want)
    return want.numpy()


def gguf_quantize(values: np.ndarray, type_name: str) -> np.ndarray:
    """``values`` (float32 ``[rows, columns]``) in the GGML type ``type_name``: the bytes
    for a quantized type, the array itself for F32/F16."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    from pyagent_quant.gguf_encode import gguf_encodings, quantize_gguf

    values = np.ascontiguousarray(values, np.float32)
    if type_name == "F32":
        return values
    if type_name == "F16":
        return values.astype(np.float16)
    if type_name in gguf_encodings():
        return quantize_gguf(values, type_name)
    return quantize(values, GGMLQuantizationType[type_name])  # BF16 and the like


def packed_weight(encoding: str, rows: int, columns: int, seed: int = 0, name: str = ""):
    """A realistic :class:`PackedWeight` in ``encoding``: GGUF types quantized from (or,
    for Q6_K, random blocks with) weights of about N(0, 0.05); ``I8``/``I4_G*`` from
    ``quantize_i8``/``quantize_i4``."""
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import quantize

    from pyagent_framework.interfaces import PackedWeight
    from pyagent_quant import encodings

    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=gen) * 0.05
    if encoding == "I8":
        return encodings.quantize_i8(weight, name)
    if encoding.startswith("I4_G"):
        return encodings.quantize_i4(weight, int(encoding[4:]), name)
    if encoding == "Q6_K":
        data = random_gguf_bytes("Q6_K", rows, columns, np.random.default_rng(seed), scale=(1e-5, 2e-4))
    else:
        data = quantize(weight.numpy(), GGMLQuantizationType[encoding])
    return PackedWeight(encoding, (rows, columns), torch.from_numpy(np.ascontiguousarray(data)), encodings.dequantize, name)


# -- tiny GGUF files ----------------------------------------------------------------------

TINY_GGUF = dict(
    hidden_size=256,  # Q6_K codes rows of multiples of 256 columns
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,  # = tests/tiny_models.VOCAB: the tiny HF tokenizer serves the file
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)

_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``LlamaModel.permute`` (Q with the head count, K with
    the KV head count)."""
    return (
        weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def gguf_name(hf_name: str) -> str:
    if hf_name in _GGUF_NAMES:
        return _GGUF_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_LAYER[module]}.{suffix}"


def tiny_llama_state(tied: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random transformers Llama of :data:`TINY_GGUF`'s shape; weights of N(0, 0.06)
    so that logits are far from uniform."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**TINY_GGUF, tie_word_embeddings=tied, bos_token_id=0, eos_token_id=1)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.06)
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if "rotary" not in k}
    if tied:
        state.pop("lm_head.weight", None)
    return state


def write_tiny_gguf(path: Path, state: dict[str, torch.Tensor], types: dict[str, str]) -> Path:
    """A llama GGUF of ``state`` (HF names), each 2-D tensor stored in ``types[gguf
    name]`` (default Q8_0; 1-D tensors F32), Q/K rows permuted as llama.cpp's converter
    does. No ``output.weight`` in ``state``: the file has tied embeddings."""
    import gguf
    from gguf.constants import GGMLQuantizationType

    c = TINY_GGUF
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(c["vocab_size"])])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    for hf_name, tensor in state.items():
        name = gguf_name(hf_name)
        array = tensor.float().numpy()
        if ".attn_q." in name:
            array = llama_cpp_permute(array, c["num_attention_heads"])
        elif ".attn_k." in name:
            array = llama_cpp_permute(array, c["num_key_value_heads"])
        if array.ndim == 1:
            w.add_tensor(name, np.ascontiguousarray(array, np.float32))
            continue
        kind = types.get(name, "Q8_0")
        data = gguf_quantize(array, kind)
        raw = None if kind in ("F32", "F16") else GGMLQuantizationType[kind]
        w.add_tensor(name, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# -- the embedded SmolLM2-135M-Instruct (test_smollm2.py, test_kquant_smollm2.py) -----------

SMOLLM2_ENGINE = dict(kv_cache_memory="128MiB", max_model_len=2048)  # ~2900 tokens of KV (46 KB each): plenty here
#: A fixed public-domain text (~750 tokens) whose perplexity the tests compare.
PUBLIC_DOMAIN_TEXT = Path(__file__).parent / "data" / "public_domain.txt"
SMOLLM2_QUESTIONS = [
    "Hi",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in one sentence what a KV cache is in a transformer language model.",
    "Translate 'good morning' into Spanish, French and German, one per line.",
    "def fib(n):\n    # complete this Python function that returns the n-th Fibonacci number",
    "Summarize: The quick brown fox jumps over the lazy dog. The dog does not react.",
]
#: The largest logprob difference allowed between two ways of computing the same
#: float32 weights (summation orders differ; see test_smollm2.py).
LOGPROB_TOLERANCE = 1e-4
#: The largest logprob difference allowed between the default int16 activations (x
#: rounded to 16 bits per block of 32) and the exact path on SmolLM2: measured up to
#: 1.2e-3 over the chats and 6.3e-3 over the ~750-token text (int8: ~0.1).
INT16_LOGPROB_TOLERANCE = 2e-2
#: The exact (float32) activations of the gguf quantizer, the reference for the others.
EXACT = {"activations": "float32"}


def chat(llm):
    """Greedy answers (up to 32 tokens, with their logprobs) to the
    :data:`SMOLLM2_QUESTIONS`, one conversation each."""
    from pyagent_framework import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=0)
    return llm.chat([[{"role": "user", "content": q}] for q in SMOLLM2_QUESTIONS], params)


def scored(llm) -> list[float]:
    """:data:`PUBLIC_DOMAIN_TEXT`'s prompt logprobs: each entry holds the prompt token's
    own logprob."""
    from pyagent_framework import SamplingParams

    [out] = llm.generate(PUBLIC_DOMAIN_TEXT.read_text(), SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
    tokens = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(tokens)
    return [entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], tokens[1:], strict=True)]


def perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


@pytest.fixture(scope="session")
def quant_helpers():
    """The module-level helpers above, for test modules (see the module docstring)."""
    return types.SimpleNamespace(
        GGUF_BLOCKS=GGUF_BLOCKS,
        finite_f16=finite_f16,
        random_gguf_bytes=random_gguf_bytes,
        reference=reference,
        ours=ours,
        assert_same_bits=assert_same_bits,
        decoded=decoded,
        gguf_quantize=gguf_quantize,
        packed_weight=packed_weight,
        TINY_GGUF=TINY_GGUF,
        gguf_name=gguf_name,
        tiny_llama_state=tiny_llama_state,
        write_tiny_gguf=write_tiny_gguf,
        SMOLLM2_ENGINE=SMOLLM2_ENGINE,
        PUBLIC_DOMAIN_TEXT=PUBLIC_DOMAIN_TEXT,
        SMOLLM2_QUESTIONS=SMOLLM2_QUESTIONS,
        LOGPROB_TOLERANCE=LOGPROB_TOLERANCE,
        INT16_LOGPROB_TOLERANCE=INT16_LOGPROB_TOLERANCE,
        EXACT=EXACT,
        chat=chat,
        scored=scored,
        perplexity=perplexity,
    )


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory) -> str:
    """The tiny byte-level BPE tokenizer of tests/tiny_models.py (320 tokens)."""
    from tests.tiny_models import save_tokenizer

    directory = tmp_path_factory.mktemp("tiny-tokenizer")
    save_tokenizer(directory)
    return str(directory)

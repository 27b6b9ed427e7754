"""Tiny random-weight HF checkpoints made with transformers + save_pretrained, each with a
small byte-level BPE tokenizer trained on the spot: the engine's parity reference."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "def add(a, b):\n    return a + b\n",
    "Continuous batching lets requests join a running batch at any step.",
    "Ünïcödé, emoji 🚀 and 中文 text must round-trip through the tokenizer.",
] * 20

VOCAB = 320  # byte-level BPE: 256 bytes + merges + specials

COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=1,
)


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "llama": lambda: LlamaConfig(**COMMON, tie_word_embeddings=False),
        "mistral": lambda: MistralConfig(**COMMON, sliding_window=None, tie_word_embeddings=False),
        "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
        "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True),
    }


ARCHS = ("llama", "mistral", "qwen2", "qwen3")


def save_tokenizer(directory: Path) -> None:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS, vocab_size=VOCAB, min_frequency=2, special_tokens=["<s>", "</s>"], show_progress=False)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, bos_token="<s>", eos_token="</s>")
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tokenizer.save_pretrained(directory)


@functools.lru_cache(maxsize=None)
def _cached_checkpoint(arch: str, root: str) -> str:
    from transformers import AutoModelForCausalLM

    directory = Path(root) / f"tiny-{arch}"
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed({"llama": 1, "mistral": 2, "qwen2": 3, "qwen3": 4}[arch])
    config = _configs()[arch]()
    model = AutoModelForCausalLM.from_config(config)
    # Larger-than-default weights so logits are far from uniform and greedy choices stable.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory)
    return str(directory)


def tiny_checkpoint(arch: str, root: Path) -> str:
    return _cached_checkpoint(arch, str(root))


def windowed_mistral_checkpoint(directory: Path, window: int = 6) -> str:
    """A tiny Mistral whose sliding window (``window`` tokens) is shorter than the
    prompts and outputs the tests use, saved to ``directory``."""
    from transformers import AutoModelForCausalLM, MistralConfig

    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(MistralConfig(**COMMON, sliding_window=window, tie_word_embeddings=False))
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.1)
    model.save_pretrained(directory, safe_serialization=True)
    save_tokenizer(directory)
    return str(directory)


def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None = 1):
    """Greedy continuation by transformers' own generate() and the log-softmax of each
    step's logits at the chosen token."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs = [float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def engine_greedy(llm, prompts, params) -> list[tuple[list[int], list[float]]]:
    """``llm.generate``'s tokens and each chosen token's logprob (``params`` asks for
    ``logprobs=0`` or more), in :func:`hf_greedy`'s shape."""
    results = []
    for out in llm.generate(prompts, params):
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        results.append((tokens, [entry[t].logprob for entry, t in zip(completion.logprobs, tokens, strict=True)]))
    return results


#: The gguf quantizer's exact activations (its default rounds x to 16 bits per block in
#: the integer kernels): what a packed file is compared with its dequantized self by.
EXACT = {"activations": "float32"}


def assert_same_greedy(got, want, tolerance: float = 1e-4) -> None:
    """The same tokens as ``want`` (from :func:`hf_greedy`), logprobs within ``tolerance``."""
    assert len(got) == len(want)
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=tolerance)


def shared_prefix_prompts() -> list[list[int]]:
    """Prompts for prefix-cache tests: four sharing a 40-token prefix, two sharing a
    23-token one (several whole blocks each), and one stranger."""
    import random

    rng = random.Random(3)
    system = [rng.randrange(2, 300) for _ in range(40)]
    other = [rng.randrange(2, 300) for _ in range(23)]
    tails = [[rng.randrange(2, 300) for _ in range(n)] for n in (1, 5, 9, 14)]
    return [system + t for t in tails] + [other + t for t in tails[:2]] + [[rng.randrange(2, 300) for _ in range(30)]]


def parity_prompts(seed: int) -> list[list[int]]:
    """Prompts for architecture parity tests: two pairs sharing a 24-token prefix
    (several whole blocks), and three strangers of other lengths (one short, one
    single token)."""
    import random

    rng = random.Random(seed)
    prefix = [rng.randrange(2, 300) for _ in range(24)]
    tails = [[rng.randrange(2, 300) for _ in range(n)] for n in (3, 11)]
    others = [[rng.randrange(2, 300) for _ in range(n)] for n in (1, 6, 37)]
    return [prefix + tails[0], prefix + tails[1], *others, prefix + tails[0][:1]]

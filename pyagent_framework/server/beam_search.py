"""Completions by beam search (vLLM's ``use_beam_search``): ``beam_width`` beams per
prompt (else ``best_of``, else ``n``), the ``n`` best returned, best first, each
choice's text the hypothesis' generated text. ``length_penalty`` and ``ignore_eos``
apply; ``echo`` prefixes the prompt. Beam search is deterministic and ranks whole
hypotheses, so it is not streamed and takes no sampling or output controls: a request
that sets one gets a 400 naming it. The search itself is
:meth:`~pyagent_framework.engine.async_llm.AsyncLLM.beam_search`."""

from __future__ import annotations

import uuid
from typing import Any

from pyagent_framework.engine.async_llm import EngineDeadError
from pyagent_framework.engine.beam_search import BeamSearchParams
from pyagent_framework.engine.errors import InvalidRequestError
from pyagent_framework.server import protocol as api
from pyagent_framework.server.errors import APIError
from pyagent_framework.server.streaming import as_api_error

# Fields beam search does not read, with the values that mean "not used".
NOT_WITH_BEAM_SEARCH: dict[str, tuple[Any, ...]] = {
    "stream": (False,),
    "logprobs": (None,),
    "prompt_logprobs": (None,),
    "top_p": (None, 1.0),
    "top_k": (None, 0, -1),
    "min_p": (None, 0.0),
    "frequency_penalty": (0.0,),
    "presence_penalty": (0.0,),
    "repetition_penalty": (None, 1.0),
    "logit_bias": (None, {}),
    "min_tokens": (0,),
    "stop": (None, [], ""),
    "stop_token_ids": (None, []),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "structured_outputs": (None,),
    "response_format": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "structural_tag": (None,),
}


async def beam_completion(serving, req: api.CompletionRequest, prompts: list) -> api.CompletionResponse:
    """``serving``: the :class:`~pyagent_framework.server.serving.OpenAIServing`."""
    for name, unused in NOT_WITH_BEAM_SEARCH.items():
        value = getattr(req, name)
        if name == "response_format" and value is not None and value.type == "text":
            continue
        if value not in unused:
            raise APIError(400, f"{name} cannot be used with use_beam_search", param=name)
    if req.temperature not in (None, 0, 0.0):
        raise APIError(400, f"beam search is deterministic: temperature must be 0 or left out, got {req.temperature}",
                       param="temperature")
    cap = serving.config.max_n
    width, field = (req.beam_width, "beam_width") if req.beam_width is not None else (
        (req.best_of, "best_of") if req.best_of is not None else (req.n, "n"))
    if width > cap:
        raise APIError(400, f"{field} must be <= {cap}, got {width}", param=field)
    if width < 1:
        raise APIError(400, f"{field} must be >= 1, got {width}", param=field)
    if not 1 <= req.n <= width:
        raise APIError(400, f"n must be between 1 and the beam width ({width}), got {req.n}", param="n")
    if len(prompts) * width > cap:
        raise APIError(400, f"prompts × {field} must be <= {cap}, got {len(prompts) * width}", param="prompt")
    prompt_ids = [serving.tokenize_prompt(p, req.add_special_tokens) for p in prompts]
    for ids in prompt_ids:
        serving.check_prompt_len(len(ids), "prompt")
    shortest_room = serving.max_model_len - max(len(ids) for ids in prompt_ids)
    max_tokens = shortest_room if req.max_tokens is None else req.max_tokens
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=req.length_penalty,
                              ignore_eos=req.ignore_eos)
    try:
        outputs = await serving.engine.beam_search(prompt_ids, params, max_beam_width=cap, cache_salt=req.cache_salt,
                                                   tenant=serving.tenant_of(req.user), lora=serving.check_model(req.model))
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=field if exc.param == "beam_width" else exc.param) from None
    except EngineDeadError as exc:
        raise APIError(503, str(exc), code="engine_dead") from None
    except Exception as exc:
        raise as_api_error(exc) from None
    choices = []
    completion_tokens = 0
    for p, output in enumerate(outputs):
        prefix = ""
        if req.echo:
            prefix = prompts[p] if isinstance(prompts[p], str) else serving.tokenizer.decode(output.prompt_token_ids,
                                                                                            skip_special_tokens=False)
        for i, seq in enumerate(output.sequences[: req.n]):
            completion_tokens += len(seq.token_ids)
            choices.append(api.CompletionChoice(index=p * req.n + i, text=prefix + seq.text, finish_reason=seq.finish_reason))
    prompt_tokens = sum(len(ids) for ids in prompt_ids)
    usage = api.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                          total_tokens=prompt_tokens + completion_tokens)
    return api.CompletionResponse(id=f"cmpl-{uuid.uuid4().hex}", model=serving.served_as(req.model), choices=choices, usage=usage)


def check_no_beam_fields(req: api.CompletionRequest) -> None:
    """The beam-search fields mean nothing without ``use_beam_search``: refuse them."""
    if req.beam_width is not None:
        raise APIError(400, "beam_width needs use_beam_search=true", param="beam_width")
    if req.length_penalty != 1.0:
        raise APIError(400, "length_penalty needs use_beam_search=true", param="length_penalty")

"""``/v1/embeddings``: OpenAI's embeddings API over an embedding model (an encoder).

The inputs of one request are added to the engine together, so they share steps as
the token budget allows. ``encoding_format="base64"`` (what the openai SDK asks for
by default) sends each vector as its little-endian float32 bytes in base64.
"""

from __future__ import annotations

import base64
import struct
import uuid

from pyagent_framework.engine.async_llm import EngineDeadError
from pyagent_framework.engine.errors import InvalidRequestError
from pyagent_framework.engine.params import PoolingParams
from pyagent_framework.server import protocol as api
from pyagent_framework.server.errors import APIError


class EmbeddingsMixin:
    async def embeddings(self, req: api.EmbeddingRequest) -> api.EmbeddingResponse:
        self.check_model(req.model)
        if self.engine.engine.task == "classify":
            raise APIError(400, f"the model {self.model_name!r} is a cross-encoder: it serves /v1/score and /rerank and "
                                "makes no embeddings", param="model")
        if self.engine.engine.task != "embed":
            raise APIError(400, f"the model {self.model_name!r} generates text; embeddings need an embedding model "
                                "(serve an encoder such as all-MiniLM-L6-v2)", param="model")
        inputs = embedding_inputs(req.input)
        params = PoolingParams(req.truncate_prompt_tokens, req.normalize, req.dimensions)
        try:
            outputs = await self.engine.embed(
                inputs, params, request_id=f"embd-{uuid.uuid4().hex}",
                add_special_tokens=req.add_special_tokens, priority=req.priority,
            )
        except InvalidRequestError as exc:
            param = exc.param if exc.param not in ("prompt", None) else "input"
            raise APIError(400, str(exc), param=param) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        data, tokens = [], 0
        for index, out in enumerate(outputs):
            if out.error is not None:
                status = 400 if out.error_kind == "invalid_request" else 500
                raise APIError(status, f"input {index}: {out.error}", param="input")
            vector = out.outputs.embedding
            if req.encoding_format == "base64":
                vector = base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
            data.append(api.EmbeddingData(index=index, embedding=vector))
            tokens += len(out.prompt_token_ids)
        return api.EmbeddingResponse(
            id=f"embd-{uuid.uuid4().hex}", model=self.model_name, data=data,
            usage=api.EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
        )


def embedding_inputs(value) -> list:
    """The request's inputs as a list of texts or token-id lists: a string, a list of
    strings, one token-id list, or a list of them (OpenAI's four shapes)."""
    if isinstance(value, str):
        inputs = [value]
    elif value and all(isinstance(v, int) for v in value):
        inputs = [list(value)]
    else:
        inputs = list(value)
    if not inputs:
        raise APIError(400, "input is empty: give a string, a list of strings or token ids", param="input")
    if len(inputs) > api.MAX_EMBEDDING_INPUTS:
        raise APIError(400, f"input has {len(inputs)} items; at most {api.MAX_EMBEDDING_INPUTS} per request", param="input")
    for index, item in enumerate(inputs):
        if isinstance(item, str) and not item:
            raise APIError(400, f"input {index} is an empty string", param="input")
        if isinstance(item, list) and not item:
            raise APIError(400, f"input {index} is an empty list of token ids", param="input")
    return inputs

"""``/v1/score`` and ``/rerank`` (``/v1/rerank``): scores of text pairs, in vLLM's shapes.

A cross-encoder scores each pair as one sequence; an embedding model scores the
cosine similarity of the two texts' embeddings (:mod:`pyagent_framework.engine.scoring`).
``/v1/score`` pairs ``text_1`` with ``text_2`` as ``LLM.score`` does; ``/rerank``
scores a ``query`` against each of its ``documents`` (Jina's and Cohere's body) and
returns them best first, the ``top_n`` best when it is given. At most
:data:`~.protocol.MAX_EMBEDDING_INPUTS` pairs or documents per request.
"""

from __future__ import annotations

import time
import uuid
from typing import ClassVar, Literal, Union

from pydantic import BaseModel, Field

from pyagent_framework.engine.async_llm import EngineDeadError
from pyagent_framework.engine.errors import InvalidRequestError
from pyagent_framework.server import protocol as api
from pyagent_framework.server.errors import APIError


class ScoreRequest(api.RequestBody):
    """vLLM's ``/v1/score`` body."""

    implemented: ClassVar[frozenset[str]] = frozenset({"truncate_prompt_tokens"})

    model: str | None = None
    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankRequest(api.RequestBody):
    """The ``/rerank`` body (Jina's and Cohere's, as vLLM takes it). ``top_n`` 0 (the
    default) returns every document."""

    implemented: ClassVar[frozenset[str]] = frozenset({"truncate_prompt_tokens", "documents"})

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int = Field(default=0, ge=0)
    truncate_prompt_tokens: int | None = None
    priority: int = 0


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ScoreMixin:
    async def score(self, req: ScoreRequest) -> ScoreResponse:
        outputs = await self._scores(req.model, req.text_1, req.text_2, req.truncate_prompt_tokens, req.priority)
        tokens = sum(len(out.prompt_token_ids) for out in outputs)
        return ScoreResponse(
            id=f"score-{uuid.uuid4().hex}", model=self.model_name,
            data=[ScoreData(index=i, score=out.outputs.score) for i, out in enumerate(outputs)],
            usage=ScoreUsage(prompt_tokens=tokens, total_tokens=tokens),
        )

    async def rerank(self, req: RerankRequest) -> RerankResponse:
        if not req.documents:
            raise APIError(400, "documents is empty: give at least one document", param="documents")
        outputs = await self._scores(req.model, req.query, req.documents, req.truncate_prompt_tokens, req.priority,
                                     names={"text_1": "query", "text_2": "documents"})
        ranked = sorted(range(len(outputs)), key=lambda i: -outputs[i].outputs.score)  # stable: ties keep their order
        if req.top_n:
            ranked = ranked[: req.top_n]
        return RerankResponse(
            id=f"rerank-{uuid.uuid4().hex}", model=self.model_name,
            usage=RerankUsage(total_tokens=sum(len(out.prompt_token_ids) for out in outputs)),
            results=[RerankResult(index=i, document=RerankDocument(text=req.documents[i]),
                                  relevance_score=outputs[i].outputs.score) for i in ranked],
        )

    async def _scores(self, model, text_1, text_2, truncate_prompt_tokens, priority, names=None):
        """The pairs' scores; every failure a 4xx/5xx naming the request's field
        (``names`` maps the engine's ``text_1``/``text_2`` to this body's)."""
        names = names or {}
        if self.check_model(model) is not None:
            raise APIError(400, f"the model {model!r} is a LoRA adapter; scores are served by the base model", param="model")
        if self.engine.engine.task == "generate":
            raise APIError(400, f"the model {self.model_name!r} generates text; scores need a cross-encoder or an "
                                "embedding model", param="model")
        try:
            outputs = await self.engine.score(
                text_1, text_2, truncate_prompt_tokens=truncate_prompt_tokens, request_id=f"score-{uuid.uuid4().hex}",
                priority=priority, max_pairs=api.MAX_EMBEDDING_INPUTS,
            )
        except InvalidRequestError as exc:
            param = {"prompt": "text_2", "input": "text_2", None: "text_2"}.get(exc.param, exc.param)
            param = names.get(param, param)
            message = str(exc)
            for ours, theirs in names.items():
                message = message.replace(ours, theirs)
            raise APIError(400, message, param=param) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        for index, out in enumerate(outputs):
            if out.error is not None:
                status = 400 if out.error_kind == "invalid_request" else 500
                raise APIError(status, f"pair {index}: {out.error}", param=names.get("text_2", "text_2"))
        return outputs

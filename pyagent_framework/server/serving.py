"""The OpenAI API over :class:`AsyncLLM`: requests become sampling parameters and
prompts, engine outputs become responses or server-sent-event chunks.

Nothing here knows about HTTP beyond :class:`APIError`; the FastAPI app
(:mod:`pyagent_framework.server.app`) routes to it.

:class:`OpenAIServing` holds what every endpoint shares (the engine, the model check,
prompt rendering, starting a request) and the token and model endpoints; the rest
is composed in from :mod:`.chat`, :mod:`.completions`, :mod:`.sampling` and
:mod:`.logprobs`, :mod:`.embeddings` and :mod:`.responses`, with the shared streaming helpers in :mod:`.streaming`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from pyagent_framework.chat_templates import ChatTemplateError
from pyagent_framework.engine import entries
from pyagent_framework.engine.async_llm import AsyncLLM, EngineDeadError
from pyagent_framework.engine.errors import InvalidRequestError
from pyagent_framework.engine.output_parsers import OutputParsers
from pyagent_framework.engine.params import SamplingParams
from pyagent_framework.server import load_parsers, protocol as api
from pyagent_framework.server.chat import ChatMixin
from pyagent_framework.server.completions import CompletionsMixin
from pyagent_framework.server.embeddings import EmbeddingsMixin
from pyagent_framework.server.config import ServerConfig
from pyagent_framework.server.errors import APIError
from pyagent_framework.server.logprobs import LogprobsMixin
from pyagent_framework.server.metrics import ServerMetrics
from pyagent_framework.server.responses import ResponsesMixin, ResponseStore
from pyagent_framework.server.sampling import SamplingMixin
from pyagent_framework.server.score import ScoreMixin

logger = logging.getLogger("pyagent_framework.server")

# Template variables a request may not set: the renderer's own inputs and its limits.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "chat_template", "max_output_chars", "timeout"}
)


class OpenAIServing(ChatMixin, ResponsesMixin, CompletionsMixin, EmbeddingsMixin, ScoreMixin, SamplingMixin, LogprobsMixin):
    """The OpenAI endpoints over one engine and model."""

    def __init__(
        self,
        engine: AsyncLLM,
        config: ServerConfig,
        *,
        model_name: str,
        metrics: ServerMetrics,
    ) -> None:
        self.engine = engine
        self.inputs = engine.engine.input_processor  # the tokenizer, chat template and limits
        self.config = config
        self.model_name = model_name
        self.metrics = metrics
        # The parsers the config names (checked here; the front end builds them per sample).
        self.tool_parser_cls, self.reasoning_parser_cls = load_parsers(config)
        parsers = entries.selected({"tool_parser": config.tool_call_parser, "reasoning_parser": config.reasoning_parser})
        metrics.collector.front_entries = parsers
        if parsers:
            logger.info("parsers in use: %s", entries.describe(parsers))
        self.response_store = ResponseStore(config.max_stored_responses)  # /v1/responses
        self.created = int(time.time())

    @property
    def tokenizer(self):
        return self.inputs.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.inputs.max_model_len

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names (None: the base model); 404 for
        a model this server does not serve."""
        if model is None or model == self.model_name:
            return None
        if model in self.engine.engine.lora_adapters:
            return model
        served = ", ".join(repr(name) for name in [self.model_name, *sorted(self.engine.engine.lora_adapters)])
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served}", param="model",
                       code="model_not_found")

    def served_as(self, model: str | None) -> str:
        """The model a response names: the LoRA adapter the request chose, else the base model."""
        return model if model is not None and model in self.engine.engine.lora_adapters else self.model_name

    def check_generates(self) -> None:
        if self.engine.engine.task == "embed":
            raise APIError(400, f"the model {self.model_name!r} is an embedding model: it serves /v1/embeddings and "
                                "generates no text", param="model")
        if self.engine.engine.task == "classify":
            raise APIError(400, f"the model {self.model_name!r} is a cross-encoder: it serves /v1/score and /rerank and "
                                "generates no text", param="model")

    async def _start(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        cache_salt: str | None,
        *,
        parsers: OutputParsers | None = None,
        param: str | None = None,
        tenant: str | None = None,
        lora: str | None = None,
    ):
        """Queue the request; ``param`` names the request field an invalid
        structured-output spec came from, when the server built it; ``lora`` is the
        adapter :meth:`check_model` found."""
        request_id = f"req-{uuid.uuid4().hex}"
        try:
            stream = await self.engine.add_request(
                prompt,
                params,
                request_id=request_id,
                cache_salt=cache_salt,
                parsers=parsers,
                tenant=tenant,
                lora=lora,
            )
        except InvalidRequestError as exc:
            where = param if param and (exc.param or "").startswith("structured_outputs") else exc.param
            raise APIError(400, str(exc), param=where) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), code="engine_dead") from None
        return stream

    # ------------------------------------------------------------------ prompts

    async def render(self, req: api.ChatCompletionRequest) -> list[int]:
        """The conversation's prompt ids. A template sent with the request renders on a
        worker thread: for up to its time limit it holds that thread, not the event loop
        every other response goes through."""
        if req.chat_template is None:
            return self.render_messages(req)
        return await asyncio.to_thread(self.render_messages, req)

    def render_messages(self, req: api.ChatCompletionRequest) -> list[int]:
        if req.chat_template is not None and not self.config.trust_request_chat_template:
            raise APIError(
                400, "this server does not accept chat templates in requests (start it with --trust-request-chat-template)", param="chat_template"
            )
        extra = dict(req.chat_template_kwargs or {})
        clash = sorted(RESERVED_TEMPLATE_KWARGS & set(extra))
        if clash:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(clash)}", param="chat_template_kwargs")
        if req.continue_final_message and (req.add_generation_prompt or req.messages[-1].role != "assistant"):
            raise APIError(
                400, "continue_final_message needs add_generation_prompt=false and a final assistant message", param="continue_final_message"
            )
        messages = [message_dict(m) for m in req.messages]
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            text = self.inputs.render_chat(
                messages, add_generation_prompt=req.add_generation_prompt, tools=tools, chat_template=req.chat_template, **extra
            )
        except (ChatTemplateError, InvalidRequestError) as exc:
            raise APIError(400, str(exc), param="messages") from None
        if req.continue_final_message:
            final = messages[-1]["content"] or ""
            cut = text.rfind(final) if final else -1
            if cut != -1:
                text = text[: cut + len(final)]
        return self.tokenizer.encode(text, add_special_tokens=False)

    def tokenize_prompt(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
        try:
            return self.inputs.tokenize_prompt(prompt, add_special_tokens)[1]
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param=exc.param) from None

    # ------------------------------------------------------------------ tokens

    async def tokenize(self, req: api.TokenizeRequest) -> api.TokenizeResponse:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            if not req.messages:
                raise APIError(400, "messages is empty", param="messages")
            chat = api.ChatCompletionRequest.model_construct(
                messages=req.messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=False,
                chat_template=req.chat_template,
                chat_template_kwargs=req.chat_template_kwargs,
            )
            tokens = await self.render(chat)
        else:
            tokens = self.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return api.TokenizeResponse(count=len(tokens), max_model_len=self.max_model_len, tokens=tokens)

    def detokenize(self, req: api.DetokenizeRequest) -> api.DetokenizeResponse:
        self.check_model(req.model)
        vocab = self.inputs.vocab_size
        for token in req.tokens:
            if not 0 <= token < vocab:
                raise APIError(400, f"token {token} is not a token id of this model (0..{vocab - 1})", param="tokens")
        return api.DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens, skip_special_tokens=False))

    def models(self) -> api.ModelList:
        # The model's name, never where its files lie on this machine.
        card = api.ModelCard(id=self.model_name, created=self.created, root=self.model_name, max_model_len=self.max_model_len)
        adapters = [api.ModelCard(id=name, created=self.created, root=name, parent=self.model_name,
                                  max_model_len=self.max_model_len) for name in sorted(self.engine.engine.lora_adapters)]
        return api.ModelList(data=[card, *adapters])


def message_dict(message: api.ChatMessage) -> dict[str, Any]:
    """A chat message as the template sees it: text content, OpenAI field names."""
    out = message.model_dump(exclude_none=True)
    content = message.content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, api.TextContentPart):
                raise APIError(400, f"this model reads text only; a {part.type!r} content part cannot be used", param="messages")
            texts.append(part.text)
        out["content"] = "\n".join(texts)
    else:
        out["content"] = content
    for call in out.get("tool_calls") or []:
        # OpenAI sends arguments as JSON text; templates (Hugging Face's among them)
        # write them with `| tojson`, which would quote the text again: give them
        # the object. Text that is not a JSON object stays as it is.
        function = call["function"]
        try:
            arguments = json.loads(function["arguments"])
        except ValueError:
            continue
        if isinstance(arguments, dict):
            function["arguments"] = arguments
    return out

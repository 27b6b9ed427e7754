"""Options of ``pyagent serve`` beyond the engine's: one attrs class, filled from
flags, the same ``--config`` YAML/JSON file as the engine options, and
``PYAGENT_<FIELD>`` environment variables (``PYAGENT_API_KEY``, ``PYAGENT_PORT``, ...)."""

from __future__ import annotations

from typing import Any

import attrs

from pyagent_framework.engine import params as request_limits
from pyagent_framework.engine.config import EngineConfig, build_config, parse_size


def _between(low: int, high: int):
    def check(instance, attribute, value) -> None:
        if not low <= value <= high:
            raise ValueError(f"{attribute.name} must be between {low} and {high}, got {value}")

    return check


def _size(instance, attribute, value) -> None:
    try:
        parse_size(value)
    except ValueError as exc:
        raise ValueError(f"{attribute.name} must be a size such as 4MiB: {exc}") from None


@attrs.define(kw_only=True)
class ServerConfig:
    host: str = attrs.field(default="127.0.0.1", metadata={"help": "address to bind (default 127.0.0.1: this machine only)"})
    port: int = attrs.field(default=8000, validator=_between(0, 65535), metadata={"help": "TCP port (0: any free port)"})
    api_key: str | None = attrs.field(default=None, repr=False, metadata={"help": "require 'Authorization: Bearer KEY' on /v1/*"})
    served_model_name: str | None = attrs.field(default=None, metadata={"help": "model id clients send and see (default: --model)"})
    tool_call_parser: str | None = attrs.field(default=None, metadata={"help": "tool-call parser (registry name)"})
    enable_auto_tool_choice: bool = attrs.field(default=False, metadata={"help": "let the model call tools on its own (tool_choice=auto); needs --tool-call-parser"})
    reasoning_parser: str | None = attrs.field(default=None, metadata={"help": "reasoning parser (registry name): splits reasoning_content from content"})
    trust_request_chat_template: bool = attrs.field(default=False, metadata={"help": "accept a chat_template sent in a request (off: refused with 400)"})
    max_request_body: str = attrs.field(default="4MiB", validator=_size, metadata={"help": "largest request body (413 beyond it)"})
    max_n: int = attrs.field(default=request_limits.MAX_N, validator=_between(1, request_limits.MAX_N), metadata={"help": "most samples (n) per request"})
    max_logprobs: int = attrs.field(default=request_limits.MAX_LOGPROBS, validator=_between(0, request_limits.MAX_LOGPROBS), metadata={"help": "most top logprobs per token"})
    max_stop_strings: int = attrs.field(default=request_limits.MAX_STOP_STRINGS, validator=_between(0, request_limits.MAX_STOP_STRINGS), metadata={"help": "most stop strings per request"})
    max_logit_bias: int = attrs.field(default=request_limits.MAX_LOGIT_BIAS, validator=_between(0, request_limits.MAX_LOGIT_BIAS), metadata={"help": "most logit_bias entries per request"})
    shutdown_timeout: float = attrs.field(default=30.0, metadata={"help": "seconds SIGTERM waits for running requests before exiting"})
    step_timeout: float = attrs.field(default=60.0, validator=_between(1, 86400), metadata={"help": "seconds one engine step may run before the watchdog declares the engine stalled: /health then answers 503, open requests get an error and the process exits non-zero for its supervisor to restart"})
    otlp_traces_endpoint: str | None = attrs.field(default=None, metadata={"help": "send an OpenTelemetry trace of each request (queue, prefill, decode spans; the caller's traceparent honoured) to this OTLP/HTTP endpoint, e.g. http://127.0.0.1:4318/v1/traces (pip install 'pyagent-framework[otel]')"})
    allow_runtime_lora_updating: bool = attrs.field(default=False, metadata={"help": "turn on POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which read adapters from paths on this machine (an operator's switch; off by default; needs --enable-lora)"})
    profiler_dir: str | None = attrs.field(default=None, metadata={"help": "a directory for torch profiler traces of the engine core: turns on POST /start_profile and /stop_profile (an operator's switch; off by default)"})
    max_stored_responses: int = attrs.field(default=1024, validator=_between(0, 1_000_000), metadata={"help": "most responses /v1/responses keeps in memory for previous_response_id and GET /v1/responses/{id} (the least recently used go first; 0: none kept)"})
    log_level: str = attrs.field(default="info", metadata={"help": "uvicorn log level: critical, error, warning, info, debug"})

    @property
    def max_request_bytes(self) -> int:
        return parse_size(self.max_request_body)


def make_server_config(
    values: dict[str, Any] | None = None, *, config_file: str | None = None, env: bool = True
) -> ServerConfig:
    return build_config(ServerConfig, values, config_file=config_file, env=env, shared_with=(EngineConfig,))


def make_engine_config(
    values: dict[str, Any] | None = None, *, config_file: str | None = None, env: bool = True
) -> EngineConfig:
    return build_config(EngineConfig, values, config_file=config_file, env=env, shared_with=(ServerConfig,))

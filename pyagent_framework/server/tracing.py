"""OpenTelemetry request tracing (``--otlp-traces-endpoint``; ``pip install
'pyagent-framework[otel]'``).

Each finished chat or completion request becomes a span ``llm_request`` (kind
SERVER) from its arrival to its end, with one child span per phase: ``queue`` (until
the engine first scheduled it), ``prefill`` (until its first output token) and
``decode`` (until its end). The request's W3C ``traceparent`` (and ``tracestate``)
header makes the span a child of the caller's. Attributes follow OpenTelemetry's
``gen_ai`` conventions: the request id, model, prompt and output token counts, finish
reasons. Spans are written when the request ends, from the times the engine
recorded, so tracing adds nothing to the engine's own work.
"""

from __future__ import annotations

import contextvars
from typing import Any

#: The headers of the HTTP request being served (set by the route, read when its
#: tracker is made), so the trace context travels without threading headers through.
REQUEST_HEADERS: contextvars.ContextVar[Any] = contextvars.ContextVar("pyagent_request_headers", default=None)


class Tracing:
    def __init__(self, endpoint: str | None = None, *, exporter: Any = None, service_name: str = "pyagent") -> None:
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        except ImportError:
            from pyagent_framework.errors import ConfigError

            raise ConfigError("--otlp-traces-endpoint needs OpenTelemetry: pip install 'pyagent-framework[otel]'",
                              field="otlp_traces_endpoint") from None
        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if exporter is None:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        else:  # tests: spans as they end
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.provider = provider
        self.tracer = provider.get_tracer("pyagent_framework")

    def parent(self, headers: Any) -> Any:
        """The caller's trace context from W3C headers, or None."""
        if not headers:
            return None
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        return TraceContextTextMapPropagator().extract(carrier={k.lower(): v for k, v in dict(headers).items()})

    def record(self, parent: Any, out: Any, *, model: str, prompt_tokens: int, output_tokens: int, end: float) -> None:
        """The spans of one finished (or aborted) request."""
        from opentelemetry import trace

        metrics = out.metrics

        def ns(seconds: float) -> int:
            return int(seconds * 1e9)

        finish = metrics.finish_time or end
        reasons = [o.finish_reason or "abort" for o in out.outputs]
        span = self.tracer.start_span(
            "llm_request", context=parent, kind=trace.SpanKind.SERVER, start_time=ns(metrics.arrival_time),
            attributes={
                "gen_ai.request.id": out.request_id,
                "gen_ai.response.model": model,
                "gen_ai.usage.prompt_tokens": prompt_tokens,
                "gen_ai.usage.completion_tokens": output_tokens,
                "gen_ai.response.finish_reasons": reasons,
                "gen_ai.request.n": len(out.outputs),
            },
        )
        inside = trace.set_span_in_context(span)
        phases = (("queue", metrics.arrival_time, metrics.first_scheduled_time),
                  ("prefill", metrics.first_scheduled_time, metrics.first_token_time),
                  ("decode", metrics.first_token_time, finish))
        for name, start, stop in phases:
            if start is not None and stop is not None:
                self.tracer.start_span(name, context=inside, start_time=ns(start)).end(end_time=ns(max(start, stop)))
        if out.error:
            span.set_status(trace.Status(trace.StatusCode.ERROR, out.error))
        span.end(end_time=ns(finish))

    def shutdown(self) -> None:
        self.provider.shutdown()

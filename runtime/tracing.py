"""OpenTelemetry request spans, off by default (`kvserve serve --otlp-traces-endpoint URL` turns them on).

One trace per finished request, shaped like vLLM's so the same collector rules and trace searches work:
a SERVER span `llm_request` from arrival to finish with vLLM's `gen_ai.*` attribute names, parented to the
caller's W3C `traceparent`/`tracestate` headers, and three child spans for the phases: `queued` (arrival to
first schedule), `prefill` (first schedule to first token) and `decode` (first token to finish).

Spans are built when a request finishes, from timestamps the engine thread already keeps, so tracing adds
no work per step. The BatchSpanProcessor exports from its own thread. The OTLP exporter speaks gRPC unless
OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf (vLLM's convention); the other OTEL_* variables
(OTEL_SERVICE_NAME, OTEL_EXPORTER_OTLP_TRACES_INSECURE, OTEL_TRACES_SAMPLER, ...) apply as usual.
The OpenTelemetry packages are the optional `tracing` extra; nothing here imports them until a tracer is built.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")
SPAN_NAME = "llm_request"
PHASES = ("queued", "prefill", "decode")


class SpanAttributes:
    """vLLM's attribute names (vllm/tracing.py), so traces from both look alike."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


_warned_disabled = False


def trace_headers(headers: Mapping[str, str], enabled: bool) -> dict[str, str] | None:
    """The W3C trace headers of an HTTP request, or None. Warns once when they arrive with tracing off."""
    global _warned_disabled
    found = {h: headers[h] for h in TRACE_HEADERS if h in headers}
    if found and not enabled and not _warned_disabled:
        _warned_disabled = True
        logger.warning(
            "received a request with trace context but tracing is disabled "
            "(start with --otlp-traces-endpoint to export spans)"
        )
    return found or None


class RequestTracer:
    """Turns a finished request's timestamps (time.monotonic seconds) into one trace."""

    def __init__(self, tracer_provider: Any, model_name: str):
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self._provider = tracer_provider
        self._tracer = tracer_provider.get_tracer("kvserve.runtime")
        self._propagator = TraceContextTextMapPropagator()
        self._server_kind = SpanKind.SERVER
        self.model_name = model_name

    def record_finished(
        self,
        *,
        request_id: str,
        trace_headers: Mapping[str, str] | None,
        params: Any,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        arrival_time: float,
        first_scheduled_time: float | None,
        first_token_time: float | None,
        finished_time: float,
    ) -> None:
        from opentelemetry import trace

        # Monotonic seconds -> epoch nanoseconds, with one offset for the whole trace.
        offset_ns = time.time_ns() - time.monotonic_ns()

        def ns(t: float) -> int:
            return offset_ns + int(t * 1e9)

        attrs = SpanAttributes
        attributes: dict[str, Any] = {
            attrs.GEN_AI_RESPONSE_MODEL: self.model_name,
            attrs.GEN_AI_REQUEST_ID: request_id,
            attrs.GEN_AI_USAGE_PROMPT_TOKENS: num_prompt_tokens,
            attrs.GEN_AI_USAGE_COMPLETION_TOKENS: num_generation_tokens,
            attrs.GEN_AI_LATENCY_E2E: finished_time - arrival_time,
        }
        for name, key in (
            (attrs.GEN_AI_REQUEST_TEMPERATURE, "temperature"),
            (attrs.GEN_AI_REQUEST_TOP_P, "top_p"),
            (attrs.GEN_AI_REQUEST_MAX_TOKENS, "max_tokens"),
            (attrs.GEN_AI_REQUEST_N, "n"),
        ):
            value = getattr(params, key, None)
            if value is not None:
                attributes[name] = value
        attributes[attrs.GEN_AI_USAGE_NUM_SEQUENCES] = getattr(params, "n", 1) or 1
        if first_scheduled_time is not None:
            attributes[attrs.GEN_AI_LATENCY_TIME_IN_QUEUE] = first_scheduled_time - arrival_time
            attributes[attrs.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = finished_time - first_scheduled_time
            if first_token_time is not None:
                attributes[attrs.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = first_token_time - first_scheduled_time
        if first_token_time is not None:
            attributes[attrs.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = first_token_time - arrival_time
            attributes[attrs.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = finished_time - first_token_time

        parent = self._propagator.extract(dict(trace_headers or {}))
        span = self._tracer.start_span(
            SPAN_NAME, context=parent, kind=self._server_kind, attributes=attributes, start_time=ns(arrival_time)
        )
        phase_bounds = zip(
            PHASES,
            (arrival_time, first_scheduled_time, first_token_time),
            (first_scheduled_time, first_token_time, finished_time),
        )
        context = trace.set_span_in_context(span)
        for phase, start, end in phase_bounds:
            if start is not None and end is not None:
                self._tracer.start_span(phase, context=context, start_time=ns(start)).end(end_time=ns(end))
        span.end(end_time=ns(finished_time))

    def shutdown(self) -> None:
        """Flush what the batch processor still holds (bounded by the SDK's export timeout)."""
        self._provider.shutdown()


def span_exporter(endpoint: str) -> Any:
    """OTLP span exporter for `endpoint`: gRPC by default, HTTP with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL."""
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(
            f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r} is not supported (use grpc or http/protobuf)"
        )
    return OTLPSpanExporter(endpoint=endpoint)


def build_otlp_tracer(endpoint: str, model_name: str) -> RequestTracer:
    """A RequestTracer exporting to `endpoint` through a BatchSpanProcessor. Raises RuntimeError naming the
    missing extra when the OpenTelemetry packages are not installed."""
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise RuntimeError(
            "--otlp-traces-endpoint needs the OpenTelemetry packages: pip install 'kvserve[tracing]'"
        ) from exc
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "kvserve")})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(span_exporter(endpoint)))
    return RequestTracer(provider, model_name)

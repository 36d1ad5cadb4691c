"""OpenTelemetry request spans through the real HTTP server: the SDK's in-memory exporter for the span shape,
and a local OTLP/HTTP receiver on 127.0.0.1 for the real exporter path."""

from __future__ import annotations

import http.server
import threading

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the `tracing` extra is not installed")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import SpanKind  # noqa: E402

from kvserve.runtime.tracing import PHASES, SPAN_NAME, RequestTracer, SpanAttributes, build_otlp_tracer  # noqa: E402
from tests.server.conftest import LiveServer, make_engine  # noqa: E402

pytestmark = pytest.mark.timeout(120)
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"


def _in_memory_tracer(model: str) -> tuple[RequestTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return RequestTracer(provider, model), exporter


def test_one_trace_per_request_with_vllm_attributes_and_phase_spans(demo_model_dir):
    tracer, exporter = _in_memory_tracer("traced-model")
    srv = LiveServer(
        make_engine(demo_model_dir, max_num_seqs=1), served_model_names=["traced-model"], request_tracer=tracer
    )
    try:
        headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"}
        body = {"prompt": "hello", "max_tokens": 12, "ignore_eos": True, "temperature": 0.5, "top_p": 0.9}
        response = httpx.post(srv.base_url + "/v1/completions", json=body, headers=headers, timeout=60)
        assert response.status_code == 200, response.text
        # Untraced caller: a fresh trace (no parent), still one per request.
        assert (
            httpx.post(srv.base_url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=60).status_code
            == 200
        )
        srv.wait_idle()
    finally:
        srv.stop()
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name == SPAN_NAME]
    assert len(roots) == 2 and len(spans) == 2 * (1 + len(PHASES))
    root = next(s for s in roots if s.parent is not None)
    # Joined the caller's trace as a SERVER span under the caller's span.
    assert format(root.context.trace_id, "032x") == TRACE_ID
    assert format(root.parent.span_id, "016x") == PARENT_SPAN_ID
    assert root.kind == SpanKind.SERVER
    a, attrs = SpanAttributes, root.attributes
    assert attrs[a.GEN_AI_RESPONSE_MODEL] == "traced-model"
    assert attrs[a.GEN_AI_REQUEST_ID] == response.json()["id"]
    assert attrs[a.GEN_AI_USAGE_COMPLETION_TOKENS] == 12
    assert attrs[a.GEN_AI_USAGE_PROMPT_TOKENS] == response.json()["usage"]["prompt_tokens"]
    assert attrs[a.GEN_AI_REQUEST_MAX_TOKENS] == 12 and attrs[a.GEN_AI_REQUEST_N] == 1
    assert attrs[a.GEN_AI_REQUEST_TEMPERATURE] == pytest.approx(0.5)
    assert attrs[a.GEN_AI_REQUEST_TOP_P] == pytest.approx(0.9)
    assert attrs[a.GEN_AI_LATENCY_E2E] == pytest.approx((root.end_time - root.start_time) / 1e9, abs=1e-6)
    assert 0 <= attrs[a.GEN_AI_LATENCY_TIME_IN_QUEUE] <= attrs[a.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN]
    assert attrs[a.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] > 0
    # The three phases tile the request: queued -> prefill -> decode, children of llm_request.
    phases = {s.name: s for s in spans if s.context.trace_id == root.context.trace_id and s is not root}
    assert set(phases) == set(PHASES)
    assert all(s.parent.span_id == root.context.span_id for s in phases.values())
    bounds = [(phases[p].start_time, phases[p].end_time) for p in PHASES]
    assert bounds[0][0] == root.start_time and bounds[-1][1] == root.end_time
    assert all(start <= end for start, end in bounds)
    assert bounds[0][1] == bounds[1][0] and bounds[1][1] == bounds[2][0]
    assert (bounds[2][1] - bounds[2][0]) / 1e9 == pytest.approx(attrs[a.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE], abs=1e-6)


class _BrokenTracer:
    def record_finished(self, **_):
        raise RuntimeError("collector exploded")

    def shutdown(self):
        pass


def test_a_failing_tracer_never_costs_a_request(demo_model_dir):
    srv = LiveServer(make_engine(demo_model_dir), request_tracer=_BrokenTracer())
    try:
        for _ in range(2):
            r = httpx.post(
                srv.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "ignore_eos": True}, timeout=60
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(srv.base_url + "/health", timeout=5).status_code == 200
    finally:
        srv.stop()


def test_otlp_http_exporter_delivers_spans_to_a_local_receiver(demo_model_dir, monkeypatch):
    """The real OTLP exporter (http/protobuf) against a receiver on 127.0.0.1 that decodes the export request."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    received: list[ExportTraceServiceRequest] = []

    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            request = ExportTraceServiceRequest()
            request.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
            received.append(request)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "kvserve-test")
    try:
        tracer = build_otlp_tracer(f"http://127.0.0.1:{httpd.server_port}/v1/traces", "otlp-model")
        srv = LiveServer(make_engine(demo_model_dir), served_model_names=["otlp-model"], request_tracer=tracer)
        try:
            r = httpx.post(
                srv.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 5, "ignore_eos": True}, timeout=60
            )
            assert r.status_code == 200
        finally:
            srv.stop()  # AsyncEngine.shutdown flushes the batch processor
    finally:
        httpd.shutdown()
    spans = [
        (rs.resource, span)
        for req in received
        for rs in req.resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    ]
    assert sorted(span.name for _, span in spans) == sorted([SPAN_NAME, *PHASES])
    resource, root = next((res, s) for res, s in spans if s.name == SPAN_NAME)
    assert {kv.key: kv.value.string_value for kv in resource.attributes}["service.name"] == "kvserve-test"
    attrs = {kv.key: kv.value for kv in root.attributes}
    assert attrs[SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS].int_value == 5
    assert attrs[SpanAttributes.GEN_AI_RESPONSE_MODEL].string_value == "otlp-model"

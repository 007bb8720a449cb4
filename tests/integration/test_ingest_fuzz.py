"""Bad input at OTLP/HTTP ingest: every hostile body gets a clear 4xx or an OTLP partial-success
rejection with a reason, the detector keeps serving, and the valid span riding in a hostile batch still
reaches the ledger. The app is the real FastAPI app with its real ingest queue, driven in-process so
that hypothesis can try hundreds of inputs."""

from __future__ import annotations

import base64
import gzip
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from google.protobuf import json_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Detector
from mcp_stream_exporter.detector.app import create_app
from mcp_stream_exporter.detector.ingest import JSON, PROTOBUF, IngestLimits, IngestQueue

pytestmark = pytest.mark.fuzz

MODEL_KEYS = [sc.SPAN, sc.ROLE, sc.ERA, sc.STREAM_KIND, sc.END_REASON, sc.MCP_SESSION_ID, sc.STREAM_REQUEST_IDS,
              sc.PENDING_REQUEST_IDS, sc.TERMINAL_REQUEST_IDS, sc.RESUME_CURSOR, sc.EVENTS_COUNT,
              sc.JSONRPC_REQUEST_ID, sc.GEN_AI_TOOL_NAME, sc.CALL_OUTCOME, sc.REPLAY_BUFFERED, sc.REPLAY_SENT,
              sc.REPLAY_SKIPPED, sc.AUTH_AUDIENCE, sc.AUTH_MISSING_RESOURCES, sc.HTTP_RESPONSE_STATUS_CODE,
              sc.MCP_METHOD_NAME, sc.ERROR_FRAMES_COUNT]
SPAN_KINDS = [sc.SPAN_STREAM, sc.SPAN_CALL, sc.SPAN_REPLAY]
_sessions = itertools.count()
TRIED: dict[str, int] = {}


@pytest.fixture(scope="module")
def ingest():
    detector = Detector()
    queue = IngestQueue(detector, IngestLimits(max_body_bytes=256 * 1024, max_decompressed_bytes=1024 * 1024,
                                               max_spans_per_request=200))
    with TestClient(create_app(detector, queue)) as client:
        yield client, detector, queue
    queue.close()
    print(f"\ninputs tried at ingest: {TRIED}")


def _count(kind: str) -> None:
    TRIED[kind] = TRIED.get(kind, 0) + 1


def _value(v: object) -> AnyValue:
    if isinstance(v, bool):
        return AnyValue(bool_value=v)
    if isinstance(v, int):
        return AnyValue(int_value=v)
    if isinstance(v, float):
        return AnyValue(double_value=v)
    if isinstance(v, bytes):
        return AnyValue(bytes_value=v)
    if isinstance(v, list):
        out = AnyValue()
        out.array_value.values.extend(_value(x) for x in v)
        return out
    if isinstance(v, dict):
        out = AnyValue()
        out.kvlist_value.values.extend(KeyValue(key=k, value=_value(x)) for k, x in v.items())
        return out
    return AnyValue(string_value=str(v))


_scalars = (st.text(max_size=40) | st.booleans() | st.integers(min_value=-(2**63), max_value=2**63 - 1)
            | st.floats(allow_nan=True) | st.binary(max_size=40) | st.sampled_from([*SPAN_KINDS, "client", "server"]))


def _nested(inner: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=3)


_values = st.recursive(_scalars, _nested, max_leaves=12)
_times = st.integers(min_value=0, max_value=2**64 - 1)


@st.composite
def hostile_spans(draw: st.DrawFn) -> OtlpSpan:
    """Any shape at all, but usually claiming a place in the span model with attributes of any type."""
    attrs = draw(st.dictionaries(st.sampled_from(MODEL_KEYS) | st.text(max_size=20), _values, max_size=10))
    if draw(st.booleans()):
        attrs[sc.SPAN] = draw(st.sampled_from(SPAN_KINDS) | _values)
    span = OtlpSpan(trace_id=draw(st.binary(min_size=0, max_size=20)), span_id=draw(st.binary(min_size=0, max_size=10)),
                    parent_span_id=draw(st.binary(max_size=10)), name=draw(st.text(max_size=60)),
                    kind=draw(st.integers(min_value=0, max_value=5)), start_time_unix_nano=draw(_times),
                    end_time_unix_nano=draw(_times))
    span.attributes.extend(KeyValue(key=k, value=_value(v)) for k, v in attrs.items())
    return span


def _valid_span(session: str) -> OtlpSpan:
    """A client resume that ended cleanly with call 7 pending: the ledger must hold it afterwards."""
    span = OtlpSpan(trace_id=os.urandom(16), span_id=os.urandom(8), name="MCP stream resume", kind=3,
                    start_time_unix_nano=1_700_000_000_000_000_000, end_time_unix_nano=1_700_000_001_000_000_000)
    span.attributes.extend(KeyValue(key=k, value=_value(v)) for k, v in {
        sc.SPAN: sc.SPAN_STREAM, sc.ROLE: sc.ROLE_CLIENT, sc.ERA: sc.ERA_RESUMABLE, sc.STREAM_KIND: "resume",
        sc.END_REASON: sc.END_CLEAN, sc.MCP_SESSION_ID: session, sc.STREAM_REQUEST_IDS: ["7"],
        sc.PENDING_REQUEST_IDS: ["7"], sc.RESUME_CURSOR: "41", sc.EVENTS_COUNT: 0,
        sc.HTTP_RESPONSE_STATUS_CODE: 200}.items())
    return span


def _request(spans: list[OtlpSpan]) -> ExportTraceServiceRequest:
    request = ExportTraceServiceRequest()
    request.resource_spans.add().scope_spans.add().spans.extend(spans)
    return request


def _assert_valid_span_reached_the_ledger(detector: Detector, queue: IngestQueue, session: str) -> None:
    assert queue.wait_idle(10)
    with detector.lock:
        call = detector.ledger.find(session, "7")
    assert call is not None and call.in_flight, f"the valid span of {session} was lost"


def _assert_still_serving(client: TestClient) -> None:
    assert client.get("/healthz").status_code == 200
    assert client.get("/readyz").status_code == 200


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow, HealthCheck.data_too_large])
@given(hostile=st.lists(hostile_spans(), max_size=12), position=st.integers(min_value=0, max_value=12),
       gzipped=st.booleans())
def test_a_hostile_protobuf_batch_is_answered_with_reasons_and_its_valid_span_kept(ingest, hostile, position, gzipped):
    client, detector, queue = ingest
    _count("protobuf batches")
    session = f"fuzz-{next(_sessions)}"
    spans = list(hostile)
    spans.insert(min(position, len(spans)), _valid_span(session))
    body = _request(spans).SerializeToString()
    headers = {"content-type": PROTOBUF}
    if gzipped:
        body, headers["content-encoding"] = gzip.compress(body), "gzip"
    answer = client.post("/v1/traces", content=body, headers=headers)
    assert answer.status_code == 200, answer.text
    partial = ExportTraceServiceResponse.FromString(answer.content).partial_success
    assert partial.rejected_spans <= len(hostile)
    assert bool(partial.rejected_spans) == bool(partial.error_message), "every rejection says why"
    TRIED["hostile spans"] = TRIED.get("hostile spans", 0) + len(hostile)
    TRIED["spans rejected"] = TRIED.get("spans rejected", 0) + partial.rejected_spans
    _assert_valid_span_reached_the_ledger(detector, queue, session)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow, HealthCheck.data_too_large])
@given(hostile=st.lists(hostile_spans(), max_size=6), junk=st.dictionaries(st.text(max_size=10), _values, max_size=4))
def test_a_hostile_json_batch_is_answered_with_reasons_and_its_valid_span_kept(ingest, hostile, junk):
    client, detector, queue = ingest
    _count("json batches")
    session = f"fuzz-{next(_sessions)}"
    document = json_format.MessageToDict(_request([*hostile, _valid_span(session)]))
    for resource in document["resourceSpans"]:  # OTLP/JSON carries ids as hex, and unknown fields are ignored
        for scope in resource["scopeSpans"]:
            for span in scope["spans"]:
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64decode(span[key]).hex()
    document.update({f"x-{k}": v for k, v in json.loads(json.dumps(junk, default=repr)).items()})
    answer = client.post("/v1/traces", content=json.dumps(document, default=repr), headers={"content-type": JSON})
    assert answer.status_code == 200, answer.text
    partial = answer.json().get("partialSuccess", {})
    assert int(partial.get("rejectedSpans", 0)) <= len(hostile)
    _assert_valid_span_reached_the_ledger(detector, queue, session)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(max_size=2048), media=st.sampled_from([PROTOBUF, JSON, "text/plain", ""]),
       encoding=st.sampled_from([None, "gzip", "br", "identity"]))
def test_arbitrary_bytes_get_a_clear_answer_and_the_detector_keeps_serving(ingest, body, media, encoding):
    client, _, _ = ingest
    _count("raw bodies")
    headers = {"content-type": media} | ({"content-encoding": encoding} if encoding else {})
    answer = client.post("/v1/traces", content=body, headers=headers)
    assert answer.status_code in {200, 400, 413, 415}, answer.text
    if answer.status_code != 200:
        assert answer.json()["error"], "every refusal says why"
    _assert_still_serving(client)


@pytest.mark.parametrize(("name", "body", "media", "status"), [
    ("nesting 100k deep", b"[" * 100_000 + b"]" * 100_000, JSON, 400),
    ("attribute list 100k deep", json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": [{"attributes": [
        {"key": "k", "value": {"arrayValue": {"values": []}}}]}]}]}]}).replace(
        '"values": []', '"values": [' + '{"arrayValue": {"values": [' * 3000 + "]}}" * 3000 + "]").encode(),
     JSON, 400),
    ("not UTF-8", b'{"resourceSpans": "\xff\xfe"}', JSON, 400),
    ("a string field that is not UTF-8", _request([OtlpSpan(name="x")]).SerializeToString().replace(b"x", b"\xff"),
     PROTOBUF, 400),
    ("a 255 KiB attribute", _request([OtlpSpan(name="big", attributes=[
        KeyValue(key=sc.SPAN, value=AnyValue(string_value="s" * 255_000))])]).SerializeToString(), PROTOBUF, 200),
    ("a body over the limit", b"\x00" * (256 * 1024 + 1), PROTOBUF, 413),
    ("too many spans", _request([OtlpSpan(name=str(i)) for i in range(201)]).SerializeToString(), PROTOBUF, 413),
])
def test_absurd_inputs_get_a_clear_answer(ingest, name, body, media, status):
    client, _, _ = ingest
    _count("absurd bodies")
    answer = client.post("/v1/traces", content=body, headers={"content-type": media})
    assert answer.status_code == status, f"{name}: {answer.status_code} {answer.text[:200]}"
    _assert_still_serving(client)


def test_spans_out_of_order_duplicated_and_from_the_future_are_taken_or_refused_with_reasons(ingest):
    client, detector, queue = ingest
    _count("ordering batches")
    session = f"fuzz-{next(_sessions)}"
    valid = _valid_span(session)
    future = _valid_span(f"{session}-future")
    future.start_time_unix_nano = future.end_time_unix_nano = 2**63  # year 2262
    backwards = _valid_span(f"{session}-backwards")
    backwards.end_time_unix_nano = backwards.start_time_unix_nano - 1
    answer = client.post("/v1/traces", content=_request([future, valid, valid, backwards]).SerializeToString(),
                         headers={"content-type": PROTOBUF})
    partial = ExportTraceServiceResponse.FromString(answer.content).partial_success
    assert answer.status_code == 200
    assert partial.rejected_spans == 1 and "ends before it starts" in partial.error_message
    _assert_valid_span_reached_the_ledger(detector, queue, session)


def test_coverage_guided_fuzzing_of_the_ingest_path_finds_no_crash(tmp_path):
    pytest.importorskip("atheris", reason="atheris has no wheel for this platform")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    seed = _request([_valid_span("seed"), _valid_span("seed")])
    (corpus / "protobuf").write_bytes(b"\x00\x00" + seed.SerializeToString())
    (corpus / "json").write_bytes(b"\x01\x00" + json_format.MessageToJson(seed).encode())
    (corpus / "gzip").write_bytes(b"\x00\x01" + gzip.compress(seed.SerializeToString()))
    target = Path(__file__).resolve().parents[1] / "fuzz" / "otlp_ingest.py"
    run = subprocess.run([sys.executable, str(target), str(corpus), "-runs=20000", "-max_total_time=20"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    runs = re.search(r"Done (\d+) runs", run.stderr)
    assert runs, run.stderr[-2000:]
    TRIED["atheris runs"] = int(runs[1])

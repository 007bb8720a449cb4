"""The detector's bounds under hostile spans: label values from closed sets, capped strings, no token
kept anywhere; memory bounded in bytes (budget, per-session state, timers, evidence)."""

from __future__ import annotations

import dataclasses
import json

from prometheus_client import generate_latest

from mcp_stream_exporter import semconv as sc
from mcp_stream_exporter.detector import Detector, DetectorConfig, RuleConfig, Span
from mcp_stream_exporter.detector.metrics import END_REASONS, OTHER, STREAM_KINDS

from spans import FETCH, S, call, sdk_call, stream

C, SV = sc.ROLE_CLIENT, sc.ROLE_SERVER
CONFIG = DetectorConfig(rules=RuleConfig(clean_end_grace_s=5, reissue_grace_s=5, resume_loop_count=3,
                                         resume_loop_window_s=10))
JWT = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ1c2VyIn0.c2lnbmF0dXJlLWJ5dGVz"


class Clock:
    def __init__(self) -> None:
        self.now = 100 * S

    def __call__(self) -> int:
        return self.now


def _with(span: Span, **attributes: object) -> Span:
    return dataclasses.replace(span, attributes={**span.attributes, **attributes})


def _label_flood(values: list[str]) -> Detector:
    """Every attribute that reaches a metric label, one new value per span."""
    clock = Clock()
    detector = Detector(CONFIG, clock=clock)
    for i, v in enumerate(values):
        rid = str(i)
        detector.consume([
            stream(C, v, v, tool=v, ids=(rid,), session=f"s{i}"),
            stream(C, "resume", "clean", tool=v, ids=(rid,), pending=(rid,), cursor=f"c{i}", missing=(FETCH,),
                   session=f"s{i}"),
            call(C, sc.OUTCOME_CANCELLED, request_id=rid, tool=v, session=f"s{i}"),
            sdk_call(C, v, request_id=rid, error_type=v),
            sdk_call(SV, v, request_id=rid, error_type=v),
            _with(sdk_call(SV, "fetch", request_id=rid), **{sc.MCP_METHOD_NAME: v, sc.RPC_RESPONSE_STATUS_CODE: v}),
            dataclasses.replace(sdk_call(C, "fetch", request_id=rid, timed_out=True), name=f"MCP send tools/call {v}",
                                exception_types=(v,)),
        ])
    clock.now += 6 * S
    detector.tick()
    return detector


def _series(detector: Detector) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    return {(s.name, tuple(sorted(s.labels.items()))) for m in detector.registry.collect() for s in m.samples}


def _flood_values(n: int) -> list[str]:
    shapes = ["tool{}", "Bearer {}", "x" * 300 + "{}", "\u00e9\u00e8{}", "a b {}", f"{JWT}{{}}", "{}/../../etc"]
    return [shapes[i % len(shapes)].format(i) for i in range(n)]


def test_a_flood_of_new_values_in_every_attribute_that_reaches_a_label_adds_no_series_past_the_bounded_sets():
    small, large = _label_flood(_flood_values(100)), _label_flood(_flood_values(400))
    assert len(_series(small)) == len(_series(large)), "series grow with the values sent"
    assert len(large.findings) > 0, "the flood went through the rules"
    labels: dict[str, set[str]] = {}
    for _, pairs in _series(large):
        for name, value in pairs:
            labels.setdefault(name, set()).add(value)
    assert labels["kind"] <= {*STREAM_KINDS, OTHER}
    assert labels["reason"] - {*END_REASONS, OTHER} <= {"too_large", "bad_encoding", "malformed", "unauthorized",
                                                         "too_many_spans", "queue_full", "span_model", "ttl",
                                                         "capacity", "memory", "busy", "timeout"}
    assert labels["role"] <= {C, SV}
    assert len(labels["tool"] - {OTHER}) <= CONFIG.max_tool_labels
    assert len(labels["gen_ai_tool_name"] - {OTHER, ""}) <= CONFIG.max_tool_labels
    assert labels["mcp_method_name"] <= {"tools/call", OTHER}
    assert labels["error_type"] <= {"", "timeout", OTHER}
    for value in set().union(*labels.values()):
        assert len(value) <= 64 and "Bearer" not in value and "eyJ" not in value, value
    print(f"\nseries after 400 new values in every attribute that reaches a label: {len(_series(large))}")


def test_token_shaped_values_in_any_attribute_are_redacted_from_ledger_findings_metrics_and_logs():
    clock = Clock()
    detector = Detector(CONFIG, clock=clock)
    bearer = f"Bearer {JWT}"
    spans = [stream(C, "resume", "clean", pending=(bearer,), ids=(bearer,), cursor=bearer, session=bearer,
                    tool=bearer, audience=(JWT,), missing=(f"https://x/{JWT}",), last=bearer, first=JWT),
             call(C, sc.OUTCOME_CANCELLED, request_id=bearer, session=bearer, tool=bearer)]
    spans = [dataclasses.replace(s, origin=f"svc {bearer}") for s in spans]
    outcome = detector.consume([*spans, _with(spans[0], **{sc.SPAN: bearer})])
    clock.now += 6 * S
    detector.tick()
    assert outcome.rejected_count == 1 and JWT not in outcome.message()
    assert {f.rule for f in detector.findings} >= {"clean_end_pending", "narrowed_resume"}
    kept = json.dumps([detector.ledger.dump(), detector.findings.dump()]) + generate_latest(detector.registry).decode()
    assert "[redacted]" in kept
    for secret in (JWT, JWT.split(".")[2], "Bearer"):
        assert secret not in kept

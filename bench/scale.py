"""Detection at scale on the real SDK: 10,000 tools/call over 500 sessions, 100 open at once, 1 % lost.

The fleet (``mcp_stream_exporter.lab.fleet``): one instrumented incident server and instrumented SDK
clients on 127.0.0.1, every call real; a known set of sessions loses its poll call to the incident's
silent replay. The detector runs embedded (a span processor on the application's provider, as
``embed_detector`` installs it), with the application sampling the SDK's spans at ``--sdk-sampling``.
Reports whether every loss was found exactly once and nothing else, and what it cost. Bounded: the
plan's calls, and ``--timeout-s`` for the whole run.

    python bench/scale.py [--sessions 500] [--calls-per-session 20] [--lossy 100] [--concurrent 100]
                          [--sdk-sampling 1.0] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import resource
import sys
import time
import warnings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=500)
    parser.add_argument("--calls-per-session", type=int, default=20)
    parser.add_argument("--lossy", type=int, default=100, help="sessions that lose their poll call")
    parser.add_argument("--concurrent", type=int, default=100, help="sessions open at once")
    parser.add_argument("--sdk-sampling", type=float, default=1.0,
                        help="the application's ParentBased(TraceIdRatioBased) ratio for the SDK's spans")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="bound on the whole run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased

    from mcp_stream_exporter.detector import Detector, DetectorConfig, RuleConfig
    from mcp_stream_exporter.detector.embedded import embed_detector
    from mcp_stream_exporter.detector.rules import RULES
    from mcp_stream_exporter.lab.fleet import FleetPlan, run_fleet

    logging.disable(logging.CRITICAL)  # the SDK logs every resume and each session's close; the figures are the output
    warnings.simplefilter("ignore")
    offset = [0]
    grace_s = 5.0
    detector = Detector(DetectorConfig(rules=RuleConfig(clean_end_grace_s=grace_s)),
                        clock=lambda: time.time_ns() + offset[0])
    sampler = ALWAYS_OFF if args.sdk_sampling <= 0 else ParentBased(TraceIdRatioBased(args.sdk_sampling))
    provider = TracerProvider(sampler=sampler)
    trace.set_tracer_provider(provider)
    embed_detector(tracer_provider=provider, detector=detector)
    plan = FleetPlan(sessions=args.sessions, calls_per_session=args.calls_per_session, lossy_sessions=args.lossy,
                     concurrent=args.concurrent)
    cpu_before = time.process_time()
    outcome = asyncio.run(asyncio.wait_for(run_fleet(plan), args.timeout_s))
    cpu_s = time.process_time() - cpu_before
    offset[0] = int((grace_s + 1) * 1e9)
    detector.tick()

    findings = list(detector.findings)
    losses = [f for f in findings if RULES[f.rule].loss]
    found = {f.session_id for f in losses}
    report = {
        "sessions": plan.sessions, "calls": outcome.calls, "peak_open_sessions": outcome.peak_open,
        "lossy_sessions": len(outcome.lossy), "losses_found": len(found & outcome.lossy),
        "losses_missed": len(outcome.lossy - found), "loss_findings": len(losses),
        # a finding on a session where every call got its result
        "false_positive_findings": sum(1 for f in findings if f.session_id not in outcome.lost),
        "healthy_calls_timed_out_under_load": len(outcome.lost - outcome.lossy),
        "of_which_flagged_as_lost": len(found - outcome.lossy),
        "findings_by_rule": {r: sum(1 for f in findings if f.rule == r) for r in sorted({f.rule for f in findings})},
        "sdk_sampling": args.sdk_sampling, "elapsed_s": round(outcome.elapsed_s, 1),
        "calls_per_s": round(outcome.calls / outcome.elapsed_s, 1), "process_cpu_s": round(cpu_s, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "ledger_calls": detector.ledger.calls, "ledger_sessions": detector.ledger.sessions,
    }
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:36} {value}")
    ok = report["losses_missed"] == 0 and report["false_positive_findings"] == 0 and len(losses) == len(found)
    ok = ok and found <= outcome.lost
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

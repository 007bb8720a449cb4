"""The detector: spans in (OTLP or in-process), findings and Prometheus metrics out."""

from mcp_stream_exporter.detector.detector import Detector, DetectorConfig, Outcome
from mcp_stream_exporter.detector.events import Span
from mcp_stream_exporter.detector.findings import Finding, FindingStore, Query
from mcp_stream_exporter.detector.ledger import LedgerLimits
from mcp_stream_exporter.detector.rules import RULES, Rule, RuleConfig, RuleId

__all__ = ["RULES", "Detector", "DetectorConfig", "Finding", "FindingStore", "LedgerLimits", "Outcome", "Query",
           "Rule", "RuleConfig", "RuleId", "Span"]

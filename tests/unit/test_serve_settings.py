"""`serve`'s settings (pydantic-settings): flags over MCP_STREAM_* over the TOML file over the defaults,
every component setting reachable, ranges enforced, secrets masked. The command's exit codes and
messages are proven in a subprocess by tests/integration/test_serve_command.py."""

from __future__ import annotations

import dataclasses
import os

import pytest

from mcp_stream_exporter.detector import DetectorConfig, LedgerLimits, RuleConfig
from mcp_stream_exporter.detector.connections import ConnectionLimits
from mcp_stream_exporter.detector.ingest import IngestLimits
from mcp_stream_exporter.detector.settings import ConfigError, ServiceConfig, effective, load, parser
from mcp_stream_exporter.detector.ui import RUNBOOK_BASE_URL


@pytest.fixture(autouse=True)
def _no_outside_settings(monkeypatch):
    """The process environment of whoever runs the tests never leaks in."""
    for name in [n for n in os.environ if n.upper().startswith("MCP_STREAM_")]:
        monkeypatch.delenv(name)


def test_a_flag_beats_the_environment_which_beats_the_file_which_beats_the_default(tmp_path, monkeypatch):
    file = tmp_path / "detector.toml"
    file.write_text("port = 1001\ngrpc_port = 1002\nmax_index = 1003\n")
    monkeypatch.setenv("MCP_STREAM_PORT", "2001")
    monkeypatch.setenv("MCP_STREAM_GRPC_PORT", "2002")
    invocation = load(["--config", str(file), "--port", "3001"])
    config = invocation.config
    assert (config.port, config.grpc_port, config.max_index, config.max_findings) == (3001, 2002, 1003, 10_000)
    assert invocation.sources["port"] == "--port"
    assert invocation.sources["grpc_port"] == "MCP_STREAM_GRPC_PORT"
    assert invocation.sources["max_index"] == str(file)
    assert invocation.sources["max_findings"] == "default"


def test_the_file_can_be_named_by_the_environment(tmp_path, monkeypatch):
    file = tmp_path / "detector.toml"
    file.write_text('log_level = "warning"\n')
    monkeypatch.setenv("MCP_STREAM_CONFIG", str(file))
    assert load([]).config.log_level == "warning"


def test_every_setting_has_a_flag_and_the_help_names_its_variable_and_default():
    text = parser().format_help()
    for name in ServiceConfig.model_fields:
        assert f"--{name.replace('_', '-')} " in text
        assert f"MCP_STREAM_{name.upper()};" in text
    assert "flags > environment > file > defaults" in text


def test_the_flags_the_chart_and_the_tests_pass_still_mean_what_they_did():
    config = load(["--host=0.0.0.0", "--port=9464", "--grpc-port=-1", "--clean-end-grace-s=2.5",
                   "--reissue-grace-s=1", "--max-sessions=10", "--max-calls-per-session=5", "--session-ttl-s=60",
                   "--max-queued-spans=100", "--max-memory-mb=64", "--log-level=INFO",
                   "--snapshot-interval-s=5"]).config
    assert config.detector_config().rules == RuleConfig(2.5, 1.0, 5, 60.0)
    assert config.detector_config().ledger.max_sessions == 10
    assert config.ingest_limits().max_queued_spans == 100
    assert config.log_level == "info"


def test_the_defaults_are_the_components_defaults():
    """One default per setting: serve's own equal those of the parts it configures."""
    config = ServiceConfig()
    parts = (RuleConfig(), LedgerLimits(), IngestLimits(), ConnectionLimits())
    for part in parts:
        for f in dataclasses.fields(part):
            if f.name in ServiceConfig.model_fields:
                assert getattr(config, f.name) == getattr(part, f.name), f.name
    assert config.max_tool_labels == DetectorConfig().max_tool_labels
    assert config.max_findings == DetectorConfig().max_findings
    assert config.runbook_base_url == RUNBOOK_BASE_URL


def test_settings_that_were_out_of_reach_reach_their_component():
    config = load(["--max-index=7", "--retry-after-s=9", "--max-tool-labels=3",
                   "--max-resumes-per-session=4"]).config
    assert config.detector_config().ledger.max_index == 7
    assert config.detector_config().ledger.max_resumes_per_session == 4
    assert config.detector_config().max_tool_labels == 3
    assert config.ingest_limits().retry_after_s == 9


def test_the_policy_file_gives_the_tool_labels(tmp_path):
    policy = tmp_path / "policy.json"
    policy.write_text('{"resource": "https://mcp.example.com", "tools": {"search": {}, "fetch": {}}}')
    assert load([f"--policy={policy}"]).config.detector_config().tools == ("fetch", "search")


@pytest.mark.parametrize(("argv", "said"), [
    (["--log-level=verbose"], "--log-level=verbose: Input should be 'debug', 'info'"),
    (["--port=-1"], "--port=-1: Input should be greater than or equal to 0"),
    (["--grpc-port=70000"], "--grpc-port=70000: Input should be less than or equal to 65535"),
    (["--session-ttl-s=nan"], "--session-ttl-s=nan: Input should be a finite number"),
    (["--clean-end-grace-s=-1"], "--clean-end-grace-s=-1: Input should be greater than or equal to 0"),
    (["--max-memory-mb=0"], "--max-memory-mb=0: Input should be greater than or equal to 1"),
    (["--max-sessions=ten"], "--max-sessions=ten: Input should be a valid integer"),
    (["--max-buffered-bytes=65536"], "--max-buffered-bytes (65536) must be at least --max-body-bytes (4194304)"),
    (["--metrics-user=prom"], "--metrics-user needs --metrics-password"),
    (["--metrics-password=x"], "--metrics-password needs --metrics-user"),
    (["--tls-cert=/no/cert.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-cert=/no/cert.pem", "--tls-key=/no/key.pem"], "--tls-cert/--tls-key: no such file or directory"),
    (["--policy=/no/policy.json"], "--policy /no/policy.json: no such file or directory"),
    (["--trace-url-template=tempo/{id}"], "must be an http(s) URL with {trace_id} in it"),
    (["--port"], "expected one argument"),
])
def test_a_bad_setting_is_one_line_naming_the_setting_and_what_is_wrong(argv, said):
    with pytest.raises(ConfigError) as raised:
        load(argv)
    assert said in str(raised.value)
    assert "\n" not in str(raised.value)


def test_a_bad_setting_in_the_environment_or_the_file_says_where_it_came_from(tmp_path, monkeypatch):
    file = tmp_path / "detector.toml"
    file.write_text("max_findings = -5\nnot_a_setting = 1\n")
    monkeypatch.setenv("MCP_STREAM_IDLE_TIMEOUT_S", "0")
    with pytest.raises(ConfigError) as raised:
        load(["--config", str(file)])
    text = str(raised.value)
    assert f"max_findings=-5 in {file}: Input should be greater than or equal to 1" in text
    assert f"{file}: unknown setting 'not_a_setting'" in text
    assert "MCP_STREAM_IDLE_TIMEOUT_S=0: Input should be greater than 0" in text


def test_a_missing_or_broken_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load(["--config", str(tmp_path / "absent.toml")])
    broken = tmp_path / "broken.toml"
    broken.write_text("port = \n")
    with pytest.raises(ConfigError, match=r"not TOML: Invalid value \(at line 1, column 8\)"):
        load(["--config", str(broken)])


def test_the_effective_settings_mask_the_secrets_and_say_where_each_came_from(monkeypatch):
    monkeypatch.setenv("MCP_STREAM_API_TOKEN", "api-secret")
    invocation = load(["--ingest-token=ingest-secret", "--metrics-user=prom", "--metrics-password=pw-secret",
                       "--check-config"])
    text = effective(invocation)
    assert invocation.check_only
    assert "secret" not in text
    assert 'api_token = "********"  # MCP_STREAM_API_TOKEN' in text
    assert 'ingest_token = "********"  # --ingest-token' in text
    assert 'metrics_user = "prom"  # --metrics-user' in text
    assert "port = 9464  # default" in text
    assert "# tls_cert is unset" in text
    assert invocation.config.access().ingest_token == "ingest-secret"  # the app still gets it in clear
    assert "ingest-secret" not in repr(invocation.config)


def test_version_needs_no_valid_settings(monkeypatch):
    monkeypatch.setenv("MCP_STREAM_LOG_LEVEL", "verbose")
    assert load(["--version"]).version

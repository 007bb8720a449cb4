"""`mcp-stream-exporter serve` as an operator meets it: a bad setting is one readable line on stderr and
exit code 2, never a traceback; `--version` and `--check-config` answer without starting anything."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mcp_stream_exporter import __version__


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("MCP_STREAM_")}
    return subprocess.run([sys.executable, "-m", "mcp_stream_exporter.cli", "serve", "--port=0", "--grpc-port=-1",
                           "--otlp-http-port=-1", *args], env={**clean, **(env or {})}, capture_output=True,
                          text=True, timeout=60, check=False)


def _refused(result: subprocess.CompletedProcess[str], said: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith("mcp-stream-exporter serve: ") and said in line
    assert result.stdout == ""


def test_a_bad_log_level_is_refused():
    _refused(_serve("--log-level=verbose"), "--log-level=verbose: Input should be 'debug'")


def test_a_missing_config_file_is_refused(tmp_path):
    _refused(_serve("--config", str(tmp_path / "absent.toml")), "absent.toml: no such file")


def test_a_config_file_that_is_not_toml_is_refused(tmp_path):
    file = tmp_path / "detector.toml"
    file.write_text("[detector\nport = 1\n")
    _refused(_serve("--config", str(file)), "not TOML")


@pytest.mark.parametrize("where", ["flag", "env", "file"])
def test_a_negative_value_is_refused_from_a_flag_the_environment_or_the_file(tmp_path, where):
    file = tmp_path / "detector.toml"
    file.write_text("max_queued_spans = -1\n")
    args = {"flag": ("--max-queued-spans=-1",), "env": (), "file": ("--config", str(file))}[where]
    env = {"MCP_STREAM_MAX_QUEUED_SPANS": "-1"} if where == "env" else None
    _refused(_serve(*args, env=env), "Input should be greater than or equal to 1")


@pytest.mark.parametrize("value", ["nan", "NaN", "inf"])
def test_a_value_that_is_not_a_finite_number_is_refused(value):
    _refused(_serve(f"--body-timeout-s={value}"), "Input should be a finite number")


def test_a_nan_in_the_toml_file_is_refused(tmp_path):
    file = tmp_path / "detector.toml"
    file.write_text("clean_end_grace_s = nan\n")
    _refused(_serve("--config", str(file)), f"clean_end_grace_s=nan in {file}: Input should be a finite number")


def test_a_metrics_user_without_a_password_is_refused():
    _refused(_serve("--metrics-user=prom"), "--metrics-user needs --metrics-password")


def test_an_unknown_flag_is_refused():
    _refused(_serve("--max-memory=64"), "unrecognized arguments: --max-memory=64")


def test_version_prints_the_version():
    result = _serve("--version")
    assert (result.returncode, result.stdout.strip()) == (0, f"mcp-stream-exporter {__version__}")


def test_check_config_prints_the_effective_settings_with_secrets_masked_and_exits_0(tmp_path):
    file = tmp_path / "detector.toml"
    file.write_text('api_token = "api-secret"\nmax_index = 123\n')
    result = _serve("--config", str(file), "--check-config", "--metrics-user=prom",
                    env={"MCP_STREAM_METRICS_PASSWORD": "pw-secret"})
    assert result.returncode == 0, result.stderr
    assert "secret" not in result.stdout + result.stderr
    assert f"max_index = 123  # {file}" in result.stdout
    assert 'metrics_password = "********"  # MCP_STREAM_METRICS_PASSWORD' in result.stdout
    assert "port = 0  # --port" in result.stdout


def test_check_config_exits_2_on_a_bad_setting():
    _refused(_serve("--check-config", "--session-ttl-s=-5"), "--session-ttl-s=-5")

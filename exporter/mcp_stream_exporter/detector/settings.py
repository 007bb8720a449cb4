"""The settings of ``mcp-stream-exporter serve``: flags, then ``MCP_STREAM_<NAME>``, then a TOML file.

Every setting is one field of ``ServiceConfig`` (pydantic-settings), so a flag, an environment variable
and a file key always mean the same thing and pass the same checks. A bad setting is a ``ConfigError``
with one readable line; the command prints it and exits 2.
"""

from __future__ import annotations

import argparse
import os
import ssl
import tomllib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn, get_args, get_origin

from pydantic import Field, PrivateAttr, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from mcp_stream_exporter.auth import ToolPolicy
from mcp_stream_exporter.detector.app import Access
from mcp_stream_exporter.detector.connections import ConnectionLimits
from mcp_stream_exporter.detector.detector import DetectorConfig
from mcp_stream_exporter.detector.ledger import LedgerLimits
from mcp_stream_exporter.detector.limits import IngestLimits
from mcp_stream_exporter.detector.rules import RuleConfig
from mcp_stream_exporter.detector.ui import RUNBOOK_BASE_URL, UiLinks

ENV_PREFIX = "MCP_STREAM_"
PROG = "mcp-stream-exporter serve"
LogLevel = Literal["debug", "info", "warning", "error", "critical"]

Port = Annotated[int, Field(ge=0, le=65535)]
OptionalPort = Annotated[int, Field(ge=-1, le=65535)]  # -1: that listener is off
Count = Annotated[int, Field(ge=1)]
Seconds = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Grace = Annotated[float, Field(ge=0, allow_inf_nan=False)]

_config_file: ContextVar[Path | None] = ContextVar("mcp_stream_exporter_config_file", default=None)


class ConfigError(Exception):
    """A setting that cannot be used, said in one line."""


class ServiceConfig(BaseSettings):
    """Everything ``serve`` can be told. Field descriptions are the ``--help`` text."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    # where it listens
    host: str = Field("127.0.0.1", description="address to listen on (0.0.0.0 in a container)")
    port: Port = Field(9464, description="HTTP: OTLP/HTTP /v1/traces, /metrics, /api, /ui; 0 picks a free port")
    grpc_port: OptionalPort = Field(4317, description="OTLP/gRPC; 0 picks a free port, -1 turns it off")
    otlp_http_port: OptionalPort = Field(4318, description="OTLP/HTTP /v1/traces alone, on the OTLP port; 0 picks a "
                                                           "free port, -1 turns it off")
    # who may use it
    ingest_token: SecretStr | None = Field(None, description="bearer token required on OTLP ingest (HTTP, gRPC)")
    api_token: SecretStr | None = Field(None, description="bearer token required on /api and /ui")
    metrics_user: str | None = Field(None, description="basic-auth user on /metrics (with --metrics-password)")
    metrics_password: SecretStr | None = Field(None, description="basic-auth password on /metrics")
    tls_cert: Path | None = Field(None, description="PEM certificate: with --tls-key, HTTPS and gRPC over TLS")
    tls_key: Path | None = Field(None, description="PEM private key of --tls-cert")
    # what it looks for
    policy: Path | None = Field(None, description="a ToolPolicy file (JSON or TOML): its tools are the tool "
                                                  "label values")
    max_tool_labels: Count = Field(20, description="without --policy: the first tools seen are labels, then "
                                                   "`other`")
    clean_end_grace_s: Grace = Field(30.0, description="wait this long for a result after a clean stream end")
    reissue_grace_s: Grace = Field(30.0, description="wait this long for a re-issue of a call lost to a broken "
                                                     "stream")
    resume_loop_count: Count = Field(5, description="resumes of one cursor that make a loop ...")
    resume_loop_window_s: Seconds = Field(60.0, description="... within this many seconds")
    cancel_race_s: Grace = Field(1.0, description="a cancel this soon after the server sent the call's result may "
                                                  "have crossed it on the wire: no loss")
    # how much it holds
    max_memory_mb: Count = Field(256, description="budget of the detector's state: 5/8 ledger, 1/8 findings, "
                                                  "1/8 timelines, 1/8 ingest queue")
    max_sessions: Count = Field(20_000, description="sessions in the ledger; past it the least recent is evicted")
    max_calls_per_session: Count = Field(1_000, description="calls held per session")
    session_ttl_s: Seconds = Field(3600.0, description="a session idle this long leaves the ledger")
    max_index: Count = Field(50_000, description="entries in the SDK-span and re-issue look-ups")
    max_resumes_per_session: Count = Field(64, description="resume cursors watched for loops per session")
    max_findings: Count = Field(10_000, description="findings kept for /api; the oldest go first")
    # what one request may cost
    max_body_bytes: Count = Field(4 * 1024 * 1024, description="an OTLP/HTTP body as received; beyond: 413")
    max_decompressed_bytes: Count = Field(16 * 1024 * 1024, description="a body once decompressed")
    max_spans_per_request: Count = Field(10_000, description="spans in one request")
    max_queued_spans: Count = Field(200_000, description="spans accepted and waiting; beyond: 429")
    retry_after_s: Count = Field(2, description="the Retry-After of a 429")
    max_span_bytes: Count = Field(256 * 1024, description="one encoded span: bounds what decoding it costs")
    max_json_values: Count = Field(200_000, description="values in one OTLP/JSON body, counted before parsing")
    max_decoding: Count = Field(2, description="requests decoded at once (HTTP and gRPC)")
    decoding_wait_s: Seconds = Field(5.0, description="a request waits this long for a decoding slot; then 429")
    max_buffered_bytes: Count = Field(32 * 1024 * 1024, description="request bodies held at once")
    body_timeout_s: Seconds = Field(30.0, description="to receive a body; then 408")
    # what clients may hold
    max_connections: Count = Field(256, description="HTTP connections at once; beyond: 503 and closed")
    header_timeout_s: Seconds = Field(10.0, description="to send a request's headers; then the connection closes")
    idle_timeout_s: Seconds = Field(30.0, description="an idle keep-alive connection (HTTP, gRPC) is closed")
    # what survives a restart
    snapshot_path: Path | None = Field(None, description="SQLite file: the ledger and findings survive restarts")
    snapshot_interval_s: Seconds = Field(30.0, description="a SIGKILL loses at most this much")
    senders_retry_s: Seconds = Field(10.0, description="how long span senders retry (an OTel SDK 10, a Collector "
                                                       "300): after a longer downtime, or a crash, the calls a "
                                                       "snapshot held owed are not judged")
    # what it says and links to
    log_level: LogLevel = Field("info", description="JSON logs on stderr from this level up")
    trace_url_template: str | None = Field(None, description="the findings page's trace links, e.g. "
                                                             "'https://tempo/trace/{trace_id}'")
    runbook_base_url: str = Field(RUNBOOK_BASE_URL, description="the findings page's runbook links (your copy "
                                                                "of docs/runbooks/)")

    _tools: tuple[str, ...] = PrivateAttr(())

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        # flags (given as init values) beat the environment, which beats the file; no .env, no secrets dir
        return init_settings, env_settings, TomlConfigSettingsSource(settings_cls, toml_file=_config_file.get())

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("trace_url_template")
    @classmethod
    def _trace_template(cls, value: str | None) -> str | None:
        if value is not None and (not value.startswith(("https://", "http://")) or "{trace_id}" not in value):
            raise ValueError("must be an http(s) URL with {trace_id} in it")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ServiceConfig:
        fixed = [p for p in (self.port, self.grpc_port, self.otlp_http_port) if p > 0]
        if len(set(fixed)) < len(fixed):
            raise ValueError(f"--port, --grpc-port and --otlp-http-port must differ (got {self.port}, "
                             f"{self.grpc_port}, {self.otlp_http_port})")
        if self.max_buffered_bytes < self.max_body_bytes:  # a body past the bodies' budget: told to retry for ever
            raise ValueError(f"--max-buffered-bytes ({self.max_buffered_bytes}) must be at least --max-body-bytes "
                             f"({self.max_body_bytes})")
        if self.metrics_user and not self.metrics_password:
            raise ValueError("--metrics-user needs --metrics-password (or MCP_STREAM_METRICS_PASSWORD)")
        if self.metrics_password and not self.metrics_user:
            raise ValueError("--metrics-password needs --metrics-user")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.tls_cert is not None and self.tls_key is not None:
            try:  # the files exist, parse and match: found now rather than when the listener starts
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.tls_cert, self.tls_key)
            except (OSError, ssl.SSLError) as exc:
                raise ValueError(f"--tls-cert/--tls-key: {_reason(exc)}") from None
        if self.policy is not None:
            try:
                self._tools = tuple(sorted(ToolPolicy.from_file(self.policy).tools))
            except (OSError, ValueError, TypeError, KeyError, RecursionError) as exc:
                raise ValueError(f"--policy {self.policy}: {_reason(exc)}") from None
        return self

    def detector_config(self) -> DetectorConfig:
        return DetectorConfig(
            rules=RuleConfig(self.clean_end_grace_s, self.reissue_grace_s, self.resume_loop_count,
                             self.resume_loop_window_s, cancel_race_s=self.cancel_race_s),
            ledger=LedgerLimits(self.max_sessions, self.max_calls_per_session, self.session_ttl_s,
                                max_index=self.max_index, max_bytes=self._budget_bytes(5 / 8),
                                max_resumes_per_session=self.max_resumes_per_session),
            max_findings=self.max_findings, max_findings_bytes=self._budget_bytes(1 / 8),
            max_timelines_bytes=self._budget_bytes(1 / 8), tools=self._tools, max_tool_labels=self.max_tool_labels)

    def _budget_bytes(self, share: float) -> int:
        return int(self.max_memory_mb * 1024 * 1024 * share)

    def ingest_limits(self) -> IngestLimits:
        return IngestLimits(self.max_body_bytes, self.max_decompressed_bytes, self.max_spans_per_request,
                            self.max_queued_spans, retry_after_s=self.retry_after_s,
                            max_queued_bytes=self._budget_bytes(1 / 8), max_span_bytes=self.max_span_bytes,
                            max_json_values=self.max_json_values, max_decoding=self.max_decoding,
                            decoding_wait_s=self.decoding_wait_s, max_buffered_bytes=self.max_buffered_bytes,
                            body_timeout_s=self.body_timeout_s)

    def connection_limits(self) -> ConnectionLimits:
        return ConnectionLimits(self.max_connections, self.header_timeout_s, self.idle_timeout_s)

    def links(self) -> UiLinks:
        return UiLinks(self.trace_url_template, self.runbook_base_url)

    def access(self) -> Access:
        basic = ((self.metrics_user, self.metrics_password.get_secret_value())
                 if self.metrics_user and self.metrics_password else None)
        return Access(_clear(self.ingest_token), _clear(self.api_token), basic)


@dataclass(frozen=True, slots=True)
class Invocation:
    """What ``serve`` was asked to do with its settings."""

    config: ServiceConfig
    sources: dict[str, str]  # setting -> where its value came from: a flag, a variable, the file, "default"
    file: Path | None = None
    check_only: bool = False
    version: bool = False


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message} (see --help)")


def _flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def _env(name: str) -> str:
    return f"{ENV_PREFIX}{name.upper()}"


def parser() -> argparse.ArgumentParser:
    """The flags: one per setting, each saying its variable and default."""
    p = _Parser(prog=PROG, allow_abbrev=False,
                usage="%(prog)s [--config FILE] [--check-config] [--version] [--SETTING VALUE ...]",
                formatter_class=argparse.RawDescriptionHelpFormatter,
                description="The standalone detector: OTLP in (HTTP and gRPC), /metrics, /api and the findings "
                            "page out.",
                epilog=f"Each setting is a flag, an environment variable {ENV_PREFIX}<NAME> or a key <name> in "
                       f"the TOML file\nof --config, in that precedence (flags > environment > file > defaults).")
    p.add_argument("--config", metavar="FILE", help=f"a TOML file with any of the settings below as "
                                                     f"`name = value` (env {_env('config')})")
    p.add_argument("--check-config", action="store_true",
                   help="validate the settings, print the effective ones (secrets masked) and exit: 0 when "
                        "valid, 2 when not")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    for name, info in ServiceConfig.model_fields.items():
        default = info.get_default()
        shown = "unset" if default is None else repr(default)
        p.add_argument(_flag(name), dest=name, metavar=_metavar(name, info.annotation), default=None,
                       help=f"{info.description} (env {_env(name)}; default {shown})")
    return p


def _metavar(name: str, annotation: Any) -> str:
    if name.endswith("_s"):
        return "SECONDS"
    if annotation is int:
        return "N"
    if get_origin(annotation) is Literal:
        return "{" + ",".join(get_args(annotation)) + "}"
    return "FILE" if Path in get_args(annotation) else "TEXT"


@contextmanager
def _reading(path: Path | None) -> Iterator[None]:
    token = _config_file.set(path)
    try:
        yield
    finally:
        _config_file.reset(token)


def load(argv: Sequence[str]) -> Invocation:
    """Parse ``argv``, read the environment and the file, validate: the settings, or a ``ConfigError``."""
    args = vars(parser().parse_args(list(argv)))
    if args["version"]:
        return Invocation(ServiceConfig.model_construct(), {}, version=True)
    flags = {n: v for n, v in args.items() if n in ServiceConfig.model_fields and v is not None}
    named = args["config"] or os.environ.get(_env("config"))
    path = Path(named) if named else None
    if path is not None and not path.is_file():
        raise ConfigError(f"--config {path}: {'not a file' if path.exists() else 'no such file'}")
    try:
        with _reading(path):
            config = ServiceConfig(**flags)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"--config {path}: {_reason(exc)}") from None
    except ValidationError as exc:
        raise ConfigError(_explain(exc, flags, path)) from None
    sources = {n: _source(n, flags, path) if n in config.model_fields_set else "default"
               for n in ServiceConfig.model_fields}
    return Invocation(config, sources, path, check_only=args["check_config"])


def _source(name: str, flags: dict[str, Any], path: Path | None) -> str:
    """Where a setting given at all came from, by precedence (the environment's names are case-insensitive)."""
    if name in flags:
        return _flag(name)
    if any(key.upper() == _env(name) for key in os.environ):
        return _env(name)
    return str(path) if path is not None else name


def effective(invocation: Invocation) -> str:
    """The settings as a TOML file would say them, secrets masked, each with where its value came from."""
    lines = [f"# {PROG}: the effective settings (flags > {ENV_PREFIX}* > {invocation.file or 'no file'} > "
             f"defaults)"]
    for name in ServiceConfig.model_fields:
        value = getattr(invocation.config, name)
        where = invocation.sources.get(name, "default")
        if value is None:
            lines.append(f"# {name} is unset")
            continue
        shown = '"********"' if isinstance(value, SecretStr) else _toml(value)
        lines.append(f"{name} = {shown}  # {where}")
    return "\n".join(lines)


def _toml(value: Any) -> str:
    if isinstance(value, int | float):
        return repr(value)
    escaped = str(value).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def _explain(exc: ValidationError, flags: dict[str, Any], path: Path | None) -> str:
    """Every problem in one line: which setting, from where, what is wrong with it."""
    problems = []
    for error in exc.errors(include_url=False):
        name = str(error["loc"][0]) if error["loc"] else ""
        message = error["msg"].removeprefix("Value error, ")
        if not name:
            problems.append(message)
        elif error["type"] == "extra_forbidden":
            problems.append(f"{path}: unknown setting {name!r}")
        else:
            shown = "********" if name in _SECRETS else str(error.get("input"))
            where = _source(name, flags, path)
            said = f"{name}={shown} in {where}" if where == str(path) else f"{where}={shown}"
            problems.append(f"{said}: {message}")
    return "invalid settings: " + "; ".join(problems)


_SECRETS = frozenset(n for n, f in ServiceConfig.model_fields.items() if SecretStr in get_args(f.annotation))


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


def _clear(secret: SecretStr | None) -> str | None:
    return secret.get_secret_value() if secret is not None else None

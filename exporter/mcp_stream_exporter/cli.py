"""``mcp-stream-exporter``: the command line.

Both commands run the detector, whose dependencies are the ``detector`` extra; the hooks alone do not
need them, so each command imports what it runs only once it runs.
"""

from __future__ import annotations

import argparse
import sys

from mcp_stream_exporter import __version__

# the top-level modules of the `detector` extra: missing, the command says how to install them
_DETECTOR_EXTRA = frozenset({"fastapi", "uvicorn", "grpc", "prometheus_client", "pydantic_settings", "google",
                             "opentelemetry"})


def _missing_extra(command: str, exc: ModuleNotFoundError) -> int:
    if (exc.name or "").split(".")[0] not in _DETECTOR_EXTRA:
        raise exc
    print(f"mcp-stream-exporter {command}: the detector's dependencies are not installed ({exc.name}): "
          f"pip install 'mcp-stream-exporter[detector]'", file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # the service parses its own flags (they mirror its config file and env)
        try:
            from mcp_stream_exporter.detector import service
        except ModuleNotFoundError as exc:
            return _missing_extra("serve", exc)
        return service.main(argv[1:])
    parser = argparse.ArgumentParser(prog="mcp-stream-exporter",
                                     description="Catch MCP tool results lost on resumable SSE streams.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="replay the incident on 127.0.0.1, naive and guarded, with the "
                               "embedded detector")
    demo.add_argument("--json", action="store_true", help="print the outcome of both runs as JSON")
    demo.add_argument("--serve", type=int, metavar="PORT", nargs="?", const=9464, default=None,
                      help="then keep /metrics, /api and the findings page /ui/ up on 127.0.0.1:PORT (default 9464)")
    demo.add_argument("--trace-url-template", metavar="URL",
                      help="the findings page links trace ids here, e.g. 'https://tempo/trace/{trace_id}'")
    commands.add_parser("serve", help="run the detector service (OTLP in, /metrics and /api out); serve --help")
    args = parser.parse_args(argv)
    if args.command == "demo":
        try:
            from mcp_stream_exporter import demo as demo_module
            from mcp_stream_exporter.detector.ui import UiLinks
        except ModuleNotFoundError as exc:
            return _missing_extra("demo", exc)

        return demo_module.main(as_json=args.json, serve_port=args.serve,
                                links=UiLinks(args.trace_url_template))
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())

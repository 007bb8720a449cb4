"""The call guard: a ``ServerMiddleware`` that refuses a ``tools/call`` whose token lacks what the tool requires.

The answer is JSON-RPC error ``wire.REFUSED_ERROR_CODE`` (-32003) naming the tool, what it requires and
what the token lacks, before any handler runs. Turn it on with one line:
``mcp.middleware.append(CallGuard(policy))``, before or after ``instrument_server`` (the hooks see the
refusal on the wire either way).
"""

from __future__ import annotations

from typing import Any

from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.shared.exceptions import MCPError
from mcp_types import JSONRPCError

from mcp_stream_exporter.auth import TokenReader, ToolPolicy, checked_policy
from mcp_stream_exporter.exchange import AUTHORIZATION
from mcp_stream_exporter.wire import REFUSED_ERROR_CODE, TOOLS_CALL

# what the data of a refusal of ``CallGuard``'s holds (``refused_call``)
_REFUSAL_DATA = frozenset({"tool", "required_resources", "missing_resources", "missing_scopes"})


class CallGuard:
    """Refuses a ``tools/call`` whose bearer token does not grant the tool's resource indicators and
    scopes under ``policy``. A tool the policy does not name, and every other method, pass. The token is
    read with ``token_reader`` (pass one with ``key=`` or ``jwks_url=`` to verify signatures: then only
    a verified token grants anything; a failed one never does)."""

    def __init__(self, policy: ToolPolicy, *, token_reader: TokenReader | None = None) -> None:
        self.policy = checked_policy(policy)
        self.tokens = token_reader or TokenReader()

    async def __call__(self, ctx: ServerRequestContext[Any, Any], call_next: CallNext) -> HandlerResult:
        if ctx.method != TOOLS_CALL:
            return await call_next(ctx)
        tool = (ctx.params or {}).get("name")
        tool = tool if isinstance(tool, str) else None
        requirement = self.policy.requirement(tool)
        if requirement is None:
            return await call_next(ctx)
        headers = getattr(ctx.request, "headers", None)
        view = self.tokens.from_authorization(headers.get(AUTHORIZATION) if headers is not None else None)
        trusted = view.verification == "verified" or (view.verification == "unverified" and not self.tokens.verifies)
        # a token whose signature failed (or went unchecked where keys are configured) grants nothing
        missing_resources, missing_scopes = (view.missing(requirement) if trusted
                                             else (requirement.resources, requirement.scopes))
        if missing_resources or missing_scopes:
            raise MCPError(
                code=REFUSED_ERROR_CODE,
                message=f"token does not grant what tool {tool!r} requires: resource indicators "
                f"{sorted(missing_resources)}, scopes {sorted(missing_scopes)}",
                data={"tool": tool, "required_resources": sorted(requirement.resources),
                      "missing_resources": sorted(missing_resources), "missing_scopes": sorted(missing_scopes)},
            )
        return await call_next(ctx)


def refused_call(message: object) -> bool:
    """Whether ``message`` is a ``CallGuard``'s refusal of a call, which it answers before any handler runs."""
    return (isinstance(message, JSONRPCError) and message.error.code == REFUSED_ERROR_CODE
            and isinstance(message.error.data, dict) and message.error.data.keys() >= _REFUSAL_DATA)

"""Leg 3 on the client: what to do with pending calls when a resume is refused or the token changed.

The decision boundary of docs/incident.md ("What a client should do"): resume only with a token whose
``aud`` covers every pending call's requirement; otherwise re-authorise for a superset audience, or,
when the authorization server will not mint one, abandon the stream and re-issue the calls.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from mcp_stream_exporter.auth import NO_REQUIREMENT, AuthView, Requirement


class Action(enum.Enum):
    RESUME = "resume"  # the token held covers every requirement: resume from the cursor
    REAUTHORIZE = "reauthorize"  # get a token whose aud covers `audience`, then resume from the cursor
    REISSUE = "reissue"  # open a fresh stream and re-issue the calls (loses in-flight events)


@dataclass(frozen=True, slots=True)
class Refusal:
    """The data of a server's ``event: error`` frame for a refused resume (guard/)."""

    error: str
    cursor: str | None
    request_id: str | None
    event_id: str | None
    requirement: Requirement
    token_audience: frozenset[str]

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> Refusal:
        def strings(key: str) -> list[str]:
            value = data.get(key)
            return [str(v) for v in value] if isinstance(value, list) else []

        def optional(key: str) -> str | None:
            value = data.get(key)
            return None if value is None else str(value)

        return cls(str(data.get("error", "")), optional("cursor"), optional("request_id"), optional("event_id"),
                   Requirement.of(strings("required_resources"), strings("required_scopes")),
                   frozenset(strings("token_audience")))


@dataclass(frozen=True, slots=True)
class ResumeDecision:
    action: Action
    requirement: Requirement  # what a token must grant to resume
    missing_resources: frozenset[str]
    missing_scopes: frozenset[str]
    cursor: str | None
    reason: str


def decide_resume(requirements: Iterable[Requirement], held: AuthView, *, cursor: str | None,
                  can_widen: bool) -> ResumeDecision:
    """Resume, re-authorise with a superset audience, or re-issue: for the calls pending on one stream.

    ``requirements``: each pending call's (or each buffered event's) requirement; ``held``: the token
    the client would resume with; ``can_widen``: whether the authorization server will mint a token
    covering all of them (a least-privilege server may not)."""
    need = NO_REQUIREMENT
    for requirement in requirements:
        need = need | requirement
    missing_resources, missing_scopes = held.missing(need)
    if cursor is None:
        return ResumeDecision(Action.REISSUE, need, missing_resources, missing_scopes, None,
                              "no cursor to resume from (unknown or evicted): re-issue the calls")
    if not missing_resources and not missing_scopes:
        return ResumeDecision(Action.RESUME, need, missing_resources, missing_scopes, cursor,
                              "the token covers every pending requirement")
    if can_widen:
        return ResumeDecision(Action.REAUTHORIZE, need, missing_resources, missing_scopes, cursor,
                              f"re-authorise for aud {sorted(need.resources)} then resume from {cursor}")
    return ResumeDecision(Action.REISSUE, need, missing_resources, missing_scopes, cursor,
                          "no token covering every pending call can be had: re-issue them on a fresh stream")

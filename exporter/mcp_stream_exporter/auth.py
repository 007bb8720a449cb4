"""What a bearer token grants, without ever keeping the token: ``AuthView`` and ``ToolPolicy``.

The invariant this project watches compares two sets: the resource indicators (RFC 8707) and scopes a
token grants, and the ones a tool call needs. ``AuthView`` is the first set, read from a JWT (verified
when keys are configured, read unverified for observation otherwise); ``ToolPolicy`` gives the second.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import re
import time
import tomllib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import jwt

Verification = Literal["verified", "unverified", "failed", "opaque", "absent"]

_DEFAULT_PORTS = {"http": 80, "https": 443}
_FINGERPRINT_CHARS = 16
_RECHECK_FAILED_S = 5.0  # a token that failed verification is verified again after this long; a failed JWKS fetch too
_JWKS_TIMEOUT_S = 5.0  # a JWKS fetch blocks the event loop: PyJWT's default 30 s is too long to stall a server
# what no resource URI holds (RFC 3986: printable ASCII; RFC 8707: no fragment), which urlsplit would drop or fold
_NO_RESOURCE = re.compile(r"[^!-~]|#")
_PROCESS_SALT = os.environ.get("MCP_STREAM_SUBJECT_SALT", "").encode() or os.urandom(16)


def canonical_resource(uri: str) -> str:
    """Canonical form of a resource URI, so that equal resources compare equal.

    Lower-cases scheme and host, drops a default port and one trailing slash of the path
    (``https://a.example/`` and ``https://a.example`` name the same resource; authorization
    servers and clients disagree on that slash, e.g. modelcontextprotocol/python-sdk#1265). Only one slash goes:
    ``rstrip('/')`` would make ``/tools//`` equal ``/tools``. What is no resource is kept as written, equal only
    to itself: a URI with an invalid port (``:99999``, ``:abc``), and one with a fragment (RFC 8707 forbids it), a
    space, a control character or any character but printable ASCII, which ``urlsplit`` would drop or fold (a
    carriage return in the scheme, a Kelvin sign in the host): a token may not be granted a resource its
    authorization server never wrote.
    """
    if _NO_RESOURCE.search(uri):
        return uri
    try:  # an invalid IPv6 literal (``http://[::1``) or port (``:99999``, ``:abc``) makes urlsplit raise
        parts = urlsplit(uri)
        host = (parts.hostname or "").lower()
        port = parts.port
    except ValueError:
        return uri
    scheme = parts.scheme.lower()
    if not scheme or not parts.netloc:
        return uri
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    netloc = host if port is None or _DEFAULT_PORTS.get(scheme) == port else f"{host}:{port}"
    if parts.username is not None:
        userinfo = parts.username + (f":{parts.password}" if parts.password is not None else "")
        netloc = f"{userinfo}@{netloc}"
    path = parts.path[:-1] if parts.path.endswith("/") else parts.path
    return urlunsplit((scheme, netloc, path, parts.query, ""))


def _not_a_resource(uri: str) -> str | None:
    """Why ``uri`` is no resource indicator (RFC 8707: an absolute URI, no fragment); None when it is one."""
    if _NO_RESOURCE.search(uri):
        return "it holds a space, a control character, a character but printable ASCII, or a fragment ('#')"
    try:
        parts = urlsplit(uri)
        parts.port  # noqa: B018  # raises for an invalid one
    except ValueError:
        return "its port (or IPv6 host) is invalid"
    if not parts.scheme:
        return "it has no scheme (https://..., api://..., urn:...)"
    return None


def canonical_resources(uris: Iterable[str]) -> frozenset[str]:
    return frozenset(canonical_resource(u) for u in uris if u)


def token_fingerprint(token: str) -> str:
    """A short, stable, irreversible id for a token: the same on every process and side."""
    return hashlib.sha256(token.encode()).hexdigest()[:_FINGERPRINT_CHARS]


NOTHING_MISSING: tuple[frozenset[str], frozenset[str]] = (frozenset(), frozenset())  # resources, scopes


@dataclass(frozen=True, slots=True)
class AuthView:
    """The part of a bearer token this project may record: sets, hashes and how it was read."""

    audience: frozenset[str] = frozenset()
    scopes: frozenset[str] = frozenset()
    subject_hash: str | None = None
    fingerprint: str | None = None
    verification: Verification = "absent"
    # until when the view holds: the token's ``exp``; for one that failed verification, seconds (``_RECHECK_FAILED_S``)
    expires_at: float | None = None

    def missing_resources(self, required: Iterable[str]) -> frozenset[str]:
        """The required resource indicators this token's ``aud`` does not grant (canonical form)."""
        return canonical_resources(required) - self.audience

    def missing(self, requirement: Requirement) -> tuple[frozenset[str], frozenset[str]]:
        """The resources and scopes ``requirement`` needs that this token lacks (already canonical)."""
        if requirement.resources <= self.audience and requirement.scopes <= self.scopes:
            return NOTHING_MISSING  # the usual, asked on every call: no sets built
        return requirement.resources - self.audience, requirement.scopes - self.scopes

    def grants(self, requirement: Requirement) -> bool:
        resources, scopes = self.missing(requirement)
        return not resources and not scopes


ABSENT = AuthView()


def _expiry(exp: Any) -> float | None:
    """A token's ``exp`` as a time, read as PyJWT reads it when it verifies one (``int(exp)``: a number, or a string
    of digits); None for none, or for one no float holds (``10**400``: read by anyone's forged token before any
    signature is checked, it may not raise). One of any other form is past already: its view is never served from a
    cache, and is read again, as PyJWT takes it, every time (a view cached without an expiry outlived the token)."""
    if exp is None:
        return None
    try:
        return float(int(exp))  # a fraction too: PyJWT compares its integer part
    except OverflowError:
        return None
    except (TypeError, ValueError):
        return 0.0


def _as_set(value: Any, *, split: bool) -> frozenset[str]:
    if isinstance(value, str):
        return frozenset(value.split()) if split else frozenset({value})
    if isinstance(value, list | tuple):
        return frozenset(str(v) for v in value)
    return frozenset()


@dataclass(slots=True)
class TokenReader:
    """Turns a bearer token into an ``AuthView``; verifies signatures when a key or JWKS URL is set.

    Without a key the claims are read unverified and the view says ``unverified``: good enough to
    observe an audience gap, never to grant access. ``issuers``: when set, a token verifies only if its
    ``iss`` is one of them (set it wherever one key or JWKS signs for more than one issuer or tenant).
    ``subject_salt`` keys the principal hash (``AuthView.subject_hash``) so that a hash cannot be
    reversed by hashing candidate user names; by default it comes from ``MCP_STREAM_SUBJECT_SALT``, or
    is random per process (set it to correlate across processes).
    """

    key: Any = None
    jwks_url: str | None = None
    algorithms: tuple[str, ...] = ("RS256", "ES256", "PS256", "EdDSA", "HS256")
    issuers: tuple[str, ...] = ()
    subject_salt: bytes = _PROCESS_SALT
    cache_size: int = 1024
    clock: Callable[[], float] = time.time
    _cache: OrderedDict[str, AuthView] = field(default_factory=OrderedDict, init=False, repr=False)
    # Authorization header -> its view: the same header comes on every request of a client, and this
    # spares each one the token's SHA-256. Private, bounded like ``_cache`` (least recently used out first);
    # never logged or exported.
    _by_header: OrderedDict[str, AuthView] = field(default_factory=OrderedDict, init=False, repr=False)
    # The last header read and its view: a client sends one header on every request, and comparing it
    # spares hashing a fresh copy of the whole token (hundreds of bytes) on each. Private like ``_by_header``.
    _last: tuple[str, AuthView] | None = field(default=None, init=False, repr=False)
    _jwks: _JWKS | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.jwks_url:
            self._jwks = _JWKS(self.jwks_url, self.clock)  # not the reader: no cycle keeps its fetch thread

    @property
    def verifies(self) -> bool:
        return self.key is not None or self._jwks is not None

    def from_authorization(self, header: str | None) -> AuthView:
        """The view of an ``Authorization`` header value; ``absent`` when there is no bearer."""
        if not header:
            return ABSENT
        last = self._last
        if last is not None and last[0] == header:
            cached: AuthView | None = last[1]
        else:
            cached = self._by_header.get(header)
            if cached is not None:
                self._by_header.move_to_end(header)
                self._last = (header, cached)
        if cached is not None and (cached.expires_at is None or cached.expires_at > self.clock()):
            return cached
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return ABSENT
        view = self.read(token.strip())
        self._by_header[header] = view
        self._last = (header, view)
        if len(self._by_header) > self.cache_size:
            self._by_header.popitem(last=False)
        return view

    def read(self, token: str) -> AuthView:
        fingerprint = token_fingerprint(token)
        cached = self._cache.get(fingerprint)
        if cached is not None and (cached.expires_at is None or cached.expires_at > self.clock()):
            self._cache.move_to_end(fingerprint)
            return cached
        view = self._read(token, fingerprint)
        self._cache[fingerprint] = view
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return view

    def _read(self, token: str, fingerprint: str) -> AuthView:
        if token.count(".") != 2:
            return AuthView(fingerprint=fingerprint, verification="opaque")
        # anyone's token is read here, before any signature is checked: claims that cannot be read (JSON nested past
        # the recursion limit, among others) make a token whose audience is unknown, never an error page
        try:
            claims = jwt.decode(token, options={"verify_signature": False})
            audience = canonical_resources(_as_set(claims.get("aud"), split=False))
            subject_hash = self._hash_principal(claims)
        except (jwt.InvalidTokenError, RecursionError, ValueError, TypeError):
            return AuthView(fingerprint=fingerprint, verification="opaque")
        verification: Verification = "unverified"
        expires_at = _expiry(claims.get("exp"))
        if self.verifies:
            verification = "verified" if self._verify(token) else "failed"
            if verification == "failed":  # checked again soon: a JWKS fetch that failed once, an issuer's clock ahead
                expires_at = min(expires_at or math.inf, self.clock() + _RECHECK_FAILED_S)
        return AuthView(
            audience=audience,
            scopes=_as_set(claims.get("scope"), split=True) | _as_set(claims.get("scp"), split=True),
            subject_hash=subject_hash,
            fingerprint=fingerprint,
            verification=verification,
            expires_at=expires_at,
        )

    def _verify(self, token: str) -> bool:
        """Whether the token's signature, times and issuer hold. Fails closed: whatever goes wrong (pyjwt raises
        TypeError, not PyJWTError, for a token whose header names an algorithm of another key type) is a
        token that did not verify."""
        try:
            key = self._jwks.get_signing_key_from_jwt(token).key if self._jwks else self.key
            claims = jwt.decode(token, key, algorithms=list(self.algorithms), options={"verify_aud": False})
        except Exception:  # any failure to verify is a refusal, never an error page
            return False
        return not self.issuers or claims.get("iss") in self.issuers

    def _hash_principal(self, claims: Mapping[str, Any]) -> str | None:
        """Who the token speaks for, hashed: its issuer, subject and client (``client_id``, else ``azp``), as
        the SDK binds a session to them; None when it names neither subject nor client. A client-credentials
        token has no subject, and a user's token from another client app is another principal. A claim of
        another type than a string counts as it is, never as absent."""
        subject, client = claims.get("sub"), claims.get("client_id", claims.get("azp"))
        if subject is None and client is None:
            return None
        # as the claims are, whatever their type (a numeric client_id is a client too): two values differ here
        # exactly when their JSON differs
        principal = json.dumps([claims.get("iss"), subject, client], sort_keys=True, default=repr)
        return hmac.new(self.subject_salt, principal.encode(), hashlib.sha256).hexdigest()[:_FINGERPRINT_CHARS]


class _JWKS(jwt.PyJWKClient):
    """The issuer's keys, fetched as PyJWT does, but waited for ``_JWKS_TIMEOUT_S`` at most (PyJWT's timeout bounds
    each read, and an endpoint that drips its answer holds a fetch as long as it likes), and once a fetch failed not
    tried again for a few seconds: a fetch blocks whoever reads a token (the guard's and the hooks' ASGI layers, on
    the event loop), and while it fails every token not verified yet would try it again, each every
    ``_RECHECK_FAILED_S``."""

    def __init__(self, uri: str, clock: Callable[[], float]) -> None:
        super().__init__(uri, cache_keys=True, timeout=_JWKS_TIMEOUT_S)
        self._clock = clock
        self._failing_until = 0.0
        # one fetch at a time, an endpoint's own: a slow one holds up no other issuer's (its thread made at first use)
        self._fetches = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mcp-stream-jwks")

    def fetch_data(self) -> Any:
        if self._clock() < self._failing_until:
            raise jwt.PyJWKClientConnectionError("the JWKS endpoint failed a moment ago: not tried again yet")
        try:  # on a thread of its own, so that the wait is bounded whatever the endpoint does (the fetch runs on)
            return self._fetches.submit(super().fetch_data).result(timeout=_JWKS_TIMEOUT_S)
        except Exception:  # unreachable, too slow, or no key set in its answer (a proxy's error page, ``{}``)
            self._failing_until = self._clock() + _RECHECK_FAILED_S
            raise


@dataclass(frozen=True, slots=True)
class Requirement:
    """What one tool call needs from the token: resource indicators (canonical) and scopes."""

    resources: frozenset[str] = frozenset()
    scopes: frozenset[str] = frozenset()

    @classmethod
    def of(cls, resources: Iterable[str] = (), scopes: Iterable[str] = ()) -> Requirement:
        return cls(canonical_resources(resources), frozenset(scopes))

    def __or__(self, other: Requirement) -> Requirement:
        return Requirement(self.resources | other.resources, self.scopes | other.scopes)


NO_REQUIREMENT = Requirement()


class ToolPolicy:
    """Tool name -> the resource indicators and scopes a ``tools/call`` of it requires.

    Per-tool resource indicators are not in any MCP version; this is the project's model of the
    deployments that use them (docs/incident.md).
    """

    def __init__(self, tools: Mapping[str, Requirement] | None = None) -> None:
        self._tools: dict[str, Requirement] = dict(tools or {})
        # tool -> the last token view asked about it, its requirement and what the view lacks: one entry per named tool
        self._gaps: dict[str | None, tuple[AuthView, Requirement, tuple[frozenset[str], frozenset[str]]]] = {}

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> ToolPolicy:
        """``{"tools": {"fetch": {"resources": [...], "scopes": [...]}}}``; a bare tool map works too."""
        tools = data.get("tools", data)
        if not isinstance(tools, Mapping):
            raise ValueError("tool policy: 'tools' must be a mapping of tool name to requirement")
        out: dict[str, Requirement] = {}
        for name, spec in tools.items():
            if isinstance(spec, str | list):
                resources, scopes = _as_set(spec, split=False), frozenset[str]()
            elif isinstance(spec, Mapping):
                resources = _as_set(spec.get("resources", spec.get("resource", [])), split=False)
                scopes = _as_set(spec.get("scopes", []), split=True)
            else:
                raise ValueError(f"tool policy: requirement of {name!r} must be a mapping or a list")
            # an operator's, as written: spaces around it taken off, an empty one dropped (as ``canonical_resources``)
            resources = frozenset(stripped for resource in resources if (stripped := resource.strip()))
            for resource in resources:  # else no token would ever be granted it, and every call of the tool refused
                problem = _not_a_resource(resource)
                if problem is not None:
                    raise ValueError(f"tool policy: resource {resource!a} of {name!r} is no resource indicator: "
                                     f"{problem} (RFC 8707: an absolute URI of printable ASCII, with no fragment)")
            out[str(name)] = Requirement.of(resources, scopes)
        return cls(out)

    @classmethod
    def from_file(cls, path: str | Path) -> ToolPolicy:
        """Load a policy from a ``.json`` or ``.toml`` file."""
        p = Path(path)
        text = p.read_text(encoding="utf-8")
        data = tomllib.loads(text) if p.suffix == ".toml" else json.loads(text)
        if not isinstance(data, Mapping):
            raise ValueError(f"tool policy {p}: top level must be a mapping")
        return cls.from_mapping(data)

    @property
    def tools(self) -> frozenset[str]:
        return frozenset(self._tools)

    def requirement(self, tool: str | None) -> Requirement | None:
        """The tool's requirement, or None when the policy does not name it."""
        return self._tools.get(tool) if tool is not None else None

    def gap(self, tool: str | None, view: AuthView) -> tuple[Requirement | None, tuple[frozenset[str], frozenset[str]]]:
        """The tool's requirement and what ``view`` lacks of it (``AuthView.missing``; nothing for a tool
        the policy does not name). Remembered per tool for the last view asked: a client calls with the
        same token (the same view, cached by its header) on every request."""
        last = self._gaps.get(tool)  # (view, requirement, missing) of a tool the policy names; None never is one
        if last is not None and last[0] is view:
            return last[1], last[2]
        requirement = self._tools.get(tool) if tool is not None else None
        if requirement is None or tool is None:
            return None, NOTHING_MISSING
        missing = view.missing(requirement)
        self._gaps[tool] = (view, requirement, missing)
        return requirement, missing


def checked_policy(policy: object) -> ToolPolicy:
    """``policy``, refused at once unless it is a ``ToolPolicy``: a path or a mapping taken for one would fail every
    reading of it later, where nothing says why (the hooks would leave every exchange unobserved)."""
    if not isinstance(policy, ToolPolicy):
        raise TypeError(f"policy must be a ToolPolicy (ToolPolicy.from_file(path) or ToolPolicy.from_mapping(data)), "
                        f"not {type(policy).__name__}")
    return policy

"""AuthView, resource canonicalisation, token verification and ToolPolicy loading."""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import jwt
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mcp_stream_exporter import auth
from mcp_stream_exporter.auth import (
    AuthView,
    Requirement,
    TokenReader,
    ToolPolicy,
    canonical_resource,
    canonical_resources,
    token_fingerprint,
)
from mcp_stream_exporter.lab import TokenIssuer


@contextlib.contextmanager
def _jwks_served(answer: Callable[[http.server.BaseHTTPRequestHandler], None]) -> Iterator[str]:
    """A JWKS endpoint on loopback that answers each GET with ``answer``: its URL."""

    class Endpoint(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            answer(self)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Endpoint)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/jwks"
    finally:
        httpd.shutdown()


def _json(handler: http.server.BaseHTTPRequestHandler, body: bytes, status: int = 200, *, pieces: int = 1) -> None:
    """Answer ``body``, in ``pieces`` 0.3 s apart (an endpoint that drips its answer)."""
    handler.send_response(status)
    handler.send_header("content-type", "application/json")
    handler.send_header("content-length", str(len(body)))
    handler.end_headers()
    size = len(body) // pieces + 1
    for i in range(0, len(body), size):
        if i:
            time.sleep(0.3)
        handler.wfile.write(body[i:i + size])
        handler.wfile.flush()



@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("HTTPS://MCP.Example.COM/tools/fetch", "https://mcp.example.com/tools/fetch"),
        ("https://mcp.example.com:443/tools/fetch", "https://mcp.example.com/tools/fetch"),
        ("http://mcp.example.com:80/", "http://mcp.example.com"),
        ("https://mcp.example.com/", "https://mcp.example.com"),
        ("https://mcp.example.com/tools/fetch/", "https://mcp.example.com/tools/fetch"),
        ("https://mcp.example.com:8443/x", "https://mcp.example.com:8443/x"),
        ("https://mcp.example.com/Tools", "https://mcp.example.com/Tools"),  # paths keep their case
        ("https://[::1]:443/mcp", "https://[::1]/mcp"),
        ("https://mcp.example.com:99999/tools/fetch", "https://mcp.example.com:99999/tools/fetch"),  # no port
        ("https://mcp.example.com:abc/tools/fetch", "https://mcp.example.com:abc/tools/fetch"),
    ],
)
def test_canonical_resource_normalises_case_default_ports_and_one_trailing_slash(raw, canonical):
    assert canonical_resource(raw) == canonical


@pytest.mark.parametrize("raw", [
    "https://mcp.example.com/tools/fetch#x", "ht\rtps://mcp.example.com/tools/fetch",
    "https://mcp.exa\nmple.com/tools/fetch", "https://mcp.example.com/tools/\tfetch",
    "\x01https://mcp.example.com/tools/fetch", " https://mcp.example.com/tools/fetch",
    "https://mcp.example.com/tools/fetch ", "https://mcp.example.com/tools/fetch\x7f",
])
def test_a_value_no_resource_uri_holds_is_equal_only_to_itself_never_to_the_resource_it_resembles(raw):
    """urlsplit drops tabs and line breaks anywhere and control characters in front; RFC 8707 forbids fragments."""
    assert canonical_resource(raw) == raw
    assert not AuthView(audience=canonical_resources([raw])).grants(
        Requirement(canonical_resources(["https://mcp.example.com/tools/fetch"])))


def test_a_host_with_a_character_that_lower_cases_to_ascii_is_no_resource_and_a_policy_with_one_is_refused():
    """The Kelvin sign (U+212A) lower-cases to ``k``: its host read as another resource's. A policy resource that is
    no resource URI would never be granted, every call of its tool refused: refused as the policy loads, saying why."""
    assert canonical_resource("https://\u212aey.example/tools") != canonical_resource("https://key.example/tools")
    for resource, problem in (("https://\u212aey.example/tools", "printable ASCII"), ("https://a.example/t#x", "'#'"),
                              ("mcp.example.com/tools/fetch", "no scheme"), ("https://a.example:99999/t", "port")):
        with pytest.raises(ValueError, match="is no resource indicator: .*" + re.escape(problem)) as refused:
            ToolPolicy.from_mapping({"tools": {"fetch": {"resources": [resource]}}})
        assert resource.encode("ascii", "backslashreplace").decode() in str(refused.value)  # shown as it is
    # an operator's spaces around it, as written before: taken off; an empty one dropped; any absolute URI taken
    loaded = ToolPolicy.from_mapping({"tools": {"fetch": {"resource": " https://mcp.example.com/tools/fetch\n"},
                                                "search": {"resource": "", "scopes": "read"},
                                                "other": ["api://0f9c", "urn:example:mcp", "HTTPS://[::1]:8443/mcp"]}})
    assert loaded.requirement("fetch") == Requirement.of(["https://mcp.example.com/tools/fetch"])
    assert loaded.requirement("search") == Requirement.of([], ["read"])
    assert loaded.requirement("other") == Requirement.of(["api://0f9c", "urn:example:mcp", "https://[::1]:8443/mcp"])


def test_canonical_resource_removes_only_one_trailing_slash():
    assert canonical_resource("https://a.example/tools//") == "https://a.example/tools/"
    assert canonical_resource("https://a.example/tools//") != canonical_resource("https://a.example/tools")


@given(st.sampled_from(["http", "https", "HTTPS"]), st.from_regex(r"[a-z]{1,8}\.example", fullmatch=True),
       st.lists(st.from_regex(r"[a-z0-9]{1,5}", fullmatch=True), max_size=3))
def test_canonical_resource_is_idempotent(scheme, host, segments):
    uri = f"{scheme}://{host}/" + "/".join(segments)
    once = canonical_resource(uri)
    assert canonical_resource(once) == once


def _unsigned(claims: dict) -> str:
    return jwt.encode(claims, "k" * 32, algorithm="HS256")


def test_audience_string_or_list_and_scope_or_scp_give_sets():
    reader = TokenReader()
    a = reader.read(_unsigned({"aud": "https://A.example/x/", "scope": "read write", "sub": "alice"}))
    b = reader.read(_unsigned({"aud": ["https://a.example/x", "https://b.example"], "scp": ["read"]}))
    assert a.audience == {"https://a.example/x"}
    assert a.scopes == {"read", "write"}
    assert b.audience == {"https://a.example/x", "https://b.example"}
    assert b.scopes == {"read"}
    assert a.verification == "unverified"
    assert a.subject_hash is not None and "alice" not in a.subject_hash
    assert a.missing_resources(["https://a.example/x", "https://b.example/"]) == {"https://b.example"}
    assert b.grants(Requirement.of(["https://b.example/"], ["read"]))
    assert not b.grants(Requirement.of(["https://b.example"], ["write"]))


def test_opaque_and_absent_tokens_give_a_fingerprint_only():
    reader = TokenReader()
    opaque = reader.read("opaque-token-value")
    assert opaque.verification == "opaque"
    assert opaque.fingerprint == token_fingerprint("opaque-token-value")
    assert opaque.audience == frozenset()
    assert reader.from_authorization(None).verification == "absent"
    assert reader.from_authorization("Basic dXNlcjpwdw==").verification == "absent"
    assert reader.from_authorization("Bearer opaque-token-value") == opaque


def test_the_view_cached_by_header_follows_the_header_and_the_tokens_expiry_and_is_bounded():
    now = [1_000.0]
    reader = TokenReader(cache_size=2, clock=lambda: now[0])
    a = _unsigned({"aud": "https://a.example", "exp": 1_060})
    b = _unsigned({"aud": "https://b.example"})
    first = reader.from_authorization(f"Bearer {a}")
    assert reader.from_authorization(f"Bearer {a}") is first  # the same header: its view, not a new read
    assert reader.from_authorization(f"Bearer {b}").audience == {"https://b.example"}  # another: its own
    assert reader.from_authorization(f"Bearer  {a}") == first  # another spelling of the same token
    assert reader.from_authorization("Basic dXNlcjpwdw==").verification == "absent"
    now[0] = 1_061.0  # expired: read again, never served from the cache
    assert reader.from_authorization(f"Bearer {a}") is not first
    for i in range(5):
        reader.from_authorization(f"Bearer {_unsigned({'n': i})}")
    assert len(reader._by_header) == 2  # bounded by cache_size
    assert a not in repr(reader)  # the raw header is a private key, never shown


def test_subject_hash_depends_on_the_salt():
    token = _unsigned({"sub": "alice"})
    assert TokenReader(subject_salt=b"one").read(token).subject_hash != \
        TokenReader(subject_salt=b"two").read(token).subject_hash


def test_the_principal_is_the_issuer_subject_and_client_as_the_sdk_binds_a_session():
    reader = TokenReader(subject_salt=b"s")

    def principal(**claims: str) -> str | None:
        return reader.read(_unsigned({"iss": "https://as.example", **claims})).subject_hash

    alice = principal(sub="alice", client_id="app")
    assert alice is not None and alice == principal(sub="alice", client_id="app", aud="https://other.example")
    assert alice != principal(sub="alice", client_id="evil")  # a user's token from another client app
    assert alice != reader.read(_unsigned({"iss": "https://evil.example", "sub": "alice",
                                           "client_id": "app"})).subject_hash
    assert principal(client_id="svc-a") not in (None, principal(client_id="svc-b"))  # client credentials: no sub
    assert principal(azp="app", sub="alice") == alice
    assert principal() is None  # names nobody
    numeric = reader.read(_unsigned({"iss": "https://as.example", "client_id": 111})).subject_hash
    assert numeric is not None and numeric != reader.read(_unsigned({"client_id": 222})).subject_hash
    assert reader.read(_unsigned({"sub": 1001})).subject_hash != reader.read(_unsigned({"sub": 2002})).subject_hash


def test_a_token_whose_header_names_another_key_type_fails_verification_instead_of_raising():
    issuer = TokenIssuer()
    reader = TokenReader(key=issuer.public_key)
    for alg, key in (("HS256", "a-shared-secret-long-enough-for-hmac-256"), ("none", None)):
        token = jwt.encode({"sub": "alice", "aud": ["https://a.example"]}, key, algorithm=alg)
        assert reader.read(token).verification == "failed"


def test_a_verifying_reader_with_issuers_takes_only_their_tokens():
    key = "one-key-that-signs-for-two-tenants-0123456789"
    reader = TokenReader(key=key, issuers=("https://as.example",))
    for claims, verification in (({"iss": "https://as.example"}, "verified"),
                                 ({"iss": "https://evil.example"}, "failed"), ({}, "failed")):
        token = jwt.encode({**claims, "sub": "alice", "aud": ["https://a.example"]}, key, algorithm="HS256")
        assert reader.read(token).verification == verification


def test_signature_verified_with_a_key_and_failed_with_the_wrong_one():
    issuer, other = TokenIssuer(), TokenIssuer()
    token = issuer.mint(["https://a.example"])
    assert TokenReader(key=issuer.public_key).read(token).verification == "verified"
    assert TokenReader(key=other.public_key).read(token).verification == "failed"


def test_expired_token_fails_verification_but_keeps_its_claims_for_observation():
    issuer = TokenIssuer()
    token = issuer.mint(["https://a.example"], ttl=-60)
    view = TokenReader(key=issuer.public_key).read(token)
    assert view.verification == "failed"
    assert view.audience == {"https://a.example"}


def test_signature_verified_against_a_jwks_url_on_loopback():
    issuer, other = TokenIssuer(), TokenIssuer(kid="lab-1")
    body = json.dumps(issuer.jwks()).encode()
    with _jwks_served(lambda handler: _json(handler, body)) as url:
        reader = TokenReader(jwks_url=url)
        assert reader.read(issuer.mint(["https://a.example"])).verification == "verified"
        assert reader.read(other.mint(["https://a.example"])).verification == "failed"


def test_tool_policy_from_mapping_json_and_toml(tmp_path):
    data = {"tools": {"fetch": {"resources": ["https://MCP.example.com/tools/fetch/"], "scopes": "read"},
                      "search": ["https://mcp.example.com/tools/search"]}}
    from_json = tmp_path / "policy.json"
    from_json.write_text(json.dumps(data))
    from_toml = tmp_path / "policy.toml"
    from_toml.write_text('[tools.fetch]\nresources = ["https://MCP.example.com/tools/fetch/"]\nscopes = ["read"]\n'
                         '[tools.search]\nresources = ["https://mcp.example.com/tools/search"]\n')
    for policy in (ToolPolicy.from_mapping(data), ToolPolicy.from_file(from_json), ToolPolicy.from_file(from_toml)):
        assert policy.tools == {"fetch", "search"}
        assert policy.requirement("fetch") == Requirement.of(["https://mcp.example.com/tools/fetch"], ["read"])
        assert policy.requirement("search") == Requirement.of(["https://mcp.example.com/tools/search"])
        assert policy.requirement("other") is None


def test_a_tools_gap_follows_the_view_asked_about_and_only_named_tools_are_remembered():
    """``ToolPolicy.gap`` remembers what the last view asked about a tool lacks: a different view (a
    refreshed, narrower token) is asked again, and a tool the policy does not name is never remembered."""
    fetch = Requirement.of(["https://mcp.example.com/tools/fetch"], ["read"])
    policy = ToolPolicy({"fetch": fetch})
    reader = TokenReader()
    issuer = TokenIssuer()
    broad = reader.read(issuer.mint(["https://mcp.example.com/tools/fetch"], scopes=["read"]))
    narrow = reader.read(issuer.mint(["https://mcp.example.com/tools/search"], scopes=["read"]))
    for _ in range(2):
        assert policy.gap("fetch", broad) == (fetch, (frozenset(), frozenset()))
        assert policy.gap("fetch", narrow) == (fetch, (frozenset({"https://mcp.example.com/tools/fetch"}),
                                                       frozenset()))
    assert policy.gap("fetch", broad) == (fetch, broad.missing(fetch))
    for i in range(100):
        assert policy.gap(f"unnamed-{i}", broad) == (None, (frozenset(), frozenset()))
    assert policy.gap(None, broad) == (None, (frozenset(), frozenset()))
    assert set(policy._gaps) == {"fetch"}


def test_tool_policy_rejects_a_malformed_file(tmp_path):
    bad = tmp_path / "policy.json"
    bad.write_text(json.dumps({"tools": {"fetch": 3}}))
    with pytest.raises(ValueError, match="fetch"):
        ToolPolicy.from_file(bad)


def _forged(payload: bytes) -> str:
    import base64

    def b64(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()

    header = b64(b'{"alg":"HS256","typ":"JWT"}')
    return f"{header}.{b64(payload)}.{b64(b'sig')}"


@pytest.mark.parametrize("payload", [
    b'{"sub":"x","exp":1' + b"0" * 400 + b"}",  # no float holds it
    b'{"sub":"x","aud":["http://[::1"]}',  # urlsplit raises on it
    b'{"sub":"x","aud":"https://a.example:99999"}',
    b'{"sub":' + b"[" * 5000 + b"]" * 5000 + b"}",  # past the JSON decoder's recursion limit
    b'{"exp":NaN,"sub":"x"}', b'{"exp":true}', b'{"aud":{"a":1},"scope":["x"],"sub":{"a":[1]}}', b"[1,2]", b'"s"',
])
def test_any_claims_anyone_can_forge_make_a_view_never_an_error(payload):
    """Every request's token is read before any signature is checked: a claim the reader cannot take made the
    guard's and the hooks' ASGI layers answer 500 to anyone."""
    view = TokenReader().read(_forged(payload))
    assert view.verification in ("unverified", "opaque")


def test_a_failed_verification_is_checked_again_seconds_later_not_held_for_the_tokens_lifetime():
    """A JWKS fetch that failed once (or an issuer's clock a second ahead) failed the token; cached until its ``exp``,
    every resume with it was then refused ``token_unverified`` for up to an hour."""
    issuer = TokenIssuer()
    body = json.dumps(issuer.jwks()).encode()
    statuses = [503]
    with _jwks_served(lambda handler: _json(handler, body, statuses.pop(0) if statuses else 200)) as url:
        now = [1_000.0]
        reader = TokenReader(jwks_url=url, clock=lambda: now[0])
        header = f"Bearer {issuer.mint(['https://a.example'], ttl=3600)}"
        failed = reader.from_authorization(header)
        assert failed.verification == "failed"
        assert reader.from_authorization(header) is failed  # a flood of it costs no verification each
        now[0] += 6.0
        assert reader.from_authorization(header).verification == "verified"


def test_a_failing_jwks_endpoint_is_tried_again_only_seconds_later_whatever_the_tokens_that_need_it():
    """A JWKS fetch blocks the event loop the guard and the hooks read tokens on: while the endpoint failed, every
    token not verified yet (rechecked each 5 s, and any new one) fetched again, each a stall of up to 30 s."""
    issuer = TokenIssuer()
    fetches: list[str] = []

    def failing(handler: http.server.BaseHTTPRequestHandler) -> None:
        fetches.append(handler.path)
        _json(handler, b"{}", 503)

    with _jwks_served(failing) as url:
        now = [1_000.0]
        reader = TokenReader(jwks_url=url, clock=lambda: now[0])
        views = [reader.read(issuer.mint(["https://a.example"], ttl=3600 + n)) for n in range(10)]
        assert {view.verification for view in views} == {"failed"} and len(fetches) == 1
        now[0] += 6.0
        assert reader.read(issuer.mint(["https://a.example"], ttl=7200)).verification == "failed"
        assert len(fetches) == 2


def test_a_jwks_endpoint_that_drips_its_answer_is_waited_for_no_longer_than_the_fetchs_bound(monkeypatch):
    """PyJWT's timeout bounds each read: an endpoint that sent its answer a piece at a time, each within it, held the
    event loop the guard and the hooks read tokens on for as long as it liked."""
    monkeypatch.setattr(auth, "_JWKS_TIMEOUT_S", 0.5)
    issuer = TokenIssuer()
    body = json.dumps(issuer.jwks()).encode()

    with _jwks_served(lambda handler: _json(handler, body, pieces=4)) as url:  # each piece within a read's timeout
        reader = TokenReader(jwks_url=url)
        assert reader.read(issuer.mint(["https://a.example"])).verification == "failed"  # given up on, not waited out


def test_a_verified_tokens_view_is_cached_no_longer_than_its_expiry_whatever_form_pyjwt_reads_it_in():
    """PyJWT verifies an ``exp`` of digits in a string as the number; a view cached without that expiry was served,
    ``verified``, long after the token had expired. An ``exp`` of no form PyJWT reads fails, held seconds only."""
    key = "a key of at least thirty-two bytes, for HS256"
    start = int(time.time())  # PyJWT checks ``exp`` against the real time
    now = [float(start)]
    reader = TokenReader(key=key, clock=lambda: now[0])
    expiring = jwt.encode({"aud": "https://a.example", "exp": str(start + 60)}, key, algorithm="HS256")
    odd = jwt.encode({"aud": "https://a.example", "exp": [str(start + 60)]}, key, algorithm="HS256")
    first = reader.read(expiring)
    assert first.verification == "verified" and first.expires_at == start + 60
    assert reader.read(expiring) is first
    unread = reader.read(odd)
    assert unread.verification == "failed" and unread.expires_at == start + 5
    now[0] = start + 61.0
    assert reader.read(expiring) is not first  # read again: PyJWT then says whether it still verifies
    assert reader.read(odd) is not unread
    fraction = jwt.encode({"aud": "https://a.example", "exp": start + 60.9}, key, algorithm="HS256")
    assert reader.read(fraction).expires_at == start + 60  # PyJWT compares the integer part

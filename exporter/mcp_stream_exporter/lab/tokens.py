"""Real RS256 access tokens for the incident, and a client ``httpx2.Auth`` whose token can change."""

from __future__ import annotations

import secrets
import time
import uuid
from collections.abc import Generator, Iterable
from typing import Any

import httpx2
import jwt
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from mcp.server.auth.provider import AccessToken

ISSUER = "https://auth.example.com"


class TokenIssuer:
    """Signs access tokens with a fresh RSA key; also verifies them for the MCP server (TokenVerifier)."""

    def __init__(self, issuer: str = ISSUER, kid: str = "lab-1") -> None:
        self.issuer = issuer
        self.kid = kid
        self._key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.public_key = self._key.public_key()
        self._opaque: dict[str, dict[str, Any]] = {}  # opaque token -> its claims, as introspection answers

    @property
    def public_pem(self) -> bytes:
        return self.public_key.public_bytes(serialization.Encoding.PEM,
                                            serialization.PublicFormat.SubjectPublicKeyInfo)

    def jwks(self) -> dict[str, Any]:
        jwk = jwt.algorithms.RSAAlgorithm.to_jwk(self.public_key, as_dict=True)
        jwk.update(kid=self.kid, use="sig", alg="RS256")
        return {"keys": [jwk]}

    def mint(self, audience: Iterable[str], *, subject: str = "alice", client_id: str = "lab-client",
             scopes: Iterable[str] = ("mcp",), ttl: float = 3600.0) -> str:
        now = int(time.time())
        claims = {"iss": self.issuer, "sub": subject, "aud": list(audience), "client_id": client_id,
                  "scope": " ".join(scopes), "iat": now, "exp": now + int(ttl), "jti": uuid.uuid4().hex}
        return jwt.encode(claims, self._key, algorithm="RS256", headers={"kid": self.kid})

    def opaque(self, audience: Iterable[str], *, subject: str = "alice", scopes: Iterable[str] = ("mcp",)) -> str:
        """An opaque (non-JWT) access token: only this issuer knows its claims, as token introspection
        (RFC 7662) would tell the server. Observers see no audience in it."""
        token = secrets.token_urlsafe(32)
        self._opaque[token] = {"iss": self.issuer, "sub": subject, "aud": list(audience), "client_id": "lab-client",
                               "scope": " ".join(scopes), "exp": int(time.time()) + 3600}
        return token

    async def verify_token(self, token: str) -> AccessToken | None:
        claims: dict[str, Any] | None = self._opaque.get(token)
        if claims is None:
            try:
                claims = jwt.decode(token, self.public_key, algorithms=["RS256"], options={"verify_aud": False},
                                    issuer=self.issuer)
            except jwt.PyJWTError:
                return None
        return AccessToken(token=token, client_id=str(claims.get("client_id", "")),
                           scopes=str(claims.get("scope", "")).split(), expires_at=claims.get("exp"),
                           subject=claims.get("sub"), claims=claims)


class BearerAuth(httpx2.Auth):
    """Sets ``Authorization: Bearer`` on every request, resume GETs included; ``token`` may change."""

    def __init__(self, token: str) -> None:
        self.token = token

    def auth_flow(self, request: httpx2.Request) -> Generator[httpx2.Request, httpx2.Response, None]:
        request.headers["Authorization"] = f"Bearer {self.token}"
        yield request

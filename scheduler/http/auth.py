"""Bearer tokens: which tenant a request speaks for.

A token names a tenant (``api.tokens`` in the YAML file); a request without one, or with one
that is not configured, answers 401. Tokens are held and compared as SHA-256 digests in constant
time and never logged.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from compactd.storage.errors import BadInput, ConfigError
from compactd.worker.settings import ApiConfig


class Tokens:
    """Bearer tokens and their tenants, held as SHA-256 digests.

    Hashing first makes every comparison one between two 32-byte values, so neither a token's
    length nor its prefix shows in the time an answer takes; every digest is compared, so
    neither does which one matched.
    """

    def __init__(self, digests: list[tuple[bytes, str]]) -> None:
        if not digests:
            raise ConfigError("api.tokens: no bearer token is configured; compactd serve "
                              "does not run without one")
        self._digests = digests

    @classmethod
    def from_config(cls, api: ApiConfig, environ: Mapping[str, str] | None = None) -> Tokens:
        environ = os.environ if environ is None else environ
        digests: list[tuple[bytes, str]] = []
        for i, entry in enumerate(api.tokens):
            if entry.token_env is not None:
                secret = environ.get(entry.token_env, "")
                if not secret:
                    raise ConfigError(f"api.tokens[{i}].token_env: the environment variable "
                                      f"{entry.token_env} is not set")
                digests.append((_digest(secret), entry.tenant))
            else:
                assert entry.token_sha256 is not None
                digests.append((bytes.fromhex(entry.token_sha256), entry.tenant))
        return cls(digests)

    def tenant(self, token: str) -> str | None:
        presented = _digest(token)
        found: str | None = None
        for digest, tenant in self._digests:
            if hmac.compare_digest(digest, presented) and found is None:
                found = tenant
        return found


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def token_sha256(token: str) -> str:
    """The value for ``api.tokens[].token_sha256``."""
    return _digest(token).hex()


_bearer = HTTPBearer(auto_error=False, description="a token of api.tokens; it names a tenant")


class Unauthorized(BadInput):
    """A bearer token is required."""


async def _tenant(request: Request,
                  credentials: Annotated[HTTPAuthorizationCredentials | None,
                                         Depends(_bearer)]) -> str:
    if credentials is None:
        raise Unauthorized("an Authorization: Bearer <token> header is required")
    tenant = request.app.state.tokens.tenant(credentials.credentials)
    if tenant is None:
        raise Unauthorized("the bearer token is not valid")
    return str(tenant)


Tenant = Annotated[str, Depends(_tenant)]

"""The HTTP edge: what the API checks of a connection and a request before any work is done for it.

- Keys: `api.api_key` and `[[api.keys]]` (each with limits of its own and, optionally, a prefix cache of
  its own); `api.metrics_key` for /metrics and /health. Compared in constant time.
- A browser cannot drive a keyless local API: a body must be `application/json` (a page's simple
  cross-origin POST cannot send that without a preflight, which is never answered), and without a key
  the `Host` must be loopback's, api.host, or one of api.allowed_hosts (DNS rebinding names another).
- Connections: headers within api.header_timeout_s (aiohttp's keep-alive timer closes a connection whose
  request has not been read by then, so a slowloris holds nothing long), the body within
  api.body_timeout_s, at most api.max_connections at once (a new one past that gets 503 and is closed).
- TLS when api.tls_cert and api.tls_key are set; no key beyond loopback unless security.insecure."""

import asyncio
import hmac
import logging
import ssl
from contextlib import contextmanager
from dataclasses import dataclass

from aiohttp import web

from mooncake.api.schemas import ApiError, bad
from mooncake.config import ApiConfig, ApiKeyConfig, MooncakeConfig
from mooncake.errors import ConfigError
from mooncake.security import is_loopback

log = logging.getLogger(__name__)

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
KEYED_PATHS = ("/tokenize", "/detokenize")  # beside /v1/*: what needs an API key when one is set
OPS_PATHS = ("/metrics", "/health")  # what needs api.metrics_key when one is set
_OVERLOADED_BODY = b'{"error": {"message": "too many open connections (api.max_connections); retry", ' \
    b'"type": "server_error", "param": null, "code": "too_many_connections"}}'
OVERLOADED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
              b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n" % len(_OVERLOADED_BODY)) + _OVERLOADED_BODY


def check_exposure(config: MooncakeConfig) -> None:
    """An API beyond loopback needs a key, unless the operator says the network is trusted."""
    cfg = config.api
    if not cfg.is_keyed and not is_loopback(cfg.host) and not config.security.insecure:
        raise ConfigError(f"config key 'api.api_key' is empty while api.host = {cfg.host} serves beyond loopback: "
                          f"anyone who reaches it could use the cluster; set a key (`openssl rand -hex 32`), or "
                          f"security.insecure = true on a network you trust")


def tls_context(cfg: ApiConfig) -> ssl.SSLContext | None:
    if not cfg.tls_cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cfg.tls_cert, cfg.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"config key 'api.tls_cert': cannot load {cfg.tls_cert} with api.tls_key {cfg.tls_key}: "
                          f"{exc}") from None
    return context


def limit_connections(server: web.Server, max_connections: int) -> None:
    """Answer a connection past `max_connections` with 503 and close it (aiohttp has no such limit)."""
    admit = server.connection_made

    def connection_made(handler, transport) -> None:
        admit(handler, transport)
        if len(server.connections) > max_connections:
            log.warning("%d client connections open (api.max_connections); refused one", len(server.connections) - 1)
            transport.write(OVERLOADED)
            transport.close()
    server.connection_made = connection_made


async def read_body(request: web.Request, timeout_s: float) -> bytes:
    try:
        return await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within api.body_timeout_s = {timeout_s:g} s",
                       code="request_timeout") from None


@dataclass
class Tenant:
    """Who a request is from (its key), and what it has in flight."""

    name: str
    limits: ApiKeyConfig | None = None  # None: no limits, the shared prefix cache
    num_requests: int = 0
    num_tokens: int = 0

    @property
    def cache_salt(self) -> str:
        return self.limits.cache_salt if self.limits is not None else ""


ANONYMOUS = Tenant("anonymous")
TENANT = web.RequestKey("tenant", Tenant)  # the request's, set by the middleware on keyed paths


class Edge:
    """The checks, as aiohttp middleware, and each key's tenant."""

    def __init__(self, cfg: ApiConfig):
        self.cfg = cfg
        self.tenants: dict[bytes, Tenant] = {}
        if cfg.api_key:
            self.tenants[f"Bearer {cfg.api_key}".encode()] = Tenant("api.api_key")
        for i, key in enumerate(cfg.keys):
            self.tenants[f"Bearer {key.key}".encode()] = Tenant(key.name or f"key {i}", key)
        hosts = {*LOOPBACK_NAMES, cfg.host, *cfg.allowed_hosts}
        self.hosts = {h.lower() for h in hosts}

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        path = request.path
        if path in OPS_PATHS:
            if self.cfg.metrics_key and not _same(request.headers.get("Authorization", ""),
                                                  f"Bearer {self.cfg.metrics_key}"):
                raise ApiError(401, f"{path} needs 'Authorization: Bearer <api.metrics_key>'", code="invalid_api_key")
        elif path.startswith("/v1/") or path in KEYED_PATHS:
            request[TENANT] = self._tenant(request)
        if not self.cfg.is_keyed and _host_name(request.host) not in self.hosts:
            raise ApiError(403, f"Host {request.host!r} is not this server's; a keyless API answers only its own "
                                "names (add yours to api.allowed_hosts, or set an API key)", code="host_not_allowed")
        if request.method == "POST" and request.content_type != "application/json":
            raise ApiError(415, f"the request body must be JSON sent as 'Content-Type: application/json', got "
                                f"{request.content_type!r}", code="unsupported_media_type")
        return await handler(request)

    def _tenant(self, request: web.Request) -> Tenant:
        if not self.cfg.is_keyed:
            return ANONYMOUS
        given = request.headers.get("Authorization", "").encode()
        # NOTE: every key is compared, in constant time each, so the time says nothing of which was near.
        found = None
        for key, tenant in self.tenants.items():
            if hmac.compare_digest(given, key):
                found = tenant
        if found is None:
            raise ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'", code="invalid_api_key")
        return found

    @contextmanager
    def admitted(self, tenant: Tenant, num_requests: int, num_tokens: int):
        """Count a request's choices and tokens against its key's limits while it runs; 429 past them."""
        limits = tenant.limits
        if limits is not None:
            if limits.max_outstanding_tokens and num_tokens > limits.max_outstanding_tokens:  # never fits: no retry
                raise bad(f"this request's {num_tokens} tokens (prompt + max_tokens, per choice) exceed key "
                          f"{tenant.name!r}'s max_outstanding_tokens = {limits.max_outstanding_tokens}",
                          "max_tokens", "key_tokens_limit")
            if limits.max_concurrent_requests and num_requests > limits.max_concurrent_requests:  # never fits
                raise bad(f"this request's {num_requests} choices (prompts times n) exceed key {tenant.name!r}'s "
                          f"max_concurrent_requests = {limits.max_concurrent_requests}", "n", "key_requests_limit")
            if limits.max_concurrent_requests and tenant.num_requests + num_requests > limits.max_concurrent_requests:
                raise _over(tenant, f"{tenant.num_requests} requests in flight, its limit is "
                                    f"{limits.max_concurrent_requests} (max_concurrent_requests)", "key_requests_limit")
            if limits.max_outstanding_tokens and tenant.num_tokens + num_tokens > limits.max_outstanding_tokens:
                raise _over(tenant, f"{tenant.num_tokens} tokens outstanding, its limit is "
                                    f"{limits.max_outstanding_tokens} (max_outstanding_tokens)", "key_tokens_limit")
        tenant.num_requests += num_requests
        tenant.num_tokens += num_tokens
        try:
            yield
        finally:
            tenant.num_requests -= num_requests
            tenant.num_tokens -= num_tokens


def _over(tenant: Tenant, what: str, code: str) -> ApiError:
    return ApiError(429, f"key {tenant.name!r} has {what}; retry when some finish", code=code,
                    type_="rate_limit_error", headers={"Retry-After": "1"})


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def _host_name(host: str | None) -> str:
    """The name in a Host header, without its port ("[::1]:8000" -> "::1")."""
    host = (host or "").strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


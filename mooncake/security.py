"""Only the cluster talks to the cluster: how every role socket is set up (DESIGN section 11).

The cluster has one CURVE key pair (`mooncake keys generate DIR`, `security.keys_dir`), which every role
of the cluster holds. Every server socket (the conductor's control socket, a cache node's control and
event sockets, each transport endpoint) is a CURVE server with that key, and a ZAP handler on its ZeroMQ
context admits a client only if it presents the cluster's public key, which the CURVE handshake makes it
prove it holds the secret for. So a peer without the keys cannot open a connection at all: it gets no
reply and changes nothing. A transport's data sockets carry a keyed MAC on each message instead of
CURVE, which costs too much there (`seal`). Every socket also has a `ZMQ_MAXMSGSIZE`, so no peer can make a role buffer a
frame of any size.

The keys are a property of the process: the role's start calls `configure` once; the sockets made
afterwards (`server`, `client`) use them. Without keys a role runs only on loopback, unless
`security.insecure` says otherwise."""

import hashlib
import hmac
import ipaddress
import logging
import os
from pathlib import Path
from typing import NamedTuple

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from mooncake.addresses import endpoint_host
from mooncake.errors import ConfigError

log = logging.getLogger(__name__)

CONTROL_MAX_BYTES = 64 << 20  # a control message: a prompt's token ids and block hashes, a batch of events
DATA_MAX_BYTES = 1 << 30  # one frame of a transport: a header, or one KV block
KEY_NAME = "cluster"
ZAP_DOMAIN = b"mooncake"


class ClusterKeys(NamedTuple):
    public: bytes  # z85
    secret: bytes


_keys: ClusterKeys | None = None
_mac_key: bytes | None = None  # seals transport headers (below); derived from the cluster's secret key
MAC_BYTES = 16
_authenticators: dict[int, ThreadAuthenticator] = {}  # by ZeroMQ context handle


def generate_keys(directory: str | Path) -> Path:
    """Write a new cluster key pair into `directory` (created 0700); the secret file is mode 0600.
    Returns the secret file's path. Refuses to overwrite a pair that is already there."""
    directory = Path(directory)
    secret = directory / f"{KEY_NAME}.key_secret"
    if secret.exists():
        raise ConfigError(f"{secret} exists already; remove it first to make a new cluster key pair "
                          f"(every role of the cluster then needs the new one)")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    public_path, secret_path = zmq.auth.create_certificates(str(directory), KEY_NAME)
    os.chmod(secret_path, 0o600)
    return Path(secret_path)


def load_keys(directory: str | Path) -> ClusterKeys:
    path = Path(directory) / f"{KEY_NAME}.key_secret"
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"config key 'security.keys_dir': cannot read the cluster key pair {path} ({exc}); "
                          f"make one with `mooncake keys generate {directory}`") from None
    if secret is None:
        raise ConfigError(f"config key 'security.keys_dir': {path} holds no secret key")
    return ClusterKeys(public, secret)


def configure(config) -> None:
    """Load this process's keys from a MooncakeConfig's [security] table, or refuse to run without them
    on an address beyond loopback (unless security.insecure)."""
    global _keys, _mac_key
    sec = config.security
    _keys = load_keys(sec.keys_dir) if sec.keys_dir else None
    _mac_key = None if _keys is None else hashlib.blake2b(
        b"mooncake transport header MAC", key=zmq.utils.z85.decode(_keys.secret), digest_size=32).digest()
    if _keys is None:
        exposed = sorted(a for a in _addresses(config) if not _is_loopback(a))
        if exposed and not sec.insecure:
            raise ConfigError(f"this role would listen or connect beyond loopback ({', '.join(exposed)}) with no "
                              f"keys: set security.keys_dir (make keys with `mooncake keys generate DIR`), or "
                              f"security.insecure = true on a network you trust")
        if exposed:
            log.warning("security.insecure: control and KV traffic is unauthenticated and unencrypted")


def reset() -> None:
    """Forget the process's keys (tests)."""
    global _keys, _mac_key
    _keys = _mac_key = None


def is_secured() -> bool:
    return _keys is not None


def server(sock: zmq.Socket, max_bytes: int = CONTROL_MAX_BYTES, curve: bool = True) -> zmq.Socket:
    """Set up a socket that binds: a CURVE server admitting only the cluster, when keys are configured
    (`curve=False`: a transport's data socket, whose messages are sealed instead; see `seal`)."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    if _keys is not None and curve:
        _authenticate(sock.context)
        sock.curve_secretkey = _keys.secret
        sock.curve_publickey = _keys.public
        sock.curve_server = True
        sock.zap_domain = ZAP_DOMAIN
    return sock


def client(sock: zmq.Socket, max_bytes: int = CONTROL_MAX_BYTES, keys: ClusterKeys | None = None,
           curve: bool = True) -> zmq.Socket:
    """Set up a socket that connects: a CURVE client with the cluster key, when keys are configured (or
    with `keys`, for a tool that talks to a cluster it is not a role of)."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    keys = keys or _keys
    if keys is not None and curve:
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_serverkey = keys.public
    return sock


def seal(header) -> bytes:
    """The MAC of a transport message's header under the cluster key (b"" without keys).

    NOTE: why not CURVE on the KV data path: encrypting every block cut tcp throughput between two hosts
    to 0.33-0.70x (scripts/bench_transfer.py --netns). Instead each message carries a keyed BLAKE2b MAC
    of its header, which names every block's key, size and xxh3 checksum, and the receiver verifies each
    block against those: a peer without the key can make no endpoint take or answer anything, at the cost
    of hashing a header. Block bytes travel in the clear, as over RDMA."""
    if _mac_key is None:
        return b""
    return hashlib.blake2b(header, key=_mac_key, digest_size=MAC_BYTES).digest()


def is_sealed(mac, header) -> bool:
    """Whether `mac` is `header`'s MAC under the cluster key (always, without keys)."""
    return _mac_key is None or hmac.compare_digest(bytes(mac), seal(header))


def release(ctx: zmq.Context) -> None:
    """Stop the ZAP handler of a context, if it has one; call before the context terminates."""
    auth = _authenticators.pop(ctx.underlying, None)
    if auth is not None:
        auth.stop()


class _ClusterOnly:
    """ZAP decision: a CURVE client is admitted iff it holds the cluster key."""

    def __init__(self, public: bytes):
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:  # key: the client's public key, z85
        admitted = key == self.public
        if not admitted:
            log.warning("refused a connection from a peer without the cluster key")
        return admitted


def _authenticate(ctx: zmq.Context) -> None:
    if ctx.underlying in _authenticators:
        return
    auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying))
    auth.start()
    auth.configure_curve_callback(domain=ZAP_DOMAIN.decode(), credentials_provider=_ClusterOnly(_keys.public))
    _authenticators[ctx.underlying] = auth


def _addresses(config) -> list[str]:
    """The hosts this process's roles listen on or reach, from the config they all share."""
    hosts = [endpoint_host(a) for a in (config.conductor.control_address, config.instance.conductor_address,
                                         config.cache.control_address, config.cache.events_address,
                                         config.cache.data_address, config.instance.data_address,
                                         *config.cache_client.nodes) if a]
    return [h for h in hosts + [config.transport.host] if h]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

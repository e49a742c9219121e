"""Only the cluster talks to the cluster, and each role only as itself: how every role socket is set up
(DESIGN section 11).

`mooncake keys generate DIR` makes a CURVE key pair per role (DIR/<role>.key, public; DIR/<role>.key_secret,
mode 0600) and the data plane's MAC secret (DIR/data.secret). A role process loads its own pair, every
role's public key, and (prefill, decode and cache, which move KV) the data secret. Every server socket is
a CURVE server with its role's key, and a ZAP handler on its ZeroMQ context admits only the roles that may
call it: the conductor's control socket prefill and decode instances; a cache node's control and event
sockets the conductor and instances. So a peer without a cluster key cannot open a connection at all, and
a cache node's key cannot register an instance. The conductor also checks that a registering instance's
key is of the role it claims (`role_of`, from the connection's ZAP User-Id). A transport's data sockets
carry a keyed MAC (under the data secret) on each message instead of CURVE, which costs too much there
(`seal`). Every socket also has a `ZMQ_MAXMSGSIZE`, so no peer can make a role buffer a frame of any size.

The keys are a property of the process: the role's start calls `configure` once; the sockets made
afterwards (`server`, `client`) use them. Without keys a role runs only on loopback, unless
`security.insecure` says otherwise."""

import hashlib
import hmac
import ipaddress
import logging
import os
import time
from pathlib import Path
from typing import NamedTuple

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from mooncake.addresses import endpoint_host
from mooncake.errors import ConfigError

log = logging.getLogger(__name__)

CONTROL_MAX_BYTES = 64 << 20  # a control message: a prompt's token ids and block hashes, a batch of events
DATA_MAX_BYTES = 1 << 30  # one frame of a transport: a header, or one KV block
ROLES = ("conductor", "cache", "prefill", "decode", "api")
DATA_ROLES = ("cache", "prefill", "decode")  # what moves KV: holds the data plane's MAC secret
# Who may connect to a server socket of each role, by the role of the client's key. A role not named here
# (a tool's own server) admits every role of the cluster.
ADMITS = {"conductor": ("prefill", "decode", "api"), "cache": ("conductor", "prefill", "decode"),
          "api": ("prefill", "decode")}  # an API process's report socket: instances send it tokens
DATA_SECRET = "data.secret"
ZAP_DOMAIN = b"mooncake"


class ClusterKeys(NamedTuple):
    """One role's CURVE pair (z85), and every role's public key."""

    public: bytes
    secret: bytes
    role: str
    publics: dict[str, bytes]


_keys: ClusterKeys | None = None
_keys_dir = ""
_other_pairs: dict[str, ClusterKeys] = {}  # roles this process also serves as (tests, tools)
_mac_key: bytes | None = None  # seals transport messages (below); derived from the data secret
# What KV payloads' MACs are keyed with (mooncake/kv_mac.py); derived from the data secret, or this fixed
# key without cluster keys (a check against accidents only)
UNKEYED_KV_KEY = hashlib.blake2b(b"mooncake KV MAC without cluster keys", digest_size=16).digest()
_kv_key = UNKEYED_KV_KEY
# What a data socket's peer must present (ZeroMQ PLAIN, checked by ZAP before any frame of it is read);
# derived from the data secret
_data_password: bytes | None = None
DATA_USER = b"mooncake-data"
DATA_DOMAIN = "mooncake-data"
MAC_BYTES = 16
_authenticators: dict[int, ThreadAuthenticator] = {}  # by ZeroMQ context handle


def generate_keys(directory: str | Path) -> Path:
    """Write a new set of cluster keys into `directory` (created 0700): a CURVE pair per role (secret files
    mode 0600) and the data plane's MAC secret. Returns the directory. Refuses to overwrite a set."""
    directory = Path(directory)
    if any((directory / f"{role}.key_secret").exists() for role in ROLES) or (directory / DATA_SECRET).exists():
        raise ConfigError(f"{directory} holds cluster keys already; remove them first to make a new set "
                          f"(every role of the cluster then needs the new one)")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for role in ROLES:
        _, secret_path = zmq.auth.create_certificates(str(directory), role)
        os.chmod(secret_path, 0o600)
    data = directory / DATA_SECRET
    data.write_bytes(os.urandom(32).hex().encode())
    os.chmod(data, 0o600)
    return directory


def load_keys(directory: str | Path, role: str = "prefill") -> ClusterKeys:
    """`role`'s pair and every role's public key from a `generate_keys` directory."""
    directory = Path(directory)
    path = directory / f"{role}.key_secret"
    try:
        public, secret = zmq.auth.load_certificate(str(path))
        publics = {r: zmq.auth.load_certificate(str(directory / f"{r}.key"))[0] for r in ROLES}
    except (OSError, ValueError) as exc:
        old = " (it holds the older single cluster pair)" if (directory / "cluster.key_secret").exists() else ""
        raise ConfigError(f"config key 'security.keys_dir': cannot read the {role} key pair {path}{old} ({exc}); "
                          f"make the cluster's keys with `mooncake keys generate DIR` and give this host "
                          f"DIR/*.key, DIR/{role}.key_secret and, for roles that move KV, DIR/{DATA_SECRET}") from None
    if secret is None:
        raise ConfigError(f"config key 'security.keys_dir': {path} holds no secret key")
    return ClusterKeys(public, secret, role, publics)


def role_of(user_id: str | None) -> str | None:
    """The role whose public key a connection authenticated with (its ZAP User-Id: the z85 key)."""
    if _keys is None or not user_id:
        return None
    return next((r for r, key in _keys.publics.items() if key.decode() == user_id), None)


def key_role(frames) -> str | None:
    """The role of the key a received message's connection authenticated with (its ZAP User-Id), from the
    message's zmq.Frames (received with copy=False); None without keys."""
    if _keys is None or not frames:
        return None
    try:
        return role_of(frames[-1].get("User-Id"))
    except zmq.ZMQError:  # no such property: the connection was not authenticated
        return None


def configure(config, role: str = "prefill") -> None:
    """Load this process's keys (`role`'s pair; a tool acts as an instance) from a MooncakeConfig's
    [security] table, or refuse to run without them on an address beyond loopback (unless
    security.insecure)."""
    global _keys, _mac_key, _keys_dir, _data_password, _kv_key
    sec = config.security
    _keys = load_keys(sec.keys_dir, role) if sec.keys_dir else None
    _keys_dir, _mac_key, _data_password, _kv_key = sec.keys_dir, None, None, UNKEYED_KV_KEY
    _other_pairs.clear()
    if _keys is not None and role in DATA_ROLES:
        data = Path(sec.keys_dir) / DATA_SECRET
        try:
            secret = data.read_bytes()
        except OSError as exc:
            raise ConfigError(f"config key 'security.keys_dir': a {role} moves KV and needs {data} ({exc})") from None
        _mac_key = hashlib.blake2b(b"mooncake transport MAC", key=secret[:64], digest_size=32).digest()
        _kv_key = hashlib.blake2b(b"mooncake KV MAC", key=secret[:64], digest_size=16).digest()
        _data_password = hashlib.blake2b(b"mooncake data plane password", key=secret[:64]).hexdigest().encode()
    if _keys is None:
        exposed = sorted(a for a in _addresses(config) if not is_loopback(a))
        if exposed and not sec.insecure:
            raise ConfigError(f"this role would listen or connect beyond loopback ({', '.join(exposed)}) with no "
                              f"keys: set security.keys_dir (make keys with `mooncake keys generate DIR`), or "
                              f"security.insecure = true on a network you trust")
        if exposed:
            log.warning("security.insecure: control and KV traffic is unauthenticated and unencrypted")


def reset() -> None:
    """Forget the process's keys (tests)."""
    global _keys, _mac_key, _data_password, _kv_key
    _keys = _mac_key = _data_password = None
    _kv_key = UNKEYED_KV_KEY
    _other_pairs.clear()


def kv_key() -> bytes:
    """The key of KV payloads' MACs (mooncake/kv_mac.py)."""
    return _kv_key


def is_secured() -> bool:
    return _keys is not None


def server(sock: zmq.Socket, max_bytes: int = CONTROL_MAX_BYTES, curve: bool = True,
           role: str | None = None) -> zmq.Socket:
    """Set up a socket that binds: a CURVE server with `role`'s key (default: this process's), admitting
    only the roles that may call it (ADMITS), when keys are configured (`curve=False`: a transport's data
    socket, whose messages are sealed instead; see `seal`)."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    if _data_password is not None and not curve:  # NOTE: a peer without the data secret is refused at its
        _authenticate_data(sock.context)          # handshake: nothing it sends is ever read or buffered
        sock.plain_server = True
        sock.zap_domain = DATA_DOMAIN.encode()
    if _keys is not None and curve:
        keys = _pair(role or _keys.role)
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_server = True
        sock.zap_domain = _authenticate(sock.context, keys)
    return sock


def _pair(role: str) -> ClusterKeys:
    """`role`'s keys: this process's own, or (a process serving as several roles: tests, tools) read from
    the keys directory, which then must hold that role's secret."""
    if role == _keys.role:
        return _keys
    if role not in _other_pairs:
        _other_pairs[role] = load_keys(_keys_dir, role)
    return _other_pairs[role]


def client(sock: zmq.Socket, max_bytes: int = CONTROL_MAX_BYTES, keys: ClusterKeys | None = None,
           curve: bool = True, server: str = "conductor", role: str | None = None) -> zmq.Socket:
    """Set up a socket that connects to a `server` role's socket: a CURVE client with this role's key (or
    `role`'s, for a process serving as several roles), when keys are configured (or with `keys`, for a tool
    that talks to a cluster it is not a role of)."""
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    if _data_password is not None and not curve:
        sock.plain_username = DATA_USER
        sock.plain_password = _data_password
    keys = keys or (_pair(role) if role and _keys is not None else _keys)
    if keys is not None and curve:
        sock.curve_secretkey = keys.secret
        sock.curve_publickey = keys.public
        sock.curve_serverkey = keys.publics[server]
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


class _Admitted:
    """ZAP decision: a CURVE client is admitted iff its key is one of the `roles` that may call us."""

    def __init__(self, keys: ClusterKeys, roles: tuple[str, ...]):
        self.keys = {keys.publics[r]: r for r in roles}
        self.server = keys.role

    def callback(self, domain: str, key: bytes) -> bool:  # key: the client's public key, z85
        admitted = key in self.keys
        if not admitted:
            known = role_of(key.decode(errors="replace"))
            log.warning("refused a connection from %s", f"a {known} (it may not call a {self.server})" if known
                        else "a peer without a cluster key")
        return admitted


# NOTE: pyzmq's authenticator logs a PLAIN password at DEBUG: its lines go to a logger that never shows DEBUG.
_zap_log = logging.getLogger(__name__ + ".zap")
_zap_log.setLevel(logging.INFO)


HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


async def watch_handshakes(sock, what: str, level: int = logging.ERROR, every_s: float = 30.0) -> None:
    """Log `what` (at most once per `every_s`, with how many) whenever a CURVE handshake on `sock` (a
    zmq.asyncio socket) fails: a peer, or this process, holds another cluster's keys. Without it a wrong key
    pair looks like a peer that is not there. Returns when the socket closes; cancel it to stop sooner."""
    if _keys is None:
        return
    monitor = sock.get_monitor_socket(HANDSHAKE_FAILED | zmq.EVENT_MONITOR_STOPPED)
    last_s, count = float("-inf"), 0
    try:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                return
            count += 1
            if time.monotonic() - last_s >= every_s:
                log.log(level, "%s (%d failed handshake%s, the last with %s)", what, count, "s" if count > 1 else "",
                        event["endpoint"].decode(errors="replace"))
                last_s, count = time.monotonic(), 0
    except zmq.ZMQError:  # the socket closed under it
        return
    finally:
        monitor.close(linger=0)


def _authenticator(ctx: zmq.Context) -> ThreadAuthenticator:
    auth = _authenticators.get(ctx.underlying)
    if auth is None:
        auth = _authenticators[ctx.underlying] = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying), log=_zap_log)
        auth.start()
    return auth


def _authenticate_data(ctx: zmq.Context) -> None:
    """Data sockets admit a peer that presents the data plane's password (PLAIN, before any frame)."""
    _authenticator(ctx).configure_plain(domain=DATA_DOMAIN, passwords={DATA_USER.decode(): _data_password.decode()})


def _authenticate(ctx: zmq.Context, keys: ClusterKeys) -> bytes:
    """Start the context's ZAP handler if needed; the domain of `keys`' role's server sockets."""
    domain = f"{ZAP_DOMAIN.decode()}-{keys.role}"
    admitted = _Admitted(keys, ADMITS.get(keys.role, ROLES))
    _authenticator(ctx).configure_curve_callback(domain=domain, credentials_provider=admitted)
    return domain.encode()


def _addresses(config) -> list[str]:
    """The hosts this process's roles listen on or reach, from the config they all share."""
    hosts = [endpoint_host(a) for a in (config.conductor.control_address, config.instance.conductor_address,
                                         config.cache.control_address, config.cache.events_address,
                                         config.cache.data_address, config.instance.data_address,
                                         *config.cache_client.nodes) if a]
    return [h for h in hosts + [config.transport.host] if h]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

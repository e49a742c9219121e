"""Which address a role tells its peers. A role binds where its config says; what it advertises must be
an address a peer on another host can reach, never a wildcard: `transport.host` when set, else the
address of this host's interface that routes to the conductor (127.0.0.1 when the conductor is on
loopback). Used by the cache role, the decode inbox and every transport endpoint."""

import ipaddress
import socket
from urllib.parse import urlsplit

from mooncake.errors import ConfigError

WILDCARDS = ("*", "0.0.0.0", "::", "")


def endpoint_host(address: str) -> str:
    """The host part of a ZeroMQ tcp endpoint ("tcp://198.18.0.10:7700" -> "198.18.0.10")."""
    return urlsplit(address).hostname or ""


def route_source(address: str) -> str:
    """The local address this host uses to reach the host of `address` (a ZeroMQ endpoint or a bare
    host). A UDP socket's connect picks the route and sends nothing."""
    host = endpoint_host(address) if "://" in address else address
    try:
        if host in WILDCARDS or ipaddress.ip_address(host).is_loopback:
            return "127.0.0.1"
    except ValueError:  # a name: resolve it below
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((host, 9))
        except OSError as exc:
            raise ConfigError(f"cannot find a local address that routes to {host} ({exc}); set transport.host "
                              f"to the address peers should use for this host") from None
        return probe.getsockname()[0]


def advertise_host(config) -> str:
    """The host a role of this MooncakeConfig puts in the addresses it gives its peers."""
    return config.transport.host or route_source(config.instance.conductor_address.split(",")[0])


def advertised(bound: str, host: str) -> str:
    """`bound` (what a socket reports it listens on) with a wildcard host replaced by `host`."""
    parts = urlsplit(bound)
    if parts.scheme != "tcp" or (parts.hostname or "") not in WILDCARDS:
        return bound
    return f"tcp://{host}:{parts.port}"


def port_range(text: str) -> tuple[int, int] | None:
    """"LOW-HIGH" as (LOW, HIGH), or None when it is not a range of unprivileged ports below Linux's
    ephemeral ones (the Transfer Engine ignores a range that reaches past 32767)."""
    low, _, high = text.partition("-")
    if not (low.isdigit() and high.isdigit()) or not 1024 <= int(low) < int(high) <= 32767:
        return None
    return int(low), int(high)

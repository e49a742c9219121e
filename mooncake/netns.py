"""Test "hosts" built from Linux network namespaces on one machine; used by multi-host tests and
`scripts/bench_transfer.py --netns`.

A `NetnsLab` gives each host its own network namespace (its own loopback, its own address) joined
to the others by a bridge in the root namespace, so roles that would run on different machines get
different IP addresses, and a host can be cut off (`cut`) and reconnected (`restore`) to exercise
failure handling. Addresses come only from the benchmarking range 198.18.0.0/15 (RFC 2544), which
no real network routes: one /24 per lab, 198.18.N.0/24, the root namespace at .1 on the bridge (so
the test process itself reaches services in the hosts) and host k at .(10+k). Needs root and
iproute2; `netns_unavailable()` says why not when a lab cannot be built.
"""

import itertools
import os
import shutil
import subprocess
from dataclasses import dataclass

from mooncake.errors import MooncakeError

IP_TIMEOUT_S = 10.0
MAX_HOSTS = 99           # keeps interface names within 15 characters and host addresses within .10-.108
IFNAMSIZ = 15            # Linux interface names: at most 15 characters
_labs = itertools.count()  # several labs in one process need distinct names and subnets


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run one `ip` command; with `check`, a failure raises MooncakeError naming the command and its stderr."""
    argv = ["ip", *args]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise MooncakeError(f"`{' '.join(argv)}` did not finish within {IP_TIMEOUT_S:.0f}s") from None
    if check and done.returncode != 0:
        raise MooncakeError(f"`{' '.join(argv)}` failed: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done


def netns_unavailable() -> str | None:
    """None if labs can be built here, else why not. Probes by creating and deleting a throwaway
    namespace and bridge, because containers often deny these even to root."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    probe = f"mcprobe{os.getpid()}"[:IFNAMSIZ]
    try:
        for make, undo in ((("netns", "add", probe), ("netns", "delete", probe)),
                           (("link", "add", probe, "type", "bridge"), ("link", "delete", probe))):
            _ip(*make)
            _ip(*undo, check=False)
    except MooncakeError as exc:
        return f"network namespaces not permitted here: {exc}"
    return None


def _free_subnet(first: int) -> int:
    """The first N from `first` on (wrapping within 1-250) whose 198.18.N.0/24 has no address in the root
    namespace yet, so a second live lab never routes the same subnet. Chosen at construction so `hosts`
    never changes; a race between two labs built at the same instant remains possible."""
    try:
        shown = _ip("-o", "-4", "addr", "show").stdout
    except (MooncakeError, OSError):
        return first  # start() will report what is wrong with `ip`
    for step in range(250):
        n = 1 + (first - 1 + step) % 250
        if f" 198.18.{n}." not in shown:
            return n
    return first


@dataclass(frozen=True)
class Host:
    """One simulated machine: a namespace and its address. `veth` is the bridge-side end of its link,
    in the root namespace; inside the namespace the other end is called eth0."""
    name: str
    netns: str
    address: str
    veth: str


class NetnsLab:
    """`num_hosts` namespaces on one bridge. Names carry the pid and a per-process lab number, so labs
    of concurrent test runs (and several in one process) never share a name; use as a context manager."""

    def __init__(self, num_hosts: int):
        if not 1 <= num_hosts <= MAX_HOSTS:
            raise MooncakeError(f"a netns lab holds 1 to {MAX_HOSTS} hosts, not {num_hosts}")
        pid, seq = os.getpid(), next(_labs)
        self.prefix = f"mc{pid}l{seq}"
        self.bridge = f"{self.prefix}br"
        for name in (self.bridge, f"{self.prefix}h{num_hosts - 1}"):
            if len(name) > IFNAMSIZ:
                raise MooncakeError(f"interface name {name!r} is longer than {IFNAMSIZ} characters")
        subnet = _free_subnet(1 + (pid + seq) % 250)
        self.root_address = f"198.18.{subnet}.1"
        self.hosts: list[Host] = [Host(f"h{k}", f"{self.prefix}h{k}", f"198.18.{subnet}.{10 + k}",
                                       f"{self.prefix}h{k}") for k in range(num_hosts)]
        self._procs: list[subprocess.Popen] = []

    def start(self) -> None:
        """Create the bridge, then for each host a namespace with lo up and a veth pair into the bridge.
        On any failure, undo what was made (newest first) and raise MooncakeError naming the `ip` command."""
        undo: list[tuple[str, ...]] = []
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            undo.append(("link", "delete", self.bridge))
            _ip("addr", "add", f"{self.root_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for host in self.hosts:
                _ip("netns", "add", host.netns)
                undo.append(("netns", "delete", host.netns))
                _ip("-n", host.netns, "link", "set", "lo", "up")
                # Create the peer directly inside the namespace, so every host sees its link as eth0.
                _ip("link", "add", host.veth, "type", "veth", "peer", "name", "eth0", "netns", host.netns)
                undo.append(("link", "delete", host.veth))
                _ip("-n", host.netns, "addr", "add", f"{host.address}/24", "dev", "eth0")
                _ip("-n", host.netns, "link", "set", "eth0", "up")
                _ip("link", "set", host.veth, "master", self.bridge)
                _ip("link", "set", host.veth, "up")
        except MooncakeError:
            for args in reversed(undo):
                _ip(*args, check=False)
            raise

    def stop(self) -> None:
        """Tear everything down; safe to call twice or after a failed start. Processes started with
        `popen` are killed first: a namespace with a live process survives `ip netns delete` (only
        its name goes), and its veth with it, so veths are also deleted explicitly."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
                try:
                    proc.wait(timeout=IP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    pass
        self._procs.clear()
        gone = ("Cannot find device", "No such file", "does not exist", "Cannot open network namespace")
        problems = []
        for args in [*(("link", "delete", h.veth) for h in self.hosts),
                     *(("netns", "delete", h.netns) for h in self.hosts), ("link", "delete", self.bridge)]:
            try:
                done = _ip(*args, check=False)
            except MooncakeError as exc:  # timed out
                problems.append(str(exc))
                continue
            if done.returncode != 0 and not any(g in done.stderr for g in gone):
                problems.append(f"`ip {' '.join(args)}`: {done.stderr.strip()}")
        if problems:
            raise MooncakeError("netns lab teardown left things behind: " + "; ".join(problems))

    def popen(self, host: Host, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start `argv` inside the host's namespace (`ip netns exec` execs it, so the pid is argv's own).
        The caller stops it; `stop()` kills any still running."""
        proc = subprocess.Popen(["ip", "netns", "exec", host.netns, *argv], **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, host: Host, argv: list[str], timeout_s: float = 30.0) -> subprocess.CompletedProcess:
        """Run `argv` to completion inside the host's namespace, capturing text output; raises
        subprocess.TimeoutExpired after `timeout_s` (the child is killed)."""
        return subprocess.run(["ip", "netns", "exec", host.netns, *argv], capture_output=True, text=True,
                              timeout=timeout_s)

    def cut(self, host: Host) -> None:
        """Take the host's bridge port down: it can reach no other host, nor the root namespace, and
        they cannot reach it. Its own loopback keeps working."""
        _ip("link", "set", host.veth, "down")

    def restore(self, host: Host) -> None:
        """Bring the host's bridge port back up (the bridge runs no STP, so it forwards at once)."""
        _ip("link", "set", host.veth, "up")

    def __enter__(self) -> "NetnsLab":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

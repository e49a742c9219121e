"""The Transfer Engine listens on every interface whatever address it is given (it has no setting for
that; see the README's security section), so what a deployment can do is know its ports and firewall
them: `transport.te_ports` fixes the range both of its listeners take their port from."""

import random
import subprocess
import sys
from pathlib import Path

from tests.transfer.test_transport_contract import available

ROOT = Path(__file__).resolve().parents[2]

# NOTE: in a process of its own: the engine reads its port range once, when it is first loaded
LISTENING = """
import os, sys
from backends.transports.mooncake_te import MooncakeTransport
t = MooncakeTransport(host="127.0.0.1", te_ports=sys.argv[1])
mine = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        mine.add(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:  # the listing's own descriptor, closed since
        pass
for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        f = line.split()
        if f[3] == "0A" and f"socket:[{f[9]}]" in mine:  # LISTEN, one of this process's sockets
            print(int(f[1].rsplit(":", 1)[1], 16))
"""


def test_the_transfer_engine_listens_only_on_ports_of_the_configured_range():
    available("mooncake")
    low = random.Random().randrange(18000, 32000, 100)
    run = subprocess.run([sys.executable, "-c", LISTENING, f"{low}-{low + 19}"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    ports = [int(p) for p in run.stdout.split()]
    assert len(ports) == 2, (ports, run.stderr[-2000:])  # its handshake listener and its data listener
    assert all(low <= p <= low + 19 for p in ports), ports

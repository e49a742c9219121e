"""The `mooncake` transport: Mooncake's own Transfer Engine (wheel `mooncake-transfer-engine-non-cuda`)
moves the block bytes, protocol `rdma` where the host has RDMA NICs and `tcp` otherwise; the ZeroMQ
request/reply of the tcp transport carries the doorbell. Each endpoint registers a staging buffer with
the engine; the receiver of data pulls it from the sender's buffer with one `transfer_sync_read`.

The wheel's top-level package is also called `mooncake`, so it cannot be installed beside ours: `make
mooncake-te` unpacks it into its own directory and `load_transfer_engine()` imports its `engine.so` under
a private name."""

import importlib.util
import logging
import os
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from backends.transports.staged import StagedTransport
from mooncake.addresses import port_range
from mooncake.env import mooncake_te_dir
from mooncake.errors import BackendError, ConfigError

log = logging.getLogger(__name__)
INSTALL_HINT = ("run `make mooncake-te` (Debian packages libibverbs1 ibverbs-providers, then pip install "
                "--no-deps --target <venv>/mooncake-te mooncake-transfer-engine-non-cuda==0.3.13.post1)")
_MODULE = "_mooncake_transfer_engine"
DEFAULT_PORTS = (15000, 17000)  # the Transfer Engine's own default range


def load_transfer_engine():
    """The Transfer Engine's extension module, or a BackendError saying how to install it."""
    return load_wheel_module("engine")


def load_wheel_module(name: str):
    """An extension module of the Mooncake wheel (`engine`, or `store` for Mooncake Store), imported
    from its own directory under a private package name."""
    qualified = f"{_MODULE}.{name}"
    if qualified in sys.modules:
        return sys.modules[qualified]
    directory = mooncake_te_dir() / "mooncake"
    library = directory / f"{name}.so"
    if not library.exists():
        raise BackendError(f"transport 'mooncake' needs Mooncake's Transfer Engine, not found at {library}: "
                           f"{INSTALL_HINT}")
    if _MODULE not in sys.modules:
        package = types.ModuleType(_MODULE)
        package.__path__ = [str(directory)]
        sys.modules[_MODULE] = package
    spec = importlib.util.spec_from_file_location(qualified, library)
    try:
        # NOTE: module_from_spec is what dlopens an extension module, so a missing libibverbs.so.1
        # surfaces here, not in exec_module.
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise BackendError(f"transport 'mooncake': cannot load {library} ({exc}): {INSTALL_HINT}") from None
    sys.modules[qualified] = module
    return module


RDMA_SYSFS = Path("/sys/class/infiniband")


def check_rdma_devices(devices: tuple[str, ...], sysfs: Path = RDMA_SYSFS) -> None:
    """A ConfigError naming the key unless this host has the RDMA devices `transport.rdma_devices` names
    (or any, when it names none)."""
    found = sorted(p.name for p in sysfs.iterdir()) if sysfs.is_dir() else []
    if not found:
        raise ConfigError(f"config key 'transport.protocol' is 'rdma' but this host has no RDMA devices "
                          f"({sysfs} is empty); use protocol = \"tcp\" here")
    missing = [d for d in devices if d not in found]
    if missing:
        raise ConfigError(f"config key 'transport.rdma_devices' names {', '.join(missing)}, not on this host "
                          f"(found: {', '.join(found)})")


class MooncakeTransport(StagedTransport):
    name = "mooncake"

    def __init__(self, tamper=None, host: str = "127.0.0.1", protocol: str = "tcp",
                 staging_bytes: int = 256 << 20, rdma_devices: tuple[str, ...] = (),
                 metadata_server: str = "P2PHANDSHAKE", te_ports: str = ""):
        if protocol == "rdma":
            check_rdma_devices(rdma_devices)
        ports = port_range(te_ports) or DEFAULT_PORTS
        # NOTE: the Transfer Engine reads its port range from the environment once, when it is loaded
        os.environ["MC_MIN_RPC_PORT"], os.environ["MC_MAX_RPC_PORT"] = str(ports[0]), str(ports[1])
        engine = load_transfer_engine()
        super().__init__(tamper=tamper, host=host)
        self.engine = engine.TransferEngine()
        if self.engine.initialize(host, metadata_server, protocol, ",".join(rdma_devices)) != 0:
            raise BackendError(f"transport 'mooncake': Transfer Engine failed to start ({protocol} on {host}, "
                               f"metadata {metadata_server}, ports {ports[0]}-{ports[1]} (transport.te_ports): "
                               f"two free ones are needed per endpoint)")
        self.session = f"{host}:{self.engine.get_rpc_port()}"
        # NOTE: it binds every interface whatever `host` is (it has no setting for that): say so, with the ports
        log.info("mooncake transport: the Transfer Engine listens on every interface, not only %s: its handshake "
                 "port %d and a data port in %d-%d (transport.te_ports; firewall them from outside the cluster). "
                 "Its start-up lines 'No RDMA devices found' (protocol tcp) and 'Local segment descriptor not "
                 "found' are expected", host, self.engine.get_rpc_port(), ports[0], ports[1])
        buffer = np.zeros(staging_bytes, dtype=np.uint8)
        if self.engine.register_memory(buffer.ctypes.data, staging_bytes) != 0:
            raise BackendError("transport 'mooncake': cannot register the staging buffer")
        self._init_staging(buffer, buffer.ctypes.data)

    @classmethod
    def from_config(cls, config, host):
        return cls(host=host, protocol=config.protocol, rdma_devices=config.rdma_devices,
                   metadata_server=config.metadata_server, te_ports=config.te_ports)

    def _locator(self):
        return {"session": self.session}

    @contextmanager
    def _incoming(self, header, frames):
        total = sum(header["sizes"])
        offset = self._stage(total)
        try:
            if total and self.engine.transfer_sync_read(header["session"], self.base_address + offset,
                                                        header["addr"], total) != 0:
                raise ValueError(f"Transfer Engine read of {total} bytes from {header['session']} failed")
            view = memoryview(self.buffer)[offset:offset + total]
            blocks, cursor = [], 0
            for n in header["sizes"]:
                blocks.append(view[cursor:cursor + n])
                cursor += n
            yield blocks
        finally:
            self._unstage(offset)

    async def stop(self) -> None:
        await super().stop()
        try:
            self.engine.unregister_memory(self.base_address)
        except (RuntimeError, AttributeError) as exc:
            log.debug("unregister_memory: %s", exc)

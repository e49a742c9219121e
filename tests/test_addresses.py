"""What a role tells its peers: never a wildcard; this host's address on the route to the conductor."""

import pytest

from mooncake.addresses import advertise_host, advertised, route_source
from mooncake.config import load_config
from mooncake.errors import ConfigError


@pytest.mark.parametrize("bound, expect", [
    ("tcp://0.0.0.0:7800", "tcp://198.18.0.3:7800"),
    ("tcp://*:7800", "tcp://198.18.0.3:7800"),
    ("tcp://198.18.0.9:7800", "tcp://198.18.0.9:7800"),
    ("tcp://127.0.0.1:5", "tcp://127.0.0.1:5"),
    ("inproc://x", "inproc://x"),
])
def test_a_wildcard_bind_is_advertised_as_this_hosts_address(bound, expect):
    assert advertised(bound, "198.18.0.3") == expect


def test_a_conductor_on_loopback_means_loopback_and_transport_host_wins():
    assert route_source("tcp://127.0.0.1:7700") == "127.0.0.1"
    assert advertise_host(load_config(None)) == "127.0.0.1"
    assert advertise_host(load_config(None, {"transport.host": "198.18.0.7"})) == "198.18.0.7"


def test_a_wildcard_transport_host_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="transport.host"):
        load_config(None, {"transport.host": "0.0.0.0"})


def test_an_unknown_protocol_is_a_config_error_naming_the_key():
    with pytest.raises(ConfigError, match="transport.protocol"):
        load_config(None, {"transport.protocol": "carrier-pigeon"})


def test_rdma_without_devices_is_a_config_error_naming_the_key(tmp_path):
    from backends.transports.mooncake_te import check_rdma_devices
    with pytest.raises(ConfigError, match="'transport.protocol' is 'rdma' but this host has no RDMA devices"):
        check_rdma_devices((), sysfs=tmp_path / "absent")
    (tmp_path / "mlx5_0").mkdir()
    check_rdma_devices((), sysfs=tmp_path)
    check_rdma_devices(("mlx5_0",), sysfs=tmp_path)
    with pytest.raises(ConfigError, match="transport.rdma_devices.*mlx5_9.*found: mlx5_0"):
        check_rdma_devices(("mlx5_9",), sysfs=tmp_path)


def test_default_instance_ids_carry_the_host_name(monkeypatch):
    import socket

    from mooncake.decode.worker import DecodeWorker
    monkeypatch.setattr(socket, "gethostname", lambda: "node-a")
    worker = DecodeWorker(load_config(None))
    assert worker.instance_id.startswith("decode-node-a-")

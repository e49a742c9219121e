"""The SSD tier owns its directory (issue: it trusted `/var/tmp/mooncake-ssd`: a directory pre-created by
another user was accepted, a planted block was indexed and served, a link at the predictable temp name
made the node overwrite a file of the attacker's choice, and block files were 0644). Also shm: a peer's
segment is never opened through a link."""

import os
import stat
import uuid

import pytest

from backends.storage import ssd
from backends.storage.ssd import SsdTier
from mooncake import security
from mooncake.config import load_config
from mooncake.errors import ConfigError

CAPACITY = 1 << 20


def _keys(directory):
    security.generate_keys(directory)
    security.configure(load_config(None, {"security.keys_dir": str(directory)}))


@pytest.fixture
def keyed(tmp_path):
    _keys(tmp_path / "keys")
    yield
    security.reset()


def test_a_missing_directory_is_made_0700(tmp_path):
    SsdTier(tmp_path / "deep" / "ssd", CAPACITY, fsync=False)
    assert stat.S_IMODE((tmp_path / "deep" / "ssd").stat().st_mode) == 0o700


def test_a_directory_others_may_write_is_refused(tmp_path):
    directory = tmp_path / "shared"
    directory.mkdir()
    os.chmod(directory, 0o777)
    with pytest.raises(ConfigError, match="store.ssd_dir.*writable by others"):
        SsdTier(directory, CAPACITY)


@pytest.mark.skipif(os.geteuid() != 0, reason="handing a directory to another user needs root")
def test_a_directory_of_another_user_is_refused(tmp_path):
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)  # nobody's
    with pytest.raises(ConfigError, match="store.ssd_dir.*belongs to uid 65534"):
        SsdTier(directory, CAPACITY)


def test_a_link_for_a_directory_is_refused(tmp_path):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ConfigError, match="not a directory"):
        SsdTier(tmp_path / "link", CAPACITY)


def test_links_at_temp_names_are_never_written_through(tmp_path):
    """Before, the temp name was `<key>.blk.tmp<pid>`: a link planted there made the node write the file
    it pointed to."""
    directory = tmp_path / "ssd"
    tier = SsdTier(directory, CAPACITY, fsync=False)
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    for key in range(4):
        (directory / f"{key:016x}{ssd.SUFFIX}.tmp{os.getpid()}").symlink_to(victim)
    for key in range(4):
        assert tier.put(key, bytes([key]) * 1000)
    assert victim.read_bytes() == b"precious"
    for key in range(4):
        assert bytes(tier.get(key)) == bytes([key]) * 1000


def test_block_files_are_private(tmp_path):
    tier = SsdTier(tmp_path / "ssd", CAPACITY, fsync=False)
    tier.put(1, b"x" * 100)
    (path,) = (tmp_path / "ssd").glob("*" + ssd.SUFFIX)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_planted_block_without_the_cluster_key_is_never_served(tmp_path, keyed):
    """A file in the tier's own format, checksum right, written by someone without the cluster's key."""
    directory = tmp_path / "ssd"
    SsdTier(directory, CAPACITY, fsync=False)
    data = b"forged kv" * 100
    header = ssd.HEADER.pack(ssd.MAGIC, ssd.VERSION, 7, len(data), ssd.checksum(data))
    (directory / f"{7:016x}{ssd.SUFFIX}").write_bytes(header + bytes(ssd.MAC.size) + data)
    tier = SsdTier(directory, CAPACITY, fsync=False)
    assert 7 not in tier and tier.num_dropped_on_start == 1
    tier.put(8, data)  # what the cluster writes, it reads back
    assert bytes(SsdTier(directory, CAPACITY, fsync=False).get(8)) == data


def test_blocks_written_under_another_key_are_dropped(tmp_path, keyed):
    directory = tmp_path / "ssd"
    SsdTier(directory, CAPACITY, fsync=False).put(3, b"kv" * 100)
    _keys(tmp_path / "other-keys")  # another cluster's keys, same directory
    tier = SsdTier(directory, CAPACITY, fsync=False)
    assert 3 not in tier and tier.num_dropped_on_start == 1


def test_links_and_oversized_files_at_block_names_are_dropped_unread(tmp_path):
    directory = tmp_path / "ssd"
    tier = SsdTier(directory, CAPACITY, fsync=False)
    tier.put(1, b"a" * 100)
    elsewhere = tmp_path / "elsewhere.blk"
    os.replace(directory / f"{1:016x}{ssd.SUFFIX}", elsewhere)  # a valid block, outside the directory
    (directory / f"{1:016x}{ssd.SUFFIX}").symlink_to(elsewhere)
    with open(directory / f"{2:016x}{ssd.SUFFIX}", "wb") as f:
        f.truncate(64 * CAPACITY)  # sparse: a read of it would take 64 MiB
    again = SsdTier(directory, CAPACITY, fsync=False)
    assert list(again.keys()) == [] and again.num_dropped_on_start == 2
    assert elsewhere.exists() and not os.listdir(directory)  # the link went, not what it pointed to


def test_shm_never_maps_a_peer_segment_through_a_link(tmp_path):
    from backends.transports.shm import PREFIX, SHM_DIR, ShmTransport
    transport = ShmTransport(segment_bytes=1 << 20)
    target = tmp_path / "not-a-segment"
    target.write_bytes(bytes(4096))
    link = SHM_DIR / f"{PREFIX}test-{uuid.uuid4().hex}"
    link.symlink_to(target)
    try:
        with pytest.raises(OSError):
            transport._peer_view(str(link))
        with pytest.raises(OSError):
            transport._peer_view(str(link), writable=True)
    finally:
        link.unlink()
        transport.path.unlink(missing_ok=True)  # its mapping goes with the object


def test_a_failed_write_leaves_no_temp_file(tmp_path, monkeypatch):
    tier = SsdTier(tmp_path / "ssd", CAPACITY, fsync=True)

    def full(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ssd.os, "fsync", full)
    for key in range(3):
        with pytest.raises(OSError):
            tier.put(key, b"x" * 1000)
    assert os.listdir(tmp_path / "ssd") == [] and tier.used_bytes == 0


def test_a_fifo_at_a_block_name_is_dropped_without_blocking(tmp_path):
    directory = tmp_path / "ssd"
    SsdTier(directory, CAPACITY, fsync=False)
    os.mkfifo(directory / f"{3:016x}{ssd.SUFFIX}")  # opening it for reading would wait for a writer
    again = SsdTier(directory, CAPACITY, fsync=False)
    assert list(again.keys()) == [] and again.num_dropped_on_start == 1

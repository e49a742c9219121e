"""Loading Mooncake's Transfer Engine: a library that cannot load (libibverbs missing, a broken unpack)
is a BackendError with the install line, never a raw ImportError, so tests skip and users get a hint."""

import pytest

from mooncake.errors import BackendError


def test_an_engine_library_that_cannot_load_is_a_backend_error_with_the_install_hint(tmp_path, monkeypatch):
    from backends.transports import mooncake_te
    # NOTE: not an ELF file, so dlopen fails in module_from_spec as a missing libibverbs.so.1 does.
    (tmp_path / "mooncake").mkdir()
    (tmp_path / "mooncake" / "broken.so").write_bytes(b"not a shared object")
    monkeypatch.setenv("MOONCAKE_TE_DIR", str(tmp_path))
    with pytest.raises(BackendError) as caught:
        mooncake_te.load_wheel_module("broken")
    assert "make mooncake-te" in str(caught.value) and "libibverbs1" in str(caught.value)


def test_a_missing_engine_is_a_backend_error_naming_where_it_looked(tmp_path, monkeypatch):
    from backends.transports import mooncake_te
    monkeypatch.setenv("MOONCAKE_TE_DIR", str(tmp_path))
    with pytest.raises(BackendError, match=str(tmp_path)):
        mooncake_te.load_wheel_module("absent")

"""The one place mooncake reads environment variables."""

import os
from pathlib import Path


def mooncake_home() -> Path:
    """Cache root for fetched and converted models: `$MOONCAKE_HOME`, else `~/.cache/mooncake`."""
    home = os.environ.get("MOONCAKE_HOME")
    if home:
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "mooncake"


def log_level() -> str:
    """Logging level from `MOONCAKE_LOG` (default INFO)."""
    return os.environ.get("MOONCAKE_LOG", "INFO").upper()


def offline_hub() -> None:
    """Keep transformers off the network and quiet: every model loads from a local directory."""
    # NOTE: there is no model hub on our machines; a hub lookup would only hang until it times out.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def mooncake_te_dir() -> Path:
    """Where Mooncake's Transfer Engine wheel is unpacked (`make mooncake-te`): `$MOONCAKE_TE_DIR`, else
    `mooncake-te/` inside the running Python environment. Kept off sys.path on purpose: the wheel's
    top-level package is also named `mooncake`."""
    import sys
    configured = os.environ.get("MOONCAKE_TE_DIR")
    return Path(configured).expanduser() if configured else Path(sys.prefix) / "mooncake-te"


def cpu_flags() -> set[str]:
    """This CPU's feature flags (/proc/cpuinfo); empty where they cannot be read (not Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((set(line.split(":", 1)[1].split()) for line in f if line.startswith("flags")), set())
    except OSError:
        return set()

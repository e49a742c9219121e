"""The layering rule of mooncake/ARCHITECTURE.md, checked on the source (every import, lazy ones in
functions included):

- the shared layer imports no role, only itself and the contracts;
- a role imports the shared layer, the contracts and its own package, never a sibling role's internals;
  the exceptions are named here, each with its reason, and ARCHITECTURE.md lists the same;
- nothing in mooncake/ imports a backend: backends are found by name through `registry.py`;
- no role reaches the engine but through its one door, `instance/engine_loop.py`; the launchers
  (`cli.py`, `dev.py`) and the backends' contract (`engine/runner.py`) aside;
- a backend imports the shared layer and the contracts."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROLES = {"api", "conductor", "prefill", "decode", "instance", "transfer", "store", "engine", "sim"}
LAUNCHERS = {"mooncake.cli", "mooncake.dev", "mooncake.__main__"}
CONTRACTS = {
    "mooncake.transfer.contract",  # a transport backend's contract
    "mooncake.store.tier",  # a storage backend's contract
    "mooncake.engine.runner", "mooncake.engine.modelled_time",  # a model backend's contract, its emulated time
    "mooncake.store.client",  # the cache pool as its callers (prefill and decode instances) see it
    "mooncake.sim.config",  # the simulator's settings, part of the config schema
    # the transport contract's kit, shared by every transport backend (and the cache node's shm windows),
    # and the modelled network an emulated instance wraps its transports in
    "mooncake.transfer.framing", "mooncake.transfer.windows", "mooncake.transfer.passes",
    "mooncake.transfer.modelled",
}
# (importer's package or module, imported module or package): why the rule allows it
EXCEPTIONS = {
    ("mooncake", "mooncake.engine"): "the package's public mooncake.LLMEngine, imported lazily on first use",
    ("mooncake.prefill", "mooncake.instance"): "what prefill and decode instances share",
    ("mooncake.decode", "mooncake.instance"): "what prefill and decode instances share",
    ("mooncake.instance.engine_loop", "mooncake.engine"): "the one door into the engine",
    ("mooncake.sim", "mooncake.conductor"): "the simulator runs the conductor's own decision code",
    ("mooncake.sim", "mooncake.store.eviction"): "the simulator runs the cache node's eviction policies",
    ("backends.storage.dram", "backends.transports.shm"): "a DRAM tier in shared memory uses shm's segments",
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in list((ROOT / "mooncake").rglob("*.py")) + list((ROOT / "backends").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The modules of ours that `name` imports: for `from a.b import c`, a.b.c where that is a module."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = name.split(".")[: len(name.split(".")) - node.level + is_package]
                base = ".".join(package + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target:
                out.add(target)
    return out


def _component(module: str) -> str:
    """'shared', 'contract', 'launcher', 'backends', or the role's package name."""
    if module in CONTRACTS:
        return "contract"
    if module in LAUNCHERS:
        return "launcher"
    if module.startswith("backends"):
        return "backends"
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in ROLES else "shared"


def _excepted(importer: str, imported: str) -> bool:
    """Whether an exception covers it: a package covers its modules (the top package only itself)."""
    def covers(name: str, module: str) -> bool:
        return module == name or ("." in name and module.startswith(name + "."))
    return any(covers(a, importer) and (imported == b or imported.startswith(b + ".")) for a, b in EXCEPTIONS)


def _violation(importer: str, imported: str) -> str | None:
    src, dst = _component(importer), _component(imported)
    if src == "launcher" or dst in ("shared", "contract") and not imported.startswith("backends"):
        return None
    if _excepted(importer, imported):
        return None
    if dst == "backends":
        if src == "backends" and importer.split(".")[1] == imported.split(".")[1]:
            return None  # a backend's own kind
        if src == "backends" and importer.startswith("backends.models") and imported.startswith("backends.kernels"):
            return None  # the model backends' kernels
        return "mooncake reaches backends only by name, through registry.py"
    if src == "backends":
        return "a backend imports only the shared layer and the contracts"
    if src in ("shared", "contract"):
        return "the shared layer and the contracts import no role"
    if src != dst:
        return f"the {src} role imports the {dst} role's internals"
    return None


def test_the_modules_were_found():
    assert {"mooncake.config", "mooncake.instance.engine_loop", "backends.models.llama"} <= set(MODULES)
    assert "mooncake.engine.stage" in _imports("mooncake.instance.engine_loop", MODULES["mooncake.instance.engine_loop"])


@pytest.mark.parametrize("importer", sorted(MODULES))
def test_every_import_follows_the_layering_rule(importer):
    bad = [f"{importer} imports {imported}: {why}" for imported in sorted(_imports(importer, MODULES[importer]))
           if (why := _violation(importer, imported))]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("importer, imported", [
    ("mooncake.prefill.stages", "mooncake.engine.stage"),  # a role past the engine's door
    ("mooncake.api.server", "mooncake.conductor.service"),  # the API into the conductor
    ("mooncake.store.store", "backends.storage.dram"),  # a backend by import, not by name
    ("mooncake.config", "mooncake.conductor.decide"),  # the shared layer into a role
    ("backends.transports.tcp", "mooncake.prefill.worker"),  # a backend into a role
])
def test_the_rule_catches_what_it_forbids(importer, imported):
    assert _violation(importer, imported) is not None


def _reaches_an_engine(path: Path) -> list[str]:
    """`<something>.engine` attribute reads other than a config's engine section."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == "engine":
            owner = node.value.attr if isinstance(node.value, ast.Attribute) else getattr(node.value, "id", "")
            if "config" not in owner:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_roles_hold_no_engine_but_through_its_loop():
    """The roles reach the engine only through `EngineLoop` (ARCHITECTURE.md: an engine object is never
    touched from the event loop while a step runs): none of them holds or reads an `.engine`."""
    roles = [p for name, p in MODULES.items() if _component(name) in ROLES - {"engine"}
             and name != "mooncake.instance.engine_loop"]
    assert len(roles) > 20
    assert not [hit for path in roles for hit in _reaches_an_engine(path)]
    assert _reaches_an_engine(MODULES["mooncake.instance.engine_loop"])  # the check sees the door's own


MAX_LINES = 450  # STYLE.md aims under ~400; past this, a module holds more than one concern


def test_every_module_is_under_the_line_limit():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) >= MAX_LINES}
    assert not long, f"split these (one concern per module): {long}"

"""The maps stay true to the code: the README's layout table names every module and nothing that is
gone, ARCHITECTURE.md names only files that exist, and every "DESIGN section N" the code cites is a
section of the shipped mooncake/DESIGN.md."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(p.relative_to(ROOT) for top in ("mooncake", "backends") for p in (ROOT / top).rglob("*.py")
                 if p.name != "__init__.py")


def _layout_table() -> str:
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Layout")
    return readme[start:readme.index("\n## ", start + 1)]


def _names(text: str) -> set[str]:
    """Every `x/y.py` or `y.py`-like name in backquotes, braces expanded (`a/{b,c}.py`)."""
    names = set()
    for quoted in re.findall(r"`([^`\s]+)`", text):
        for whole in re.findall(r"[\w./{},-]*\w\.(?:py|c|md|toml)\b", quoted):
            if m := re.fullmatch(r"(.*)\{([\w,]+)\}(.*)", whole):
                names.update(m[1] + part + m[3] for part in m[2].split(","))
            else:
                names.add(whole)
    return names


def test_the_readme_layout_table_names_every_module():
    table = _layout_table()
    named = _names(table) | {n for n in re.findall(r"\b\w+\.py\b", table)}
    missing = [str(p) for p in MODULES if str(p) not in named and p.name not in named]
    assert not missing, f"modules the README's layout table does not name: {missing}"


def test_every_file_the_maps_name_exists():
    """A name in the README's layout table or ARCHITECTURE.md is a file of the repository (by path, or
    by file name somewhere in it)."""
    files = [p.relative_to(ROOT) for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts
             and ".git" not in p.parts]
    paths, basenames = {str(p) for p in files}, {p.name for p in files}
    architecture = (ROOT / "mooncake/ARCHITECTURE.md").read_text()
    for doc, text in (("README.md", _layout_table()), ("ARCHITECTURE.md", architecture)):
        stale = [n for n in _names(text) if n not in paths and f"mooncake/{n}" not in paths
                 and f"backends/{n}" not in paths and n.split("/")[-1] not in basenames]
        assert not stale, f"{doc} names files that do not exist: {stale}"


def test_every_design_section_the_code_cites_is_in_the_shipped_design():
    sections = set(re.findall(r"^## (\d+)\.", (ROOT / "mooncake/DESIGN.md").read_text(), re.M))
    cited = {}
    for path in [*ROOT.glob("mooncake/**/*"), *ROOT.glob("backends/**/*"), *ROOT.glob("scripts/*"),
                 *ROOT.glob("configs/**/*"), ROOT / "README.md"]:
        if path.is_file() and path.suffix in (".py", ".md", ".toml"):
            for number in re.findall(r"DESIGN(?:\.md)?,? section (\d+)", path.read_text()):
                cited.setdefault(number, path.relative_to(ROOT))
    assert cited and not {n: str(p) for n, p in cited.items() if n not in sections}

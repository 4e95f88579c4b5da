"""The house (docs/architecture.md, the import contracts in pyproject.toml): one folder a stage, the stages in one order,
no module over 450 lines, and the map in docs/architecture.md true to the tree. `make lint` runs the contracts
themselves (lint-imports); these tests hold what the contracts cannot say: the whole import graph -- imports inside
functions and type-only ones included -- runs up against the stages only where the contract's ignore list says why, and
has at most one cycle."""

import ast
import re
import tomllib

import grimp
import pytest
from conftest import ROOT

PKG = ROOT / "sftrecipes"
CONTRACTS = {c["id"]: c for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]}
DOC = (ROOT / "docs" / "architecture.md").read_text()


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("sftrecipes", cache_dir=None)


def _floors() -> dict[str, int]:
    """Each stage (a sub-package, or a top-level module) -> its floor, 0 the lowest."""
    layers = CONTRACTS["stages"]["layers"]
    return {m.strip(): len(layers) - 1 - i for i, layer in enumerate(layers) for m in re.split(r"[:|]", layer)}


def _stage(module: str, floors: dict[str, int]) -> str | None:
    parts = module.split(".")
    return next((k for k in (".".join(parts[:2]), parts[0]) if k in floors), None)


def _modules() -> list[str]:
    return sorted(p.relative_to(PKG).as_posix() for p in PKG.rglob("*.py"))


def _rooms() -> list[str]:
    """The modules the map must list: every one but a package's __init__.py that holds only its docstring."""
    def docstring_only(p):
        body = [n for n in ast.parse(p.read_text()).body]
        return p.name == "__init__.py" and len(body) <= 1
    return [m for m in _modules() if not docstring_only(PKG / m)]


def test_every_module_is_in_a_stage_and_the_top_holds_only_entry_points(graph):
    floors = _floors()
    unplaced = [m for m in graph.modules if m != "sftrecipes" and _stage(m, floors) is None and m != "sftrecipes.__main__"]
    assert not unplaced, f"modules in no stage of the 'stages' contract: {unplaced}"
    top = [m for m in _modules() if "/" not in m]
    assert len(top) <= 8, f"sftrecipes/ itself holds {len(top)} modules (at most 8: the entry points): {top}"


def test_the_graph_runs_up_only_where_the_contract_says_why(graph):
    floors = _floors()
    ignored = {tuple(s.strip() for s in line.split("->")) for line in CONTRACTS["stages"]["ignore_imports"]}
    up = []
    for importer in sorted(graph.modules):
        for imported in graph.find_modules_directly_imported_by(importer):
            a, b = _stage(importer, floors), _stage(imported, floors)
            if a and b and floors[b] > floors[a]:
                up.append((importer, imported))
    assert len(up) <= 4, f"{len(up)} imports run up against the stages: {up}"
    assert set(up) <= ignored, f"imports running up that the contract's ignore list does not name: {set(up) - ignored}"


def test_the_import_graph_has_at_most_one_cycle(graph):
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in sorted(graph.modules):
        if m not in index:
            visit(m)
    assert len(cycles) <= 1, f"{len(cycles)} import cycles: {cycles}"


def test_no_module_is_over_450_lines():
    long = {m: n for m in _modules() if (n := len((PKG / m).read_text().splitlines())) > 450}
    assert not long, f"modules over 450 lines: {long}"


def test_architecture_md_names_every_module_and_only_those():
    rooms = DOC.split("## Rooms", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `([\w/]+\.py)` \|", rooms, flags=re.M))
    modules = set(_rooms())
    assert not modules - listed, f"modules docs/architecture.md's Rooms do not list: {sorted(modules - listed)}"
    assert not listed - modules, f"docs/architecture.md lists modules that do not exist: {sorted(listed - modules)}"
    for line in DOC.splitlines():  # the drawing of the floors names each stage once
        if line.startswith("**Torch-free**"):
            named = {"sftrecipes." + n.strip("/").removesuffix(".py").replace("/", ".") for n in re.findall(r"`([\w/.]+)`", line)}
            assert named == set(CONTRACTS["torch-free"]["source_modules"]), (named, CONTRACTS["torch-free"]["source_modules"])
            break
    else:
        pytest.fail("docs/architecture.md has no '**Torch-free**' line naming the torch-free stages")

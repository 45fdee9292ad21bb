"""The layering of flare/: which folder may import which, read from docs/architecture.md.

Every module of flare/ is parsed with `ast` (imports inside functions and under `TYPE_CHECKING`
count too: they are dependencies all the same). The floors table of docs/architecture.md
("Layers") is the one statement of the layering, so the page and this test cannot drift: a new
folder of flare/ needs only a row there.
"""

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import tests

REPOSITORY = Path(tests.REPOSITORY)
FLARE = REPOSITORY / "flare"
ARCHITECTURE = REPOSITORY / "docs" / "architecture.md"
FLOORS_HEADING = "## Layers"

MAX_MODULES_PER_FOLDER = 15

# A folder's modules are its .py files but __init__.py (the folder itself).


@dataclass(frozen=True)
class Module:
    name: str  # dotted, "flare.engine.model"; a package is its folder's name
    source: str
    is_package: bool

    @property
    def folder(self) -> str | None:
        """The top-level folder of flare/ the module lies in (None for flare/__init__.py)."""
        parts = self.name.split(".")
        return parts[1] if len(parts) > 1 else None


@dataclass(frozen=True)
class Import:
    importer: str
    imported: str
    line: int


def extension_modules() -> list[str]:
    """The C extensions setup.py builds (`flare.engine._native`, ...): modules with no Python source."""
    tree = ast.parse((REPOSITORY / "setup.py").read_text(encoding="utf-8"))
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"flare(\.\w+)+", node.value)
    ]


def flare_modules() -> list[Module]:
    """Every module of flare/ as it is on disk, and the C extensions (as empty sources)."""
    modules = [Module(name, "", is_package=False) for name in extension_modules()]
    for path in sorted(FLARE.rglob("*.py")):
        parts = list(path.relative_to(REPOSITORY).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        modules.append(Module(".".join(parts), path.read_text(encoding="utf-8"), is_package))
    return modules


def flare_imports(modules: list[Module]) -> list[Import]:
    """Each import of one flare module by another, resolved to the module it names."""
    known = {module.name for module in modules}
    imports = []
    for module in modules:
        package = module.name if module.is_package else module.name.rpartition(".")[0]
        for node in ast.walk(ast.parse(module.source, module.name)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                # `from a import b` imports the module a.b when there is one, else a name of a.
                names = [
                    f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in known else origin
                    for alias in node.names
                ]
            else:
                continue
            for name in dict.fromkeys(names):
                if name.split(".")[0] == "flare" and name != module.name:
                    imports.append(Import(module.name, _longest_known(name, known), node.lineno))
    return imports


def _longest_known(name: str, known: set[str]) -> str:
    while name not in known and "." in name:
        name = name.rpartition(".")[0]
    return name


def read_floors(markdown: str) -> list[tuple[str, ...]]:
    """The floors of the "Layers" table, top (the request's entry) first: each a tuple of folders."""
    section = markdown.split(f"\n{FLOORS_HEADING}\n", 1)[1].split("\n## ", 1)[0]
    floors = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or not cells[0].isdigit():
            continue
        floors.append(tuple(re.findall(r"`([a-z_]+)/`", cells[1])))
    return floors


def folder_floors(floors: list[tuple[str, ...]]) -> dict[str, int]:
    return {folder: number for number, folders in enumerate(floors, 1) for folder in folders}


def layering_violations(modules: list[Module], floors: list[tuple[str, ...]]) -> list[str]:
    """Every import from a folder into one on its own floor or above it (floor 1 is the top)."""
    floor_of = folder_floors(floors)
    folder = {module.name: module.folder for module in modules}
    problems = []
    for each in flare_imports(modules):
        source, target = folder[each.importer], folder[each.imported]
        if source is None or target is None or source == target:
            continue
        if floor_of[target] <= floor_of[source]:
            problems.append(
                f"{each.importer}:{each.line} imports {each.imported}: {source}/ is on floor "
                f"{floor_of[source]}, {target}/ on floor {floor_of[target]}"
            )
    return problems


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in edges.get(node, ()):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def module_graph(modules: list[Module]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {module.name: set() for module in modules}
    for each in flare_imports(modules):
        graph[each.importer].add(each.imported)
    return graph


def folder_graph(modules: list[Module]) -> dict[str, set[str]]:
    folder = {module.name: module.folder for module in modules}
    graph: dict[str, set[str]] = {}
    for each in flare_imports(modules):
        source, target = folder[each.importer], folder[each.imported]
        if source is not None and target is not None and source != target:
            graph.setdefault(source, set()).add(target)
    return graph


def top_level_folders() -> set[str]:
    return {path.name for path in FLARE.iterdir() if path.is_dir() and any(path.rglob("*.py"))}


def floors() -> list[tuple[str, ...]]:
    return read_floors(ARCHITECTURE.read_text(encoding="utf-8"))


def test_every_folder_has_one_floor():
    listed = [folder for floor in floors() for folder in floor]
    assert len(listed) == len(set(listed)), f"a folder on two floors: {sorted(listed)}"
    assert set(listed) == top_level_folders(), (
        "docs/architecture.md's Layers table and flare/ disagree: "
        f"only in flare/ {sorted(top_level_folders() - set(listed))}, "
        f"only in the table {sorted(set(listed) - top_level_folders())}"
    )


def test_no_import_against_the_layering():
    assert layering_violations(flare_modules(), floors()) == []


def test_no_circle_between_folders():
    assert circles(folder_graph(flare_modules())) == []


def test_no_circle_between_modules():
    assert circles(module_graph(flare_modules())) == []


def test_a_planted_upward_import_is_reported():
    planted = Module(
        "flare.policy.planted",
        "def scheduler_class():\n    from flare.scheduler.scheduler import Scheduler\n    return Scheduler\n",
        is_package=False,
    )
    problems = layering_violations([*flare_modules(), planted], floors())
    assert [problem for problem in problems if problem.startswith("flare.policy.planted:2 ")] == [
        f"flare.policy.planted:2 imports flare.scheduler.scheduler: policy/ is on floor "
        f"{folder_floors(floors())['policy']}, scheduler/ on floor {folder_floors(floors())['scheduler']}"
    ]


def test_a_planted_import_across_one_floor_is_reported():
    floor_of = folder_floors(floors())
    neighbours = [folders for folders in floors() if len(folders) > 1][0]
    planted = Module(f"flare.{neighbours[0]}.planted", f"import flare.{neighbours[1]}\n", is_package=False)
    problems = layering_violations([*flare_modules(), planted], floors())
    assert any(problem.startswith(f"flare.{neighbours[0]}.planted:1 ") for problem in problems)
    assert floor_of[neighbours[0]] == floor_of[neighbours[1]]


def test_a_planted_circle_is_reported():
    planted = [
        Module("flare.policy.planted_a", "from . import planted_b\n", is_package=False),
        Module("flare.policy.planted_b", "from flare.policy.planted_a import x\n", is_package=False),
    ]
    assert ["flare.policy.planted_a", "flare.policy.planted_b"] in circles(
        module_graph([*flare_modules(), *planted])
    )


def _module_counts() -> dict[str, int]:
    return {
        str(folder.relative_to(FLARE)): len([path for path in folder.glob("*.py") if path.name != "__init__.py"])
        for folder in sorted({path.parent for path in FLARE.rglob("*.py")})
        if folder != FLARE
    }


@pytest.mark.parametrize("folder", list(_module_counts()))
def test_no_folder_holds_more_than_15_modules(folder):
    assert _module_counts()[folder] <= MAX_MODULES_PER_FOLDER

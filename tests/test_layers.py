"""The layers of docs/architecture.md hold: every import points down (or stays in its layer), no
modules import each other in a circle (but the lowering registry, which imports its lowerings
when first asked), the Lightning face stands on ``ipu_backend`` and its seam only, and no runtime
module grows past one idea; the runtime reads the options as ``RunSettings`` only. Imports inside functions count: they would hide a circle."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("ipu_backend", "lightning_ipu")
FOUNDATION = {"ipu_backend.errors", "ipu_backend.enums", "ipu_backend.hardware"}
LAYERS = ("foundation", "compiler", "runtime", "profiling", "api", "lightning")
"""From the bottom up: a module may import its own layer and those below it."""
REGISTRY_IDIOM = "ipu_backend.compiler.registry"
LIGHTNING_MAY_IMPORT = {"ipu_backend", "ipu_backend.lightning_seam"}
RUNTIME_MAX_LINES = 600
OPTIONS_CALLS_IN_THE_RUNTIME = {"for_model", "runtime_settings"}
"""What the runtime may ask of an ``ipu_backend.Options``: a model's frozen copy, and its settings."""


def module_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def imports(name: str, path: Path, modules) -> set[str]:
    """The project modules ``name`` imports, anywhere in it; ``from package import submodule``
    counts as importing the submodule."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules)
    found.discard(name)
    return found


def layer(name: str) -> str:
    if name.startswith("lightning_ipu"):
        return "lightning"
    if name in FOUNDATION:
        return "foundation"
    for inner in ("compiler", "runtime", "profiling"):
        if name.startswith(f"ipu_backend.{inner}"):
            return inner
    return "api"


def graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports(name, path, files) for name, path in files.items()}


def test_every_import_points_down_or_within_a_layer():
    upward = [f"{name} ({layer(name)}) imports {target} ({layer(target)})"
              for name, targets in graph().items() for target in sorted(targets)
              if LAYERS.index(layer(target)) > LAYERS.index(layer(name))]
    assert upward == []


def circles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(component)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_circle_but_the_lowering_registry():
    edges = graph()
    allowed = {n for n in edges if n == REGISTRY_IDIOM or n.startswith("ipu_backend.compiler.lowerings")}
    assert [sorted(c) for c in circles(edges) if not c <= allowed] == []


def test_circles_are_found():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_the_lightning_face_stands_on_the_public_api_and_its_seam():
    files = module_files()
    reached = {(name, target) for name, targets in graph().items() if layer(name) == "lightning"
               for target in targets if layer(target) != "lightning"}
    assert {(name, target) for name, target in reached if target not in LIGHTNING_MAY_IMPORT} == set()
    uses_jax = [name for name, path in files.items() if layer(name) == "lightning"
                and any(isinstance(node, (ast.Import, ast.ImportFrom))
                        and any((getattr(node, "module", None) or alias.name).split(".")[0] == "jax"
                                for alias in node.names)
                        for node in ast.walk(ast.parse(path.read_text())))]
    assert uses_jax == []


def test_no_runtime_module_is_over_the_size_of_one_idea():
    long = {path.name: n for path in (ROOT / "ipu_backend/runtime").glob("*.py")
            if (n := len(path.read_text().splitlines())) > RUNTIME_MAX_LINES}
    assert long == {}


def is_options(node: ast.expr) -> bool:
    """Whether ``node`` is an executor's options as the runtime spells them (``self._options``,
    ``executor.options``)."""
    return isinstance(node, ast.Attribute) and node.attr in ("options", "_options")


def test_the_runtime_reads_the_options_as_run_settings():
    reads = [f"{path.name}:{node.lineno} .{node.attr}" for path in sorted((ROOT / "ipu_backend/runtime").glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and is_options(node.value)
             and node.attr not in OPTIONS_CALLS_IN_THE_RUNTIME]
    assert reads == []

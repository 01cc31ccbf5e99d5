"""The package stays walkable: layers import one way, no cycles, short functions, Lightning's privates in one folder.

Each test fails naming the offending file, line and import or name.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from pathlib import Path

import ray_lightning
from ray_lightning._lightning import PRIVATE_NAMES
from ray_lightning._lightning.connector import WRAPPED

PACKAGE = Path(ray_lightning.__file__).parent
# Lowest first: a module may import its own layer's package and the layers below it, nothing above.
LAYERS = [
    "namespaces",
    "errors",
    "config",
    "environment",
    "runtime",
    "_lightning",
    "channel",
    "home",
    "launch",
    "strategies",
    "horovod",
    "tune",
    "__init__",
]
LIGHTNING_PACKAGES = ("pytorch_lightning", "lightning_fabric", "lightning")
MAX_FUNCTION_LINES = 60


def _modules() -> Iterator[tuple[str, Path]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path


MODULES = dict(_modules())


def _where(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent)) if path.is_relative_to(PACKAGE.parent) else str(path)


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _resolve(name: str) -> str:
    """The most specific package module ``name`` refers to (a module, or the package holding a name)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, module)`` for every ray_lightning module a file imports, function-local imports included."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "ray_lightning":
                    yield node.lineno, _resolve(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ray_lightning":
            for alias in node.names:
                yield node.lineno, _resolve(f"{node.module}.{alias.name}")


def test_layers_import_only_downwards():
    offending = []
    for module, path in MODULES.items():
        mine = LAYERS.index(_layer(module))
        for line, target in _imports(path):
            theirs = LAYERS.index(_layer(target))
            if theirs > mine or (target == "ray_lightning" and module != "ray_lightning"):
                offending.append(f"{_where(path)}:{line} imports {target} (a higher layer)")
    assert not offending, "\n".join(offending)


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for module, path in MODULES.items():
        for _, target in _imports(path):
            graph[module].add(target)
            # Importing a.b.c runs a/__init__ and a/b/__init__ too, unless the importer is inside them.
            parent = target
            while "." in parent:
                parent = parent.rsplit(".", 1)[0]
                if parent in MODULES and not module.startswith(parent + ".") and parent != "ray_lightning":
                    graph[module].add(parent)
    for module in graph:
        graph[module].discard(module)
    return graph


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def test_functions_are_short():
    long = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long.append(f"{_where(path)}:{node.lineno} {node.name} has {length} lines")
    assert not long, "\n".join(long)


# Private Lightning names: every one we rely on is in ray_lightning._lightning.PRIVATE_NAMES.
_PRIVATE_ATTRIBUTES = {p.name.split(".")[0] for p in PRIVATE_NAMES if p.name.startswith("_")} | set(WRAPPED)


def _is_private_path(value: object) -> bool:
    """A dotted path with a private part, as given to ``Namespace.pl`` (``"core.optimizer._MockOptimizer"``)."""
    parts = value.split(".") if isinstance(value, str) else []
    return len(parts) > 1 and all(p.isidentifier() for p in parts) and any(p.startswith("_") for p in parts)


def test_private_lightning_names_only_in_the_lightning_folder():
    offending = []
    for module, path in MODULES.items():
        if _layer(module) == "_lightning":
            continue
        where = _where(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIGHTNING_PACKAGES:
                private = [a.name for a in node.names if a.name.startswith("_")]
                private += [p for p in node.module.split(".") if p.startswith("_")]
                offending += [f"{where}:{node.lineno} imports {node.module}.{p}" for p in private]
            elif isinstance(node, ast.Attribute) and node.attr in _PRIVATE_ATTRIBUTES:
                offending.append(f"{where}:{node.lineno} uses Lightning's private .{node.attr}")
            elif isinstance(node, ast.FunctionDef) and node.name in _PRIVATE_ATTRIBUTES:
                offending.append(f"{where}:{node.lineno} overrides Lightning's private {node.name}")
            elif isinstance(node, ast.Constant) and _is_private_path(node.value):
                offending.append(f"{where}:{node.lineno} looks up Lightning's private {node.value!r}")
    assert not offending, "\n".join(offending)


def _package_classes() -> Iterator[type]:
    for info in pkgutil.walk_packages(ray_lightning.__path__, "ray_lightning."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__:
                yield cls


def _is_lightning(cls: type) -> bool:
    return cls.__module__.split(".")[0] in LIGHTNING_PACKAGES


def _marked(member: object) -> bool:
    if isinstance(member, property):
        return all(getattr(f, "__override__", False) for f in (member.fget, member.fset) if f is not None)
    if isinstance(member, (staticmethod, classmethod)):
        member = member.__func__
    return getattr(member, "__override__", False)


def test_every_lightning_override_is_marked():
    unmarked = []
    for cls in _package_classes():
        lightning_bases = [b for b in cls.__mro__ if _is_lightning(b)]
        if not lightning_bases:
            continue
        for ours in (b for b in cls.__mro__ if b.__module__.startswith("ray_lightning.")):
            for name, member in vars(ours).items():
                if name.startswith("__") or not callable(getattr(member, "__get__", None)):
                    continue
                if any(name in vars(base) for base in lightning_bases) and not _marked(member):
                    unmarked.append(f"{ours.__module__}.{ours.__qualname__}.{name} (overrides Lightning's)")
    assert not unmarked, "missing @override:\n" + "\n".join(sorted(set(unmarked)))


def test_the_checks_can_fail(tmp_path, monkeypatch):
    # A module of a low layer importing a higher one, and a private Lightning import, are found.
    bad = PACKAGE / "config.py"
    source = bad.read_text() + (
        "\nfrom ray_lightning.launch import launcher\nfrom lightning_fabric.x import _y\n"
        "MOCK = 'core.optimizer._MockOptimizer'\n"
    )
    fake = tmp_path / "config.py"
    fake.write_text(source)
    monkeypatch.setitem(MODULES, "ray_lightning.config", fake)
    try:
        test_layers_import_only_downwards()
    except AssertionError as error:
        assert "imports ray_lightning.launch.launcher (a higher layer)" in str(error)
    else:
        raise AssertionError("a downward-only check that cannot fail")
    try:
        test_private_lightning_names_only_in_the_lightning_folder()
    except AssertionError as error:
        assert "imports lightning_fabric.x._y" in str(error)
        assert "looks up Lightning's private 'core.optimizer._MockOptimizer'" in str(error)
    else:
        raise AssertionError("a private-name check that cannot fail")

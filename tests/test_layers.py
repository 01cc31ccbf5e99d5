"""The package stays walkable: layers import one way, no cycles, short functions, each library's privates in one folder.

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
from ray_lightning import _ray, _torch
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
    "_torch",
    "_ray",
    "_lightning",
    "channel",
    "home",
    "data",
    "launch",
    "strategies",
    "fabric",
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


MAX_MODULE_LINES = 400  # issue 39: a module a reader can hold; split one along jobs a reader can name


def test_modules_are_short():
    long = [
        f"{_where(p)} has {n} lines"
        for p in MODULES.values()
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, "\n".join(long)


# Private Lightning names: every one we rely on is in ray_lightning._lightning.PRIVATE_NAMES.
_PRIVATE_ATTRIBUTES = {p.name.split(".")[0] for p in PRIVATE_NAMES if p.name.startswith("_")} | set(WRAPPED)


def _is_private_part(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def _is_dotted(value: object) -> bool:
    parts = value.split(".") if isinstance(value, str) else []
    return len(parts) > 1 and all(p.isidentifier() for p in parts)


def _is_private_path(value: object) -> bool:
    """A dotted path with a private part, as given to ``Namespace.pl`` (``"core.optimizer._MockOptimizer"``)."""
    return _is_dotted(value) and any(p.startswith("_") for p in value.split("."))


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
            elif isinstance(node, ast.Constant) and _is_private_path(node.value) and _library(node.value) is None:
                offending.append(f"{where}:{node.lineno} looks up Lightning's private {node.value!r}")
    assert not offending, "\n".join(offending)


# Private Ray and torch names: each library's only in its own folder, whose PRIVATE_NAMES lists them.
# Found: imports of private modules and names, attribute chains through them (``ray._private.worker``),
# dotted private paths in strings, and the private attribute names of the lists (``._opt_called``,
# ``getattr(x, "_lock")``) on anything: a name of ours that collides with one needs another name.
# library: (its folder, how messages name it, its private names)
FENCES = {"ray": ("_ray", "Ray", _ray.PRIVATE_NAMES), "torch": ("_torch", "torch", _torch.PRIVATE_NAMES)}
# Ray's modules that are private as a whole, though no part of their names starts with "_".
RAY_PRIVATE_MODULES = ("ray.experimental", "ray.core.generated")
# Private attribute names (``_opt_called``, ``_lock``...) of the fences' lists: which library each is of.
_LIBRARY_ATTRIBUTES = {
    part: library
    for library, (_, _, names) in FENCES.items()
    for private in names
    for part in private.name.split(".")
    if _is_private_part(part)
}
_ATTRIBUTE_FUNCTIONS = ("getattr", "setattr", "hasattr", "delattr")


def _library(dotted: str) -> str | None:
    """The library (a key of FENCES) a dotted module path belongs to, if one of them."""
    root = dotted.split(".")[0]
    return root if root in FENCES else None


def _is_private_module(dotted: str) -> bool:
    """``ray._private.state``, ``torch.distributed.algorithms._checkpoint``, ``ray.experimental.internal_kv``."""
    if any(_is_private_part(part) for part in dotted.split(".")):
        return True
    return any(dotted == m or dotted.startswith(m + ".") for m in RAY_PRIVATE_MODULES)


def _chain(node: ast.AST) -> str | None:
    """``"a.b.c"`` for an attribute chain on a name (``ray._private.worker``), else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def _import_uses(node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    """The private Ray or torch modules and names an import statement imports."""
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names if _library(a.name) and _is_private_module(a.name))
    elif node.module and not node.level and _library(node.module):
        yield from (name for name in (f"{node.module}.{a.name}" for a in node.names) if _is_private_module(name))


def _library_uses(tree: ast.AST) -> Iterator[tuple[int, str, str]]:
    """``(line, library, what)`` for each private Ray or torch name a module's code uses."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield from ((node.lineno, _library(name), f"imports {name}") for name in _import_uses(node))
        elif isinstance(node, ast.Attribute):
            chain, outer = _chain(node), _chain(node.value)
            if chain and _library(chain) and _is_private_module(chain) and not _is_private_module(outer or ""):
                yield node.lineno, _library(chain), f"uses {chain}"
            elif node.attr in _LIBRARY_ATTRIBUTES:
                yield node.lineno, _LIBRARY_ATTRIBUTES[node.attr], f"uses .{node.attr}"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ATTRIBUTE_FUNCTIONS:
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and name.value in _LIBRARY_ATTRIBUTES:
                yield node.lineno, _LIBRARY_ATTRIBUTES[name.value], f"uses .{name.value} ({node.func.id})"
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _library(node.value):
            if _is_dotted(node.value) and _is_private_module(node.value):
                yield node.lineno, _library(node.value), f"looks up {node.value!r}"


def test_private_ray_and_torch_names_only_in_their_folders():
    offending = []
    for module, path in MODULES.items():
        for line, library, what in _library_uses(ast.parse(path.read_text())):
            folder, named, _ = FENCES[library]
            if _layer(module) != folder:
                offending.append(f"{_where(path)}:{line} {what}: {named}'s private (only in ray_lightning/{folder}/)")
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
    # A module of a low layer importing a higher one, and private Lightning, Ray and torch names, are found.
    bad = PACKAGE / "config" / "display.py"
    source = bad.read_text() + (
        "\nfrom ray_lightning.launch import launcher\nfrom lightning_fabric.x import _y\n"
        "MOCK = 'core.optimizer._MockOptimizer'\n"
        "from ray.experimental.internal_kv import _internal_kv_get\n"
        "from ray.core.generated import autoscaler_pb2\n"
        "import torch.distributed.algorithms._checkpoint.checkpoint_wrapper\n"
        "WORKER = ray._private.worker.global_worker\n"
        "optimizer._opt_called = True\n"
        "LOCK = getattr(dispatcher, '_lock', None)\n"
        "STATE = 'ray._private.state'\n"
    )
    fake = tmp_path / "display.py"
    fake.write_text(source)
    monkeypatch.setitem(MODULES, "ray_lightning.config.display", fake)
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
        assert "ray._private.state" not in str(error)  # Ray's: the next check's
    else:
        raise AssertionError("a private-name check that cannot fail")
    _check_the_ray_and_torch_check_fails(str(fake))


def _check_the_ray_and_torch_check_fails(fake: str) -> None:
    try:
        test_private_ray_and_torch_names_only_in_their_folders()
    except AssertionError as error:
        lines = [line.strip() for line in str(error).splitlines()]  # pytest indents a message's later lines
        found = [line.split(" ", 1)[1] for line in lines if line.startswith(f"{fake}:")]
    else:
        raise AssertionError("a private Ray/torch name check that cannot fail")
    ray_only, torch_only = (
        "Ray's private (only in ray_lightning/_ray/)",
        "torch's private (only in ray_lightning/_torch/)",
    )
    assert sorted(found) == sorted(
        [
            f"imports ray.experimental.internal_kv._internal_kv_get: {ray_only}",
            f"imports ray.core.generated.autoscaler_pb2: {ray_only}",
            f"imports torch.distributed.algorithms._checkpoint.checkpoint_wrapper: {torch_only}",
            f"uses ray._private: {ray_only}",
            f"uses ._opt_called: {torch_only}",
            f"uses ._lock (getattr): {ray_only}",
            f"looks up 'ray._private.state': {ray_only}",
        ]
    ), found

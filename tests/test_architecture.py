"""The house rules, checked on the source: layers import downwards only, no package cycles,
and ``import tokenloom...`` never pulls in a heavy dependency."""

from __future__ import annotations

import ast
import importlib
import itertools
import json
import pathlib
import re
import subprocess
import sys

import pytest

import tokenloom

SRC = pathlib.Path(tokenloom.__file__).parent

#: What each part of tokenloom may import (besides itself); imports inside functions count too.
#: io <- index <- source <- builder, serve <- framework adapters (in serve) <- cli.
ALLOWED = {
    "_version": set(),
    "_moved": set(),
    "errors": set(),
    "validate": {"_version", "errors"},
    "io": {"_moved", "_version", "errors", "validate"},
    "index": {"_moved", "_version", "errors", "validate", "io"},
    "source": {"_moved", "_version", "errors", "validate", "io", "index"},
    "tokenization": {"_moved", "_version", "errors", "validate", "io"},
    "planning": {"_moved", "_version", "errors", "validate"},
    "builder": {"_moved", "_version", "errors", "validate", "io", "index", "source", "planning", "tokenization"},
    "serve": {"_moved", "_version", "errors", "validate", "io", "index", "source", "planning"},
    "experimental": {"_version", "errors", "validate", "io", "index", "source", "planning", "serve"},
    "examples": {"_version", "errors", "validate", "io", "index", "source", "planning", "tokenization", "builder",
                 "serve", "experimental", "__init__"},
    "megatron": {"_version", "errors", "validate", "builder", "__init__"},
    "plots": {"errors"},
    "cli": {"_version", "errors", "validate", "io", "index", "source", "planning", "tokenization", "builder", "serve",
            "examples", "__init__", "plots"},
    "__init__": {"_moved", "_version", "errors", "planning", "builder"},
    "__main__": {"cli"},
}


def _part(path: pathlib.Path) -> str:
    relative = path.relative_to(SRC)
    return relative.parts[0] if len(relative.parts) > 1 else relative.stem


def _imports(path: pathlib.Path) -> set[str]:
    """The tokenloom parts a module imports (top of file or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "tokenloom":
            names = [f"tokenloom.{alias.name}" if alias.name in ALLOWED else "tokenloom" for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "tokenloom":
                found.add(parts[1] if len(parts) > 1 else "__init__")
    return found


MODULES = sorted(SRC.rglob("*.py"))


def test_every_part_has_a_rule():
    assert {_part(p) for p in MODULES} == set(ALLOWED)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_point_down_the_layers(path):
    part = _part(path)
    imported = _imports(path) - {part}
    if part == "__init__":  # `from tokenloom.errors import ...` in the package's own __init__
        imported -= {"__init__"}
    assert imported <= ALLOWED[part], f"{path.relative_to(SRC)} imports {sorted(imported - ALLOWED[part])}"


def test_no_cycle_between_parts():
    graph: dict[str, set[str]] = {part: set() for part in ALLOWED}
    for path in MODULES:
        graph[_part(path)] |= _imports(path) - {_part(path)}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                raise AssertionError(f"import cycle: {' -> '.join([*trail, node, nxt])}")
            if nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])


def _module_name(path: pathlib.Path) -> str:
    parts = ("tokenloom", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1]) if parts[-1] == "__init__" else ".".join(parts)


MODULE_NAMES = {_module_name(path): path for path in MODULES}


def _module_imports(path: pathlib.Path) -> dict[str, int]:
    """The tokenloom modules ``path`` imports, each with the line of its first import there: at
    the top, under ``if TYPE_CHECKING:`` or inside a function alike (a lazy import still needs the
    other module to be importable first, and a reader still has to read both).

    ``from a.b import c`` imports module ``a.b.c`` where that is a module, else ``a.b`` (for a
    package, its ``__init__``). Importing ``a.b.c`` runs the package's ``__init__`` first, but that
    edge is not counted: an ``__init__`` that imports its submodules, which import their siblings,
    forms no cycle unless a submodule imports the package itself back (``from a.b import name``)."""
    this = _module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULE_NAMES else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            if target in MODULE_NAMES and target != this:
                found.setdefault(target, node.lineno)
    return found


def test_no_cycle_between_modules():
    """No two modules need each other, however they import: not at the top, not under
    ``if TYPE_CHECKING:``, not inside a function. Where two do, the piece both need moves down
    into a third module (or one passes the other a value)."""
    graph = {name: _module_imports(path) for name, path in MODULE_NAMES.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[str] = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                loop = [*trail[trail.index(nxt):], node, nxt]
                cycles.append(" -> ".join(f"{a} (line {graph[a][b]})" for a, b in itertools.pairwise(loop))
                              + f" -> {nxt}")
            elif nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("module", ["tokenloom", "tokenloom.io", "tokenloom.index", "tokenloom.source",
                                    "tokenloom.serve", "tokenloom.builder", "tokenloom.planning",
                                    "tokenloom.tokenization", "tokenloom.cli", "tokenloom.experimental",
                                    "tokenloom.examples"])
def test_importing_loads_no_heavy_dependency(module):
    code = (f"import sys, {module}; heavy = sorted(m for m in ('torch', 'jax', 'numba', 'tokenizers', 'gigatoken', "
            "'awkward', 'orjson', 'pyarrow', 'matplotlib', 'boto3', 'botocore', 'grain') if m in sys.modules); "
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"import {module} imported {out}"


#: Imports every module named on its command line, then the torch and grain adapters (the modules
#: that import their framework at the top) where it is installed; prints, per module, the heavy
#: dependencies its import loaded, and which are loaded at the end.
IMPORT_EVERY_MODULE = r"""
import importlib, importlib.util, json, sys
heavy = ("torch", "jax", "numba", "llvmlite", "tokenizers", "gigatoken", "awkward", "orjson", "pyarrow", "matplotlib",
         "boto3", "botocore", "grain")
loaded = {}
for name in sys.argv[1:]:
    before = {m for m in heavy if m in sys.modules}
    importlib.import_module(name)
    loaded[name] = sorted(m for m in heavy if m in sys.modules and m not in before)
if importlib.util.find_spec("torch") is not None:
    importlib.import_module("tokenloom.serve.torch_adapter")
if importlib.util.find_spec("grain") is not None:
    importlib.import_module("tokenloom.serve.grain_adapter")
print(json.dumps({"loaded": {k: v for k, v in loaded.items() if v},
                  "at_end": sorted(m for m in heavy if m in sys.modules)}))
"""


def test_importing_every_module_imports_no_numba_and_compiles_nothing():
    """Importing any module, not only the packages, leaves numba unloaded (so no kernel can have
    compiled); the two ``__main__`` modules are left out, as they run the command line."""
    names = sorted(".".join(("tokenloom", *path.relative_to(SRC).with_suffix("").parts)).removesuffix(".__init__")
                   for path in MODULES if path.stem != "__main__")
    names.remove("tokenloom.serve.torch_adapter")
    names.remove("tokenloom.serve.grain_adapter")
    done = subprocess.run([sys.executable, "-c", IMPORT_EVERY_MODULE, *names], capture_output=True, text=True,
                          timeout=300, check=True)
    out = json.loads(done.stdout)
    assert out["loaded"] == {}, out
    assert "numba" not in out["at_end"] and "llvmlite" not in out["at_end"], out


LONG_CLASS_LINES = 260
"""About 250 lines: past it a class holds more than a reader can keep in mind at once."""


def test_no_class_is_long_without_a_reason_beside_it():
    """A class longer than LONG_CLASS_LINES says why in the comment just above it (starting
    ``# long:``); the others are split by concern instead."""
    unexplained = []
    for path in sorted(SRC.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > LONG_CLASS_LINES:
                above = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 2  # 0-based
                block = []
                while above >= 0 and lines[above].strip().startswith("#"):
                    block.append(lines[above].strip())
                    above -= 1
                if not (block and block[-1].startswith("# long:")):
                    unexplained.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} "
                                       f"({node.end_lineno - node.lineno + 1} lines)")
    assert not unexplained, unexplained


# ------------------------------------------------------------------------------- the public face

ROOT = SRC.parents[1]

#: Every module whose ``__all__`` is a public face: the stage packages, the framework adapters and
#: the few top-level modules a user imports. The README's table lists exactly these, in this order.
FACES = ("tokenloom", "tokenloom.io", "tokenloom.tokenization", "tokenloom.index", "tokenloom.builder",
         "tokenloom.source", "tokenloom.serve", "tokenloom.serve.torch_adapter", "tokenloom.serve.jax_adapter",
         "tokenloom.serve.grain_adapter", "tokenloom.planning", "tokenloom.megatron", "tokenloom.plots",
         "tokenloom.examples", "tokenloom.cli", "tokenloom.experimental")
#: The face whose names may live anywhere: they are not stable yet, so no stage package has them.
EXPERIMENTAL = "tokenloom.experimental"


def _module_file(module: str) -> pathlib.Path:
    base = SRC.joinpath(*module.split(".")[1:])
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _is_package(module: str) -> bool:
    return _module_file(module).name == "__init__.py"


def _tree(module: str) -> ast.Module:
    return ast.parse(_module_file(module).read_text(encoding="utf-8"))


def _all(module: str) -> list[str]:
    for node in _tree(module).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{module} has no literal __all__")


def _bindings(module: str, *, lazy: bool = True) -> dict[str, tuple[str, ast.AST | None]]:
    """Name -> (module it comes from, its definition there or None) for every name the module binds
    at its top level; with ``lazy``, also the imports under ``if TYPE_CHECKING:`` (the names a
    module-level ``__getattr__`` gives on first use)."""
    out: dict[str, tuple[str, ast.AST | None]] = {}
    body = list(_tree(module).body)
    for node in list(body):
        if lazy and isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            body.extend(node.body)
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = (module, node)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = (module, None)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("tokenloom"):
            for alias in node.names:
                out[alias.asname or alias.name] = (f"{node.module}.{alias.name}"
                                                   if _module_file(f"{node.module}.{alias.name}").exists()
                                                   else node.module, None)
    return out


def _definition(module: str, name: str) -> tuple[str, ast.AST | None]:
    """The module that defines ``name`` as ``module`` exports it, and its def or class node."""
    seen = set()
    while (module, name) not in seen:
        seen.add((module, name))
        source, node = _bindings(module).get(name, (None, None))
        if source is None:
            raise AssertionError(f"{module} exports {name!r} but binds no such name")
        if source == module or source == f"{module}.{name}":
            return source, node
        module = source
    raise AssertionError(f"{name!r} is imported in a circle")


def _readme_faces() -> dict[str, set[str]]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("### The Python API, stage by stage", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`tokenloom"):
            rows[cells[0].strip("`")] = {n for n in re.findall(r"`([^`]+)`", cells[1])
                                         if re.fullmatch(r"[A-Za-z_]\w*", n)}
    return rows


def test_the_readme_lists_every_face_and_every_name_it_exports():
    rows = _readme_faces()
    assert list(rows) == list(FACES), "README's 'The Python API' table and FACES list other modules"
    for face in FACES:
        assert rows[face] == set(_all(face)), (f"{face}: README lists {sorted(rows[face] - set(_all(face)))} beyond "
                                               f"__all__, and leaves out {sorted(set(_all(face)) - rows[face])}")


@pytest.mark.parametrize("face", FACES)
def test_every_exported_name_is_documented_where_it_is_defined(face):
    undocumented = []
    for name in _all(face):
        source, node = _definition(face, name)
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not ast.get_docstring(node):
            undocumented.append(f"{name} ({source})")
    assert not undocumented, f"{face} exports names without a docstring: {undocumented}"


@pytest.mark.parametrize("face", [f for f in FACES if f != EXPERIMENTAL])
def test_a_face_exports_only_what_its_own_package_defines(face):
    """A package's names come from its own modules, a module's from itself: nothing is re-exported
    from another package, so every name has one home."""
    home = face if _is_package(face) else face.rsplit(".", 1)[0]
    foreign = []
    for name in _all(face):
        source, _ = _definition(face, name)
        inside = source == face if not _is_package(face) else (
            source == home or (source.rsplit(".", 1)[0] == home and not _is_package(source)))
        if not inside:
            foreign.append(f"{name} (from {source})")
    assert not foreign, f"{face} re-exports {foreign}"


def _module_level(statements: list[ast.stmt]):
    """The statements run when a module is imported: its body, into ``if``/``try``/``with`` blocks
    (``if TYPE_CHECKING:`` included) but not into functions or classes."""
    for node in statements:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody"):
                yield from _module_level(getattr(node, block, []))
            for handler in getattr(node, "handlers", []):
                yield from _module_level(handler.body)


def test_no_internal_module_re_exports_a_name():
    """A name is imported from the module that defines it: a module that is neither a package's
    ``__init__`` nor the experimental face (the public faces, where a moved name may stay, once)
    binds no name only to hand it on. ruff already flags an import a module does not use, except
    through the two ways of saying "re-exported": ``from a import b as b`` and ``b`` in
    ``__all__``; these are flagged here, with the lazy way, a module-level ``__getattr__``."""
    found = []
    for name, path in MODULE_NAMES.items():
        if path.name == "__init__.py" or name == EXPERIMENTAL:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        where = path.relative_to(SRC)
        imported: dict[str, int] = {}
        exported: list[str] = []
        for node in _module_level(tree.body):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    if alias.asname == alias.name:  # `import a.b as b` is a plain import, not this
                        found.append(f"{where}:{node.lineno}: imports {alias.name} as {alias.asname}")
                    imported.setdefault(alias.asname or alias.name.partition(".")[0], node.lineno)
            elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
                exported = list(ast.literal_eval(node.value))
            elif isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                found.append(f"{where}:{node.lineno}: a module-level __getattr__ hands out names defined elsewhere")
        found += [f"{where}:{imported[n]}: exports {n!r} in __all__, imported there" for n in exported if n in imported]
    assert not found, "names re-exported by internal modules (import them from their home):\n" + "\n".join(found)


def test_no_name_has_two_homes():
    homes: dict[str, list[str]] = {}
    for face in FACES:
        for name in _all(face):
            if not name.startswith("__"):
                homes.setdefault(name, []).append(face)
    assert {n: f for n, f in homes.items() if len(f) > 1} == {}


@pytest.mark.parametrize("face", [f for f in FACES if _is_package(f)])
def test_a_package_binds_no_public_name_beyond_its_face(face):
    """Helpers and constants stay in their modules: the package's namespace holds its ``__all__``
    (plus its submodules), so ``dir(tokenloom.serve)`` is the face."""
    exported = set(_all(face))
    extra = sorted(name for name, (source, _) in _bindings(face, lazy=False).items()
                   if not name.startswith("_") and name not in exported and source != f"{face}.{name}")
    assert not extra, f"{face} binds {extra} without exporting them"


def _tokenloom_imports(code: str) -> list[tuple[str, list[str]]]:
    """(module, names) of every ``from tokenloom... import`` and ``import tokenloom...`` in ``code``
    (a file, or a README block that is not a whole program: only its import statements are read)."""
    lines = [line.split("#")[0].strip() for line in code.splitlines()]
    out = []
    for i, line in enumerate(lines):
        if not re.match(r"(from|import) tokenloom", line):
            continue
        statement = line
        while statement.count("(") > statement.count(")"):
            i += 1
            statement += lines[i]
        node = ast.parse(statement).body[0]
        if isinstance(node, ast.ImportFrom):
            out.append((node.module, [a.name for a in node.names]))
        else:
            out.extend((a.name, []) for a in node.names)
    return out


def _front_files() -> list[tuple[str, str, str | None]]:
    """(label, code, own package) of what must use only the public face: the command line, the
    examples (shipped and in examples/) and the README's Python blocks."""
    files = [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8"), "tokenloom.cli")
             for p in sorted((SRC / "cli").glob("*.py"))]
    files += [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8"), "tokenloom.examples")
              for p in sorted((SRC / "examples").glob("*.py"))]
    files += [(str(p.relative_to(ROOT)), p.read_text(encoding="utf-8"), None)
              for p in sorted((ROOT / "examples").glob("*.py"))]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    files += [(f"README.md python block {k}", block, None)
              for k, block in enumerate(re.findall(r"```python\n(.*?)```", readme, re.S))]
    return files


def test_the_command_line_examples_and_readme_use_only_the_public_face():
    faces = {face: set(_all(face)) for face in FACES}
    outside = []
    for label, code, own in _front_files():
        for module, names in _tokenloom_imports(code):
            if own is not None and (module == own or module.startswith(own + ".")):
                continue  # a command-line module importing its siblings
            if module not in faces:
                outside.append(f"{label}: {module}")
            else:
                outside += [f"{label}: {module}.{n}" for n in names if n not in faces[module]]
    assert not outside, f"imports from outside the public face: {outside}"


def test_open_problems_are_tagged_todos():
    """An open problem left in the code is ``# TODO(topic): what is wrong and what a fix needs``,
    so ``grep -rn "TODO(" src`` lists them all, grouped by topic."""
    untagged = [f"{path.relative_to(SRC)}:{number}: {line.strip()}"
                for path in sorted(SRC.rglob("*.py"))
                for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
                if re.search(r"\b(TODO|FIXME|XXX)\b", line) and not re.search(r"# TODO\([a-z-]+\): \S", line)]
    assert not untagged, untagged


SHIMMED = [f for f in FACES if _is_package(f) and f not in ("tokenloom.cli", "tokenloom.examples")]
"""The packages that had a face before it was curated, and keep a table of the names that left it."""


@pytest.mark.parametrize("face", SHIMMED)
def test_a_name_that_left_a_face_imports_with_a_warning_naming_its_home(face):
    package = importlib.import_module(face)
    for name, home in package._MOVED.items():
        assert name not in package.__all__, f"{face}.{name} is both in the face and moved"
        with pytest.warns(DeprecationWarning, match=f"{face}.{name} .* import it from {re.escape(home)} "):
            value = getattr(package, name)
        assert value is getattr(importlib.import_module(home), name)
        if home in FACES:
            assert name in _all(home), f"{face}.{name} moved to {home}, whose face lacks it"
    with pytest.raises(AttributeError, match=f"module '{face}' has no attribute 'no_such_name'"):
        package.no_such_name  # noqa: B018


def test_the_moved_warning_points_at_the_importing_line():
    with pytest.warns(DeprecationWarning) as caught:
        from tokenloom.serve import StoreBlendSource  # noqa: F401
    assert caught[0].filename == __file__

"""The house rules, checked on the source: layers import downwards only, no package cycles,
and ``import tokenloom...`` never pulls in a heavy dependency."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

import tokenloom

SRC = pathlib.Path(tokenloom.__file__).parent

#: What each part of tokenloom may import (besides itself); imports inside functions count too.
#: io <- index <- source <- builder, serve <- framework adapters (in serve) <- cli.
ALLOWED = {
    "_version": set(),
    "errors": set(),
    "validate": {"_version", "errors"},
    "io": {"_version", "errors", "validate"},
    "index": {"_version", "errors", "validate", "io"},
    "source": {"_version", "errors", "validate", "io", "index"},
    "tokenization": {"_version", "errors", "validate", "io"},
    "planning": {"_version", "errors", "validate"},
    "builder": {"_version", "errors", "validate", "io", "index", "source", "planning", "tokenization"},
    "serve": {"_version", "errors", "validate", "io", "index", "source", "planning"},
    "examples": {"_version", "errors", "validate", "io", "index", "source", "planning", "tokenization", "builder",
                 "serve"},
    "megatron": {"_version", "errors", "validate", "builder", "__init__"},
    "plots": {"errors"},
    "cli": {"_version", "errors", "validate", "io", "index", "source", "planning", "tokenization", "builder", "serve",
            "examples", "__init__", "plots"},
    "__init__": {"_version", "errors", "planning", "builder"},
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


@pytest.mark.parametrize("module", ["tokenloom", "tokenloom.io", "tokenloom.index", "tokenloom.source",
                                    "tokenloom.serve", "tokenloom.builder", "tokenloom.planning",
                                    "tokenloom.tokenization", "tokenloom.cli"])
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

"""Names that left a package's public face, still importable there for a while, with a warning.

Each stage package now exports only what a user constructs or calls (README, "The Python API,
stage by stage"); helpers, constants and names re-exported from another package left the
packages' namespaces. Code that imports one of them from its old place keeps working, and a
DeprecationWarning names the place to import it from instead. Each package keeps its own table
(``_MOVED``) and answers through a module ``__getattr__``, so these names bind nothing in the
package and ``dir()`` shows only the face.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any


def moved_attribute(package: str, name: str, homes: dict[str, str]) -> Any:
    """``name`` from its new home when ``package`` once exported it (with a DeprecationWarning
    pointing at the caller's line), else the AttributeError Python raises for a missing name."""
    home = homes.get(name)
    if home is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    warnings.warn(f"{package}.{name} is no longer part of {package}'s public face; import it from {home} "
                  "(the old name will go in a later release)", DeprecationWarning, stacklevel=3)
    return getattr(importlib.import_module(home), name)


__all__ = ["moved_attribute"]

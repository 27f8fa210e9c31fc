"""A package's public names imported when first used (PEP 562), so that importing one module of
it runs only what that module needs: `dropless`, `dropless.models`, `dropless.ops` and
`dropless.ops.gmm` use it, and the command line's `config` and `report` import no JAX
(tests/cli/test_main_imports.py)."""
from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_names(package: str, home: dict[str, str], namespace: dict[str, Any]
               ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) for the package `package` whose globals are `namespace`: each
    name of `home` is taken from the module `home[name]` on first use (the module itself where
    it is the package's submodule of that name) and kept in `namespace`; any other name raises
    AttributeError as a module does."""
    def getattr_(name: str) -> Any:
        if name not in home:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(home[name])
        value = module if module.__name__ == f"{package}.{name}" else getattr(module, name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(home))
    return getattr_, dir_

"""Post-import hooks: run a function on a module right after it is imported (at once if it
already is), so a fix to a library module applies without importing that module early.

Used by the device-generic verl fixes (:mod:`verl_ext.verl_fixes`) and by the CPU backend's
patches (:mod:`verl_ext.cpu.patches`, :mod:`verl_ext.cpu.megatron`).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from typing import Any, Callable

_hooks: dict[str, list[Callable[[Any], None]]] = {}
_package_hooks: list[tuple[str, Callable[[Any], None]]] = []  # (package, hook): every module under it
_lock = threading.Lock()


class _HookedLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, name: str):
        self._loader, self._name = loader, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        for hook in _package_hook_list(self._name) + _hooks.pop(self._name, []):
            hook(module)

    def __getattr__(self, attr: str) -> Any:  # get_source, get_filename, ... as the real loader
        return getattr(self._loader, attr)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Finds watched modules with the normal machinery, then runs their hooks after they execute."""

    def __init__(self):
        self._busy: set[str] = set()

    def find_spec(self, fullname, path, target=None):
        if (fullname not in _hooks and not _package_hook_list(fullname)) or fullname in self._busy:
            return None
        self._busy.add(fullname)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.discard(fullname)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _HookedLoader(spec.loader, fullname)
        return spec


_finder = _PostImportFinder()


def after_import(module_name: str, hook: Callable[[Any], None]) -> None:
    """Run ``hook(module)`` once ``module_name`` is imported (at once if it already is)."""
    with _lock:
        module = sys.modules.get(module_name)
        if module is None:
            _hooks.setdefault(module_name, []).append(hook)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
            return
    hook(module)


def _in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _package_hook_list(name: str) -> list[Callable[[Any], None]]:
    return [hook for package, hook in _package_hooks if _in_package(name, package)]


def after_import_package(package: str, hook: Callable[[Any], None]) -> None:
    """Run ``hook(module)`` on ``package`` and every module under it: at once on those already
    imported, and on each of the others right after its import."""
    with _lock:
        _package_hooks.append((package, hook))
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)
        loaded = [m for name, m in list(sys.modules.items()) if m is not None and _in_package(name, package)]
    for module in loaded:
        hook(module)

"""Methods from outside the package: an installed package's entry points, or a recipe's own files.

* **A package** names its methods in the entry-point group ``ondevice_moe.methods``, one entry per
  method, each pointing at a :class:`~ondevice_moe.methods.spec.MethodSpec`::

      [project.entry-points."ondevice_moe.methods"]
      fedprox = "fedprox_method:SPEC"

  Installing the package is the act of trust; its methods are found the first time a method is
  looked up, in every process (the simulation's workers and a device's SuperNode alike).
* **A recipe's own files**: ``plugins: [fedprox/]`` lists Python files or folders (packages), relative
  to the recipe, each with a module-level ``METHODS = {"name": MethodSpec(...)}``. Loading one runs its
  code, so a recipe that names one is refused unless the user trusts it (``--trust-plugins``, or
  ``ONDEVICE_MOE_TRUST_PLUGINS=1``, which the simulation's workers inherit): a recipe or a run folder
  from elsewhere never runs code by being read.

``ondevice-moe methods list`` shows every method and where it comes from (:func:`origins`);
``ondevice-moe new-method`` scaffolds a method folder (:mod:`ondevice_moe.methods.scaffold`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from collections.abc import Iterable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from ondevice_moe.errors import UserError
from ondevice_moe.methods.spec import MethodSpec
from ondevice_moe.names import is_plain_name

GROUP = "ondevice_moe.methods"
TRUST_ENV = "ONDEVICE_MOE_TRUST_PLUGINS"
BUILT_IN = "built-in"


def trusted() -> bool:
    """Whether this process may run the code of a recipe's plug-in files."""
    return os.environ.get(TRUST_ENV) == "1"


def trust_plugins() -> None:
    """Let this process, and the workers it starts, run a recipe's plug-in files."""
    os.environ[TRUST_ENV] = "1"


class Registry:
    """Methods by name, and where each came from (``built-in``, ``package <dist>``, ``file <path>``)."""

    def __init__(self, built_in: dict[str, MethodSpec]) -> None:
        self.specs = dict(built_in)
        self.origins = dict.fromkeys(built_in, BUILT_IN)
        self._entry_points_read = False
        self._files: set[Path] = set()

    def add(self, name: str, spec: Any, origin: str) -> None:
        """Register method ``name``; a name taken by another origin, or not a method spec, is refused."""
        if not isinstance(name, str) or not is_plain_name(name):
            raise UserError(f"{origin} names a method {name!r}", "name it with letters, digits and . _ + - only")
        if not isinstance(spec, MethodSpec):
            raise UserError(f"{origin} gives method '{name}' a {type(spec).__name__}, not a MethodSpec",
                            "point it at a MethodSpec(options, build, tasks) (docs/adding-a-method.md)")
        if self.origins.get(name, origin) != origin:
            raise UserError(f"method '{name}' of {origin} clashes with the one of {self.origins[name]}",
                            "give one of them another name, or drop the recipe's plugins: entry when the same "
                            "method is installed as a package")
        self.specs[name] = spec
        self.origins[name] = origin

    def read_entry_points(self) -> None:
        """Register the methods of installed packages (once per process)."""
        if self._entry_points_read:
            return
        self._entry_points_read = True
        for point in entry_points(group=GROUP):
            origin = f"package {point.dist.name if point.dist else point.value}"
            try:
                spec = point.load()
            except Exception as error:  # an installed package's import error, said once with its name
                raise UserError(f"method plug-in '{point.name}' of {origin} does not load: {error}",
                                f"fix or uninstall that package (pip uninstall {origin.removeprefix('package ')})"
                                ) from None
            self.add(point.name, spec, origin)

    def load_files(self, paths: Iterable[Path]) -> None:
        """Register the methods of a recipe's plug-in files or folders (each once per process)."""
        fresh = [Path(path).resolve() for path in paths if Path(path).resolve() not in self._files]
        if fresh and not trusted():
            raise UserError(f"the recipe names method plug-in files whose code would run: {[str(p) for p in fresh]}",
                            "read them, then pass --trust-plugins (or set ONDEVICE_MOE_TRUST_PLUGINS=1)")
        for path in fresh:
            for name, spec in _file_methods(path).items():
                self.add(name, spec, f"file {path}")
            self._files.add(path)


def _file_methods(path: Path) -> dict[str, Any]:
    """The ``METHODS`` of a plug-in file or package folder, imported under a name of its own."""
    if not path.exists():
        raise UserError(f"method plug-in {path} does not exist", "fix the path in the recipe's plugins: list")
    init = path / "__init__.py" if path.is_dir() else path
    if init.suffix != ".py" or not init.is_file():
        raise UserError(f"method plug-in {path} is not a Python file or a package folder",
                        "list a .py file or a folder with an __init__.py")
    module_name = f"ondevice_moe_plugin_{hashlib.sha256(str(path).encode()).hexdigest()[:12]}"
    spec = importlib.util.spec_from_file_location(
        module_name, init, submodule_search_locations=[str(path)] if path.is_dir() else None)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # the plug-in's own bug, said with its file
        del sys.modules[module_name]
        raise UserError(f"method plug-in {path} fails to import: {type(error).__name__}: {error}",
                        "fix the plug-in's code") from None
    methods = getattr(module, "METHODS", None)
    if not isinstance(methods, dict) or not methods:
        raise UserError(f"method plug-in {path} defines no METHODS",
                        "define METHODS = {'my-method': MethodSpec(...)} at its top level")
    return methods

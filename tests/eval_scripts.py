"""The scripts of ``eval/`` as modules, for their tests (they are run as files, not installed)."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EVAL = Path(__file__).parent.parent / "eval"


def load_eval_script(name: str) -> ModuleType:
    """``eval/<name>.py`` imported as module ``name`` (registered, so its dataclasses find their module),
    with ``eval/`` on the import path as when the script runs as a file (its helpers live beside it)."""
    if str(EVAL) not in sys.path:
        sys.path.insert(0, str(EVAL))
    spec = importlib.util.spec_from_file_location(name, EVAL / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

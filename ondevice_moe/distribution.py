"""What ships with the toolkit: its version and the recipes bundled inside the package.

Any module may import these, at any layer (docs/architecture.md, Layers): this module imports
nothing of the toolkit. The package root, which is the top of the layers, names them for users
as ``ondevice_moe.__version__`` and ``ondevice_moe.BUNDLED_RECIPES``.
"""

from pathlib import Path

VERSION = "0.1.0"
"""The toolkit's version (``version`` in ``pyproject.toml``)."""

BUNDLED_RECIPES = Path(__file__).resolve().parent / "recipes"
"""The recipes that ship inside the package (``ondevice-moe recipes list``)."""

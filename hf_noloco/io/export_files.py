"""The export's files: written into a staging folder, recorded in a manifest with their sizes and SHA-256, and
only then moved into place, so that a crash never leaves a half-written export under the names a user (or a
Hub upload) reads.

``output_dir`` usually holds more than the export (the ``checkpoint-N`` folders, logs, wandb's files), so it
cannot be renamed as a whole: the export is staged in ``output_dir/.tmp-export/``, every file is synced, the
manifest ``noloco_export.json`` is written, then each file is renamed over its old copy (an atomic replace per
file) and the manifest last. A crash between two renames leaves files that the manifest in place does not
match: :func:`verify_export` names the first. The manifest also says exactly which files are the export,
which is what the Hub upload sends (:mod:`hf_noloco.io.hub`).
"""

from __future__ import annotations

import json
import os
import shutil

from hf_noloco.io.checkpoint_files import file_checksum, fsync_path

MANIFEST = "noloco_export.json"
STAGING = ".tmp-export"


def staging_folder(output_dir: str) -> str:
    """An empty staging folder for an export into ``output_dir`` (a leftover of a cut export is removed)."""
    folder = os.path.join(output_dir, STAGING)
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)  # (output_dir too, if it does not exist yet)
    return folder


def _files(folder: str) -> list[str]:
    found = []
    for root, _, names in os.walk(folder):
        found += [os.path.relpath(os.path.join(root, n), folder) for n in names]
    return sorted(n for n in found if n != MANIFEST)


def publish_export(staging: str, output_dir: str) -> list[str]:
    """Moves the export staged in ``staging`` into ``output_dir`` (see the module); returns its files."""
    files = _files(staging)
    for rel in files:
        fsync_path(os.path.join(staging, rel))
    record = {rel: file_checksum(os.path.join(staging, rel)) for rel in files}
    with open(os.path.join(staging, MANIFEST), "w") as f:
        json.dump({"files": record}, f, indent=1, sort_keys=True)
    fsync_path(os.path.join(staging, MANIFEST))
    fsync_path(staging)
    if os.path.normpath(staging) != os.path.join(os.path.normpath(output_dir), STAGING):
        raise ValueError(f"{staging} is not the staging folder of {output_dir}")
    folders = {os.path.dirname(rel) for rel in files} - {""}
    for sub in sorted(folders):
        os.makedirs(os.path.join(output_dir, sub), exist_ok=True)
    for rel in files + [MANIFEST]:  # the manifest last: once it is in place, so is everything it lists
        os.replace(os.path.join(staging, rel), os.path.join(output_dir, rel))
    for sub in sorted(folders, reverse=True):
        fsync_path(os.path.join(output_dir, sub))
    fsync_path(output_dir)
    shutil.rmtree(staging, ignore_errors=True)
    return files


def exported_files(output_dir: str) -> list[str] | None:
    """The files of the export in ``output_dir`` (with its manifest), from the manifest; ``None`` without
    one."""
    path = os.path.join(output_dir, MANIFEST)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        listed = json.load(f)["files"]
    return sorted(listed) + [MANIFEST]


def verify_export(output_dir: str) -> str | None:
    """What is wrong with the export in ``output_dir`` (a missing, truncated or changed file, or no
    manifest), or ``None`` when every file matches its manifest."""
    path = os.path.join(output_dir, MANIFEST)
    if not os.path.isfile(path):
        return f"{output_dir} holds no {MANIFEST} (no complete export)"
    with open(path) as f:
        listed = json.load(f)["files"]
    for rel, expected in sorted(listed.items()):
        full = os.path.join(output_dir, rel)
        if not os.path.isfile(full):
            return f"{rel} is missing"
        if file_checksum(full) != expected:
            return f"{rel} differs from the manifest (the export was cut short or changed)"
    return None

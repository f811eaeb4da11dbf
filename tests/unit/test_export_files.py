"""The export is staged, recorded in its manifest and moved into place: the files a reader finds are the
manifest's, old ones are replaced whole, and damage is named."""

import os

from hf_noloco.io import export_files


def _export(output_dir, files):
    staging = export_files.staging_folder(str(output_dir))
    for name, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(staging, name)) or staging, exist_ok=True)
        with open(os.path.join(staging, name), "wb") as f:
            f.write(data)
    return export_files.publish_export(staging, str(output_dir))


def test_an_export_replaces_the_previous_one_and_its_manifest_lists_exactly_it(tmp_path):
    out = tmp_path / "out"
    (out / "checkpoint-4").mkdir(parents=True)  # what output_dir holds besides the export: untouched
    _export(out, {"model.safetensors": b"old", "config.json": b"{}"})
    files = _export(out, {"model.safetensors": b"new weights", "config.json": b"{}", "sub/vocab.txt": b"a"})
    assert files == ["config.json", "model.safetensors", "sub/vocab.txt"]
    assert (out / "model.safetensors").read_bytes() == b"new weights"
    assert export_files.exported_files(str(out)) == [*files, export_files.MANIFEST]
    assert export_files.verify_export(str(out)) is None
    assert sorted(os.listdir(out)) == sorted(
        ["checkpoint-4", "config.json", "model.safetensors", "sub", export_files.MANIFEST]
    )


def test_a_changed_or_missing_export_file_is_named(tmp_path):
    _export(tmp_path, {"model.safetensors": b"weights", "config.json": b"{}"})
    (tmp_path / "model.safetensors").write_bytes(b"weigh")  # cut short
    assert "model.safetensors differs from the manifest" in export_files.verify_export(str(tmp_path))
    os.remove(tmp_path / "config.json")
    assert export_files.verify_export(str(tmp_path)) == "config.json is missing"
    assert "no complete export" in export_files.verify_export(str(tmp_path / "none"))
    assert export_files.exported_files(str(tmp_path / "none")) is None

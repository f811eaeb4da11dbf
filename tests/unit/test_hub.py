"""Hub publishing against a local fake Hub (127.0.0.1, in a thread): never a real network call."""

import json
import logging
import os

import pytest
from huggingface_hub import HfApi

from hf_noloco.io import checkpoint_files, export_files, hub
from hf_noloco.io.hub import check_hub_settings, push_folder_to_hub
from tests.helpers.fake_hub import FakeHub

TOKEN = "hf_fakeTOKENdo_not_leak_1234567890"


@pytest.fixture
def fake_hub(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    with FakeHub() as server:
        yield server


def _export_folder(root):
    """What an export leaves in output_dir (staged, then published with its manifest), plus things that
    must never be published."""
    folder = root / "out"
    folder.mkdir()
    files = {
        "config.json": b'{"model_type": "llama"}',
        "model.safetensors": b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ",
        "generation_config.json": b"{}",
        "tokenizer.json": b'{"version": "1.0"}',
        "README.md": b"---\nlibrary_name: transformers\ntags:\n- hf-noloco\n---\n\n# tiny\n",
        "training_curves.png": b"\x89PNG\r\n\x1a\n fake",
    }
    staging = export_files.staging_folder(str(folder))
    for name, data in files.items():
        with open(os.path.join(staging, name), "wb") as f:
            f.write(data)
    export_files.publish_export(staging, str(folder))
    files[export_files.MANIFEST] = (folder / export_files.MANIFEST).read_bytes()
    (folder / "training_args.bin").write_bytes(b"pickle")  # Trainer leaves this; a pickle: never uploaded
    (folder / ".env").write_text("HF_TOKEN=hf_secret\n")  # a dotfile
    (folder / "train.log").write_text("log\n")
    for name in ("checkpoint-5", "tmp-checkpoint-6", "skipped-checkpoint-3"):  # complete, partial, damaged
        (folder / name).mkdir()
        (folder / name / "model.safetensors").write_bytes(b"old")
    return folder, files


def test_push_folder_uploads_exactly_the_export_and_never_leaks_token(fake_hub, tmp_path, caplog, capfd):
    from huggingface_hub.utils import logging as hf_logging

    folder, files = _export_folder(tmp_path)
    api = HfApi(endpoint=fake_hub.endpoint, token=TOKEN)
    old_verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_debug()  # the noisiest setting: the token must not appear even there
    try:
        with caplog.at_level(logging.DEBUG):
            url = push_folder_to_hub(folder, "fake-user/tiny-noloco", private=True, api=api)
            # Pushing again into the existing repo works (exist_ok), on a new branch.
            url2 = push_folder_to_hub(
                folder, "fake-user/tiny-noloco", api=api, revision="dev", commit_message="second"
            )
    finally:
        hf_logging.set_verbosity(old_verbosity)

    assert url == f"{fake_hub.endpoint}/fake-user/tiny-noloco/commit/{1:040x}"
    assert url2.endswith(f"/commit/{2:040x}")
    first, second = fake_hub.commits
    assert first["repo_id"] == "fake-user/tiny-noloco" and first["revision"] == "main"
    # The export's files and manifest, byte for byte, and nothing else (no .bin, .env, log, checkpoint-*).
    assert first["files"] == files
    assert first["other"] == []  # no LFS / deletion entries
    assert second["revision"] == "dev" and second["header"]["summary"] == "second"
    assert ("fake-user/tiny-noloco", "dev") in fake_hub.branches
    # The token reached the server as a header (so auth is wired) ...
    assert set(fake_hub.auth_headers) == {f"Bearer {TOKEN}"}
    # ... and nowhere else: not in logs, stdout or stderr.
    out, err = capfd.readouterr()  # file-descriptor level: print(), logging handlers and C extensions
    logged = "\n".join(r.getMessage() for r in caplog.records)
    assert "fake-user/tiny-noloco" in logged  # the logs were captured
    for text in (logged, out, err):
        assert TOKEN not in text


def test_push_folder_uses_env_token_and_bare_repo_name(fake_hub, tmp_path, monkeypatch):
    folder, _ = _export_folder(tmp_path)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    api = HfApi(endpoint=fake_hub.endpoint)  # no token on the client: resolved from HF_TOKEN
    push_folder_to_hub(folder, "tiny-noloco", api=api)
    assert fake_hub.commits[0]["repo_id"] == "fake-user/tiny-noloco"  # namespace filled in by the Hub
    assert fake_hub.auth_headers[0] == f"Bearer {TOKEN}"


def test_push_folder_requires_a_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="export the model first"):
        push_folder_to_hub(tmp_path / "missing", "a/b", api=HfApi(endpoint="http://127.0.0.1:9", token=TOKEN))


@pytest.fixture
def no_saved_token(monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(hub, "get_token", lambda: None)


def test_check_hub_settings(no_saved_token, monkeypatch):
    assert check_hub_settings(False, None, None) is None  # not pushing: nothing required
    with pytest.raises(ValueError, match="hub_model_id"):
        check_hub_settings(True, None, TOKEN)
    with pytest.raises(ValueError, match="not a valid Hub repository id"):
        check_hub_settings(True, "a/b/c", TOKEN)
    with pytest.raises(ValueError, match="HF_TOKEN") as excinfo:
        check_hub_settings(True, "me/model", None)
    assert check_hub_settings(True, "me/model", TOKEN) == "me/model"
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    assert check_hub_settings(True, "me/model", None) == "me/model"
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(hub, "get_token", lambda: TOKEN)  # `hf auth login`
    assert check_hub_settings(True, "me/model", None) == "me/model"
    assert TOKEN not in str(excinfo.value)


def test_check_hub_settings_error_never_contains_token(no_saved_token):
    with pytest.raises(ValueError) as excinfo:
        check_hub_settings(True, "", TOKEN)
    assert TOKEN not in str(excinfo.value)


def test_a_folder_without_a_manifest_is_not_pushed_and_a_checkpoint_pushes_its_recorded_files(tmp_path):
    (tmp_path / "loose").mkdir()
    (tmp_path / "loose" / "model.safetensors").write_bytes(b"x")
    with pytest.raises(ValueError, match="neither an export's manifest nor a checkpoint's checksum record"):
        hub.upload_list(str(tmp_path / "loose"))
    folder = tmp_path / "checkpoint-4"
    (folder / "stage-0-replica-0").mkdir(parents=True)
    for rel in (
        "stage-0-replica-0/model.safetensors",
        "stage-0-replica-0/optimizer.pt",
        "trainer_state.json",
    ):
        (folder / rel).write_bytes(b"data")
    record = {rel: checkpoint_files.file_checksum(str(folder / rel)) for rel in ("trainer_state.json",)}
    for rel in ("stage-0-replica-0/model.safetensors", "stage-0-replica-0/optimizer.pt"):
        record[rel] = checkpoint_files.file_checksum(str(folder / rel))
    (folder / "stage-0-replica-0" / checkpoint_files.RANK_CHECKSUMS).write_text("{}")
    (folder / checkpoint_files.CHECKSUMS).write_text(json.dumps({"files": record}))
    (folder / "stage-0-replica-0" / "stray.tmp").write_bytes(b"left by a cut save")
    assert hub.upload_list(str(folder)) == sorted(
        [*record, checkpoint_files.CHECKSUMS, "stage-0-replica-0/" + checkpoint_files.RANK_CHECKSUMS]
    )
    assert hub._allow_patterns(["a[1].json", "b*.txt"]) == ["a[[]1].json", "b[*].txt"]


def test_an_upload_error_is_described_without_what_it_carries():
    class Response:
        status_code = 403

    class HubError(OSError):
        response = Response()

    error = HubError(f"403 for https://huggingface.co/api?token={TOKEN}")
    assert hub.describe_hub_error(error) == "HubError (HTTP 403)"
    assert hub.describe_hub_error(ValueError("x")) == "ValueError"

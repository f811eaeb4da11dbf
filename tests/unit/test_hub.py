"""Hub publishing against a local fake Hub (127.0.0.1, in a thread): never a real network call."""

import logging

import pytest
from huggingface_hub import HfApi

from hf_noloco.io import hub
from hf_noloco.io.hub import check_hub_settings, push_folder_to_hub
from tests.helpers.fake_hub import FakeHub

TOKEN = "hf_fakeTOKENdo_not_leak_1234567890"


@pytest.fixture
def fake_hub(monkeypatch):
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    with FakeHub() as server:
        yield server


def _export_folder(root):
    """What an export leaves in output_dir, plus things that must never be published."""
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
    for name, data in files.items():
        (folder / name).write_bytes(data)
    (folder / "training_args.bin").write_bytes(b"pickle")  # Trainer leaves this; a pickle: never uploaded
    (folder / "checkpoint-5").mkdir()
    (folder / "checkpoint-5" / "model.safetensors").write_bytes(b"old")
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
    assert first["files"] == files  # everything, byte for byte, and nothing else (no .bin, no checkpoint-*)
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

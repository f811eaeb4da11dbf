"""Publishing an exported NoLoCo checkpoint to the Hugging Face Hub.

Tokens are resolved but never logged, printed or put into an error message; ``HF_TOKEN`` (or ``hf auth
login``) is the way to give one (``hub_token`` puts it on a command line, which other users of the machine
may read). What is uploaded is an allow-list, never a folder's whole content: the files an export's manifest
lists (:mod:`hf_noloco.io.export_files`), or those a checkpoint's checksum record lists (``hub_strategy``
``checkpoint``/``all_checkpoints``). Nothing else in ``output_dir`` goes: not ``checkpoint-*``, partial
(``tmp-*``) or damaged (``skipped-*``) folders, dotfiles such as ``.env``, logs, ``wandb/``; and an export
never uploads a pickled file (``*.bin``, ``*.pt``, ...) even if one were listed.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future

from huggingface_hub import HfApi, get_token
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import HFValidationError, validate_repo_id

from hf_noloco.io.checkpoint_files import recorded_files
from hf_noloco.io.export_files import exported_files

logger = logging.getLogger(__name__)

DEFAULT_COMMIT_MESSAGE = "Upload model trained with hf_noloco (NoLoCo)"

# Never published with an export, even if listed: pickles (arbitrary code on load), trainer checkpoints and
# local run logs (a second guard behind the allow-list).
IGNORE_PATTERNS = [
    "*.bin",
    "*.pt",
    "*.pth",
    "*.pkl",
    "*.pickle",
    "*.ckpt",
    "checkpoint-*",
    "checkpoint-*/**",
    "**/checkpoint-*/**",
    "wandb/**",
    "runs/**",
    "*.tmp",
]


def upload_list(folder: str) -> list[str]:
    """The files of ``folder`` (relative paths) that a push uploads: an export's, from its manifest, or a
    checkpoint's, from its checksum record (its tensors and optimizer states are what a resume elsewhere
    needs; it reads them with ``torch.load(weights_only=True)``)."""
    files = exported_files(folder)
    if files is None:
        files = recorded_files(folder)
    if files is None:
        raise ValueError(
            f"Cannot push {folder}: it holds neither an export's manifest nor a checkpoint's checksum record "
            "(only what hf_noloco wrote and recorded is uploaded)."
        )
    return files


def _allow_patterns(files: list[str]) -> list[str]:
    """Patterns that match exactly ``files`` (fnmatch's special characters escaped)."""
    escape = {"*": "[*]", "?": "[?]", "[": "[[]"}
    return ["".join(escape.get(c, c) for c in name.replace(os.sep, "/")) for name in files]


def describe_hub_error(exc: BaseException) -> str:
    """An upload's error without anything it may carry (URLs, headers): its type and HTTP status."""
    status = getattr(getattr(exc, "response", None), "status_code", None)
    return type(exc).__name__ + (f" (HTTP {status})" if status else "")


def resolve_token(token: str | None = None) -> str | None:
    """The token to use: ``token``, else ``HF_TOKEN``, else the one saved by ``hf auth login``; ``None`` if
    none."""
    return token or os.environ.get("HF_TOKEN") or get_token()


def check_hub_settings(push_to_hub: bool, hub_model_id: str | None, token: str | None = None) -> str | None:
    """Fails fast, before any training, when a push at the end could not work.

    Raises:
        ValueError: ``push_to_hub`` without ``hub_model_id``, with an invalid repo id, or without a token
            (argument, ``HF_TOKEN`` or ``hf auth login``). The token itself never appears in the message.

    Returns:
        The repo id to push to (``None`` when not pushing).
    """
    if not push_to_hub:
        return None
    if not hub_model_id:
        raise ValueError(
            "push_to_hub=True needs a repository to push to: set hub_model_id (e.g. "
            "`your-name/my-noloco-model`)."
        )
    try:
        validate_repo_id(hub_model_id)
    except HFValidationError as exc:
        raise ValueError(f"hub_model_id={hub_model_id!r} is not a valid Hub repository id: {exc}") from None
    if not resolve_token(token):
        raise ValueError(
            "push_to_hub=True needs a Hugging Face token with write access: pass hub_token, set the HF_TOKEN "
            "environment variable, or run `hf auth login` before training."
        )
    return hub_model_id


def push_folder_to_hub(
    folder: str | os.PathLike,
    repo_id: str,
    token: str | None = None,
    private: bool | None = None,
    commit_message: str = DEFAULT_COMMIT_MESSAGE,
    revision: str | None = None,
    api: HfApi | None = None,
    files: list[str] | None = None,
) -> str:
    """Creates ``repo_id`` if needed and uploads ``folder``'s export to it in one commit (call it on one rank
    only).

    Args:
        folder: the exported checkpoint (config, safetensors, tokenizer, README.md, plot, manifest).
        repo_id: ``namespace/name`` (or ``name`` for the token's user).
        token: write token; default: ``HF_TOKEN`` or the saved login.
        private: visibility of a newly created repo (``None``: the Hub's default).
        commit_message: the commit's summary.
        revision: branch to push to (created from the default branch if missing).
        api: an ``HfApi`` to use (tests point one at a local server).
        files: the files to upload (default: :func:`upload_list`).

    Returns:
        The URL of the commit.
    """
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"Cannot push {folder}: not a folder (export the model first).")
    files = upload_list(folder) if files is None else files
    api = api if api is not None else HfApi()
    token = resolve_token(token) if api.token is None else (token or api.token)
    repo_url = api.create_repo(repo_id, token=token, private=private, exist_ok=True, repo_type="model")
    repo_id = repo_url.repo_id or repo_id  # the Hub fills in the user namespace of a bare name
    if revision is not None:
        api.create_branch(repo_id, branch=revision, token=token, exist_ok=True)
    logger.info("Uploading %d files of %s to the Hub repository %s", len(files), folder, repo_id)  # no token
    commit = api.upload_folder(
        repo_id=repo_id,
        folder_path=folder,
        commit_message=commit_message,
        revision=revision,
        token=token,
        allow_patterns=_allow_patterns(files),
        ignore_patterns=list(IGNORE_PATTERNS),
    )
    logger.info("Pushed to %s", commit.commit_url)
    return commit.commit_url


def prepare_repository(
    repo_id: str,
    token: str | None = None,
    private: bool | None = None,
    revision: str | None = None,
    api: HfApi | None = None,
) -> str:
    """Checks the token (``whoami``: it must be valid and, when the Hub says, allowed to write) and creates
    ``repo_id`` (and the branch ``revision``) if it does not exist yet: before training, so that a push at a
    save or at the end cannot fail for either. Call it on one rank.

    Raises:
        ValueError: an invalid or read-only token, or a repository that cannot be created (named, without
            the token).

    Returns:
        The repository's full id (the Hub fills in the user namespace of a bare name).
    """
    api = api if api is not None else HfApi()
    token = resolve_token(token)
    try:
        role = api.whoami(token=token).get("auth", {}).get("accessToken", {}).get("role")
    except HfHubHTTPError as exc:
        status = getattr(exc.response, "status_code", None)
        raise ValueError(
            f"The Hugging Face token was refused by the Hub (HTTP {status}): push_to_hub needs a valid token "
            "with write access (hub_token, HF_TOKEN or `hf auth login`)."
        ) from None
    if role == "read":  # fine-grained tokens carry per-repository rights: create_repo is their check
        raise ValueError(
            f"The Hugging Face token is read-only: push_to_hub to {repo_id} needs a token with write access."
        )
    try:
        url = api.create_repo(repo_id, token=token, private=private, exist_ok=True, repo_type="model")
        repo_id = url.repo_id or repo_id
        if revision is not None:
            api.create_branch(repo_id, branch=revision, token=token, exist_ok=True)
    except HfHubHTTPError as exc:
        status = getattr(exc.response, "status_code", None)
        raise ValueError(f"Cannot create or reach the Hub repository {repo_id} (HTTP {status}).") from None
    return repo_id


def upload_in_background(
    folder: str,
    repo_id: str,
    commit_message: str,
    token: str | None = None,
    revision: str | None = None,
    path_in_repo: str | None = None,
    api: HfApi | None = None,
    files: list[str] | None = None,
    checkpoint: bool = False,
) -> Future:
    """Uploads ``folder``'s listed files (:func:`upload_list`, or ``files``) in one commit on a background
    thread, as the Trainer's pushes at a save do (training goes on meanwhile); returns the upload's future.
    ``checkpoint``: a checkpoint folder, whose optimizer states (``*.pt``) go too. Call it on one rank."""
    api = api if api is not None else HfApi()
    files = upload_list(folder) if files is None else files
    logger.info("Uploading %s to the Hub repository %s in the background", folder, repo_id)  # no token
    return api.upload_folder(
        repo_id=repo_id,
        folder_path=folder,
        path_in_repo=path_in_repo,
        commit_message=commit_message,
        token=resolve_token(token),
        revision=revision,
        allow_patterns=_allow_patterns(files),
        ignore_patterns=None if checkpoint else list(IGNORE_PATTERNS),
        run_as_future=True,
    )

"""The run's secret (``on_replica_loss="continue"``): where it comes from and where the store's host writes
it. No torch here: ``column_launch`` reads it before it imports torch (what the secret authenticates is
:mod:`hf_noloco.resilience.authentication`'s)."""

from __future__ import annotations

import os
import secrets
import stat

SECRET_ENV = "HF_NOLOCO_RUN_SECRET"
SECRET_FILE_ENV = "HF_NOLOCO_RUN_SECRET_FILE"
MIN_SECRET_CHARS = 32


class SecretError(ValueError):
    """No usable secret, or a store that cannot prove it: the run refuses to start (one ``error:`` line)."""


class StoreBindError(OSError):
    """The store's address cannot be bound (another process holds it)."""


# --------------------------------------------------------------------------------------------- the secret


def secret_path(port: int) -> str:
    """Where the store's host writes the secret of the run on ``port``, and where a column's launch looks for
    it by default: ``$XDG_CONFIG_HOME/hf_noloco/run-secret-<port>`` (``~/.config/...``). On a cluster whose
    home folder is shared, every machine finds it there; otherwise copy the file (or set
    ``HF_NOLOCO_RUN_SECRET_FILE``)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "hf_noloco", f"run-secret-{port}")


def read_secret(path: str | None = None) -> tuple[bytes, str] | None:
    """``(secret, where it came from)``: ``HF_NOLOCO_RUN_SECRET``, else the file ``path`` (or
    ``HF_NOLOCO_RUN_SECRET_FILE``) if it exists; ``None`` when neither gives one. A file that others than
    its owner may read, or a secret shorter than :data:`MIN_SECRET_CHARS`, is refused."""
    value = os.environ.get(SECRET_ENV)
    where = SECRET_ENV
    if not value:
        path = path or os.environ.get(SECRET_FILE_ENV)
        if not path or not os.path.isfile(path):
            return None
        mode = os.stat(path).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretError(
                f"the run's secret file {path} may be read by others than its owner: `chmod 600 {path}`."
            )
        with open(path) as f:
            value = f.read().strip()
        where = path
    if len(value) < MIN_SECRET_CHARS:
        raise SecretError(
            f"the run's secret ({where}) has {len(value)} characters, fewer than {MIN_SECRET_CHARS}: use "
            "`python -c 'import secrets; print(secrets.token_hex(32))'`."
        )
    return value.encode(), where


def env_secret() -> str | None:
    """``HF_NOLOCO_RUN_SECRET``, checked (:func:`read_secret`), or ``None``."""
    if not os.environ.get(SECRET_ENV):
        return None
    return read_secret()[0].decode()


def new_secret() -> str:
    return secrets.token_hex(32)


def write_secret(path: str, value: str) -> None:
    """Writes ``value`` to ``path``, readable by this user only (its folder too, when made here)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, value.encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)

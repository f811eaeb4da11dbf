"""Reads the history rows back from an offline wandb run file (``run-<id>.wandb``).

Layout: a 7-byte header, then LevelDB-log framing in 32 KiB blocks: chunks of crc32 (4 bytes), length
(uint16 LE), type (1 full, 2 first, 3 middle, 4 last) and payload; a whole payload is one ``Record``.
"""

import glob
import json
import os
import struct

from wandb.proto import wandb_internal_pb2

BLOCK = 32 * 1024
HEADER = 7


def _payloads(data: bytes):
    pos, pending = HEADER, b""
    while pos + 7 <= len(data):
        block_left = BLOCK - (pos % BLOCK)
        if block_left < 7:  # trailer padding
            pos += block_left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk
            pending = b""
        else:
            break


def _records(wandb_dir: str, kind: str):
    """The records of one type of the (single) offline run under ``wandb_dir``."""
    [path] = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))
    with open(path, "rb") as f:
        data = f.read()
    for payload in _payloads(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == kind:
            yield getattr(record, kind)


def _items(items) -> dict:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def history_rows(wandb_dir: str) -> list[dict]:
    """Every history row of the run, as {key: value}."""
    return [_items(history.item) for history in _records(wandb_dir, "history")]


def run_config(wandb_dir: str) -> dict:
    """The run's config, every update merged."""
    config = {}
    for update in _records(wandb_dir, "config"):
        config.update(_items(update.update))
    return config


def metric_summaries(wandb_dir: str) -> dict[str, set[str]]:
    """``{metric name or glob: the summaries defined for it}`` (``define_metric``)."""
    summaries = {}
    for metric in _records(wandb_dir, "metric"):
        name = metric.name or metric.glob_name
        kinds = {k for k in ("min", "max", "mean", "best", "last") if getattr(metric.summary, k, False)}
        summaries.setdefault(name, set()).update(kinds)
    return summaries

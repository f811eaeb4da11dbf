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
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk = data[pos + 7:pos + 7 + length]
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


def history_rows(wandb_dir: str) -> list[dict]:
    """Every history row of the (single) offline run under ``wandb_dir``, as {key: value}."""
    [path] = glob.glob(os.path.join(wandb_dir, "wandb", "offline-run-*", "run-*.wandb"))
    with open(path, "rb") as f:
        data = f.read()
    rows = []
    for payload in _payloads(data):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
    return rows

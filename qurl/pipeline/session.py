"""What a controller publishes in its run directory so rollout workers can find and trust it.

    runs/<run>/stream.key        the shared HMAC key of the stream, hex, mode 0600. Created once per
                                 run (or taken from stream.key in the config) and kept on resume, so
                                 workers of a resumed run authenticate with the same key.
    runs/<run>/controller.json   the live controller: session id (new per controller process), pid,
                                 the endpoint workers push trajectories and control messages to, the
                                 model dir engines start from, the number of worker slots.

Both are written atomically (temp file + rename), so a worker never reads half a file. A worker that
stops hearing from its controller re-reads controller.json: a new session id means a new controller
(after a resume) and the worker reconnects to the endpoints listed there.
"""
from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

KEY_FILE = "stream.key"
SESSION_FILE = "controller.json"


def load_or_create_key(run_dir: Path, configured: str = "") -> bytes:
    """The run's stream key: the configured one (>= 16 bytes), else the stored one, else a new
    random 32-byte key stored with mode 0600."""
    path = Path(run_dir) / KEY_FILE
    if configured:
        key = configured.encode()
        if len(key) < 16:
            raise ValueError("stream.key: must be at least 16 bytes (or empty for a random run key)")
    elif path.exists():
        return read_key(run_dir)
    else:
        key = secrets.token_bytes(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{KEY_FILE}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    os.replace(tmp, path)
    return key


def read_key(run_dir: Path) -> bytes:
    path = Path(run_dir) / KEY_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: no stream key (is a controller running for this run?)")
    try:
        key = bytes.fromhex(path.read_text().strip())
    except ValueError:
        raise ValueError(f"{path}: not a hex key") from None
    if len(key) < 16:
        raise ValueError(f"{path}: key shorter than 16 bytes")
    return key


def write_session(run_dir: Path, info: dict[str, Any]) -> None:
    for field in ("session", "inbound", "model_dir", "num_workers"):
        if field not in info:
            raise ValueError(f"controller session info lacks {field!r}")
    path = Path(run_dir) / SESSION_FILE
    tmp = path.with_name(f".{SESSION_FILE}.tmp")
    tmp.write_text(json.dumps(info, indent=1))
    os.replace(tmp, path)


def read_session(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / SESSION_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path}: no controller has published its endpoints yet")
    info = json.loads(path.read_text())
    if not isinstance(info, dict) or not isinstance(info.get("inbound"), str):
        raise ValueError(f"{path}: malformed (expected an object with an 'inbound' endpoint)")
    return info

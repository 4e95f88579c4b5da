"""A JSON object file, read only when whole (`read_json`) and written whole or not at all (`write_json`)."""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path


def read_json(path: Path, unreadable: dict | None = None) -> dict | None:
    """The JSON object in `path`: None when there is no such file; `unreadable` (None unless given) when it cannot be
    read, is not JSON or not an object (a file being written, torn, or not ours)."""
    try:
        value = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return unreadable
    return value if isinstance(value, dict) else unreadable


def write_json(path: Path, value: dict) -> None:
    """Written whole or not at all: to a file of its own beside `path`, renamed into place."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}")
    tmp.write_text(json.dumps(value, indent=1, default=str))
    os.replace(tmp, path)

"""Where a data file that datasets' reader could not read goes wrong: the file and the 1-based line (its own line
number, not a reader chunk's row) of the first row that cannot be parsed, found by reading the file again line by
line (json/jsonl: not JSON, not an object, a value whose type clashes with an earlier line's; csv: more fields than
the header, a stray quote), memory flat in its length; a parquet or arrow file that cannot be read is named whole.
Torch-free."""

from __future__ import annotations

import bz2
import csv
import gzip
import io
import json
import lzma
from pathlib import Path

import pyarrow as pa


def locate(module: str, files, sep: str = ",") -> tuple[str, int | None, str] | None:
    """(file, 1-based line or None, what is wrong) of the first row of `files` (read by datasets' `module` reader)
    that cannot be parsed; None when every row parses."""
    for f in files:
        if module == "json":
            found = _json_row(f)
        elif module == "csv":
            found = _csv_row(f, sep)
        elif module in ("parquet", "arrow"):
            found = _table_file(f, module)
        else:
            found = None
        if found:
            return (f, *found)
    return None


def _open(file: str):
    opener = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}.get(Path(file).suffix.lower(), open)
    return opener(file, "rb")


def _json_why(e: ValueError) -> str:
    if isinstance(e, json.JSONDecodeError):
        return f"not valid JSON: {e.msg} (column {e.colno})"
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8: byte {e.object[e.start:e.start + 1]!r} at column {e.start + 1}"
    return str(e)


def _json_row(file: str) -> tuple[int | None, str] | None:
    """JSON lines: the first line that is not a JSON object, else the first whose value types clash with an earlier
    line's (pyarrow's "changed from string to number"); a JSON document (a list, or an object over several lines):
    the line of its syntax error. Memory flat in the file's length, but for a document (read whole, as datasets does)."""
    first = True
    with _open(file) as fh:
        for n, raw in enumerate(fh, 1):
            line = raw.strip()
            if not line:
                continue
            if first and line[:1] == b"[":
                return _json_document(file)
            try:
                value = json.loads(line)
            except ValueError as e:
                if first:
                    return _json_document(file) if line[:1] == b"{" and not line.endswith(b"}") else (n, _json_why(e))
                return n, _json_why(e)
            first = False
            if not isinstance(value, dict):
                return n, f"a JSON {type(value).__name__} where each line must be an object"
    seen: dict[str, tuple[str, int]] = {}
    with _open(file) as fh:
        for n, raw in enumerate(fh, 1):
            line = raw.strip()
            if line:
                clash = _clash(json.loads(line), seen, n)
                if clash:
                    return n, clash
    return None


def _json_document(file: str) -> tuple[int | None, str] | None:
    with _open(file) as fh:
        try:
            json.load(io.TextIOWrapper(fh, encoding="utf-8"))
        except json.JSONDecodeError as e:
            return e.lineno, f"not valid JSON: {e.msg} (column {e.colno})"
        except UnicodeDecodeError as e:
            return None, f"not UTF-8 ({e.reason})"
    return None


KINDS = {str: "string", int: "number", float: "number", bool: "boolean", dict: "object", list: "array"}


def _clash(row: dict, seen: dict[str, tuple[str, int]], n: int) -> str | None:
    """The first field of a row whose JSON type differs from the type an earlier line gave it (null fits any)."""
    todo = [("", row)]
    while todo:
        path, value = todo.pop()
        if value is None:
            continue
        kind = KINDS.get(type(value), type(value).__name__)
        if path:
            had = seen.setdefault(path, (kind, n))
            if had[0] != kind:
                return f"'{path}' is {'an' if kind[0] in 'aeiou' else 'a'} {kind} where line {had[1]} has {'an' if had[0][0] in 'aeiou' else 'a'} {had[0]}"
        if isinstance(value, dict):
            todo.extend((f"{path}.{k}" if path else str(k), v) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            todo.extend((f"{path}[]", v) for v in reversed(value))
    return None


def _csv_row(file: str, sep: str) -> tuple[int | None, str] | None:
    """The first record with more fields than the header (pandas' "Expected 3 fields ... saw 4"), or that the csv
    module cannot split (a stray quote)."""
    with _open(file) as raw, io.TextIOWrapper(raw, encoding="utf-8", newline="") as fh:
        reader = csv.reader(fh, delimiter=sep)
        try:
            header = next(reader, None)
            for row in reader:
                if header is not None and len(row) > len(header):
                    return reader.line_num, f"{len(row)} fields where the header has {len(header)}"
        except csv.Error as e:
            return reader.line_num, str(e)
        except UnicodeDecodeError as e:
            return reader.line_num + 1, f"not UTF-8 ({e.reason})"
    return None


def _table_file(file: str, module: str) -> tuple[None, str] | None:
    """A parquet or arrow file that cannot be read whole (its row groups or batches read one at a time)."""
    try:
        if module == "parquet":
            import pyarrow.parquet as pq

            pf = pq.ParquetFile(file)
            for i in range(pf.num_row_groups):
                pf.read_row_group(i)
        else:
            with open(file, "rb") as fh:
                try:
                    for _ in pa.ipc.open_stream(fh):
                        pass
                except pa.ArrowInvalid:
                    fh.seek(0)
                    reader = pa.ipc.open_file(fh)
                    for i in range(reader.num_record_batches):
                        reader.get_batch(i)
    except (pa.ArrowException, OSError, ValueError) as e:
        return None, f"not a readable {module} file: {(str(e).splitlines() or [''])[0][:160]}"
    return None

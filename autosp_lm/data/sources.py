"""Reading raw text inputs for tokenizer training and preprocessing.

Two kinds of input file, told apart by name:

* **jsonl** (``.jsonl``, ``.json``, ``.ndjson``, optionally ``.gz``): one JSON object per line;
  the text of each requested key (``--json-keys``, default ``text``) is one document. A line that
  is not a JSON object, lacks a key, or holds a non-string under it is *malformed*: an error
  naming ``file:line`` (or, with ``skip_bad_lines``, counted and skipped). Blank lines are ignored.
* **plain text** (anything else, optionally ``.gz``): ``document_per="file"`` (default) makes the
  whole file one document, ``"line"`` each non-blank line, ``"paragraph"`` each blank-line
  separated block. Plain-text documents are stored under the first json key.
"""
from __future__ import annotations

import gzip
import io
import json
import os
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
DOCUMENT_PER = ("file", "line", "paragraph")


class BadLineError(ValueError):
    """A malformed jsonl line; the message starts with ``file:line:``."""

    def __init__(self, path: str, lineno: int, reason: str):
        super().__init__(f"{path}:{lineno}: {reason}")
        self.path, self.lineno, self.reason = path, lineno, reason


@dataclass
class Record:
    """One unit of raw input, before parsing and tokenization."""
    path: str
    lineno: int  # 1-based line of a jsonl record or of a text document's first line
    kind: str  # "json" (payload: the raw line) or "text" (payload: the document text)
    payload: str

    @property
    def nbytes(self) -> int:
        return len(self.payload)


@dataclass
class SourceStats:
    bad_lines: int = 0
    bad_examples: list = field(default_factory=list)  # first few messages, for the log


def is_jsonl(path: str) -> bool:
    name = path[:-3] if path.endswith(".gz") else path
    return name.lower().endswith(JSONL_SUFFIXES)


def open_text(path: str):
    """Open a (possibly gzipped) UTF-8 text file; undecodable bytes become U+FFFD."""
    if path.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace",
                                newline="")
    return open(path, "r", encoding="utf-8", errors="replace", newline="")


def check_inputs(paths: Sequence[str]) -> list[str]:
    """Fail early, naming the file, when an input is missing or not a file."""
    if not paths:
        raise ValueError("no input files given")
    out = []
    for p in paths:
        p = os.fspath(p)
        if not os.path.exists(p):
            raise FileNotFoundError(f"input file not found: {p}")
        if not os.path.isfile(p):
            raise ValueError(f"input is not a regular file: {p}")
        out.append(p)
    return out


def input_bytes(paths: Sequence[str]) -> int:
    return sum(os.path.getsize(p) for p in paths)


def iter_records(paths: Sequence[str], document_per: str = "file") -> Iterator[Record]:
    """Raw records of every input, in order (no parsing: that happens in worker processes)."""
    if document_per not in DOCUMENT_PER:
        raise ValueError(f"document_per must be one of {DOCUMENT_PER}, got {document_per!r}")
    for path in check_inputs(paths):
        with open_text(path) as f:
            if is_jsonl(path):
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        yield Record(path, lineno, "json", line)
            elif document_per == "file":
                yield Record(path, 1, "text", f.read())
            elif document_per == "line":
                for lineno, line in enumerate(f, 1):
                    line = line.rstrip("\r\n")
                    if line.strip():
                        yield Record(path, lineno, "text", line)
            else:
                block, first = [], 0
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        if not block:
                            first = lineno
                        block.append(line)
                    elif block:
                        yield Record(path, first, "text", "".join(block).rstrip("\r\n"))
                        block = []
                if block:
                    yield Record(path, first, "text", "".join(block).rstrip("\r\n"))


def parse_record(rec: Record, keys: Sequence[str]) -> dict[str, str]:
    """The documents of one record, by key; raises :class:`BadLineError` for malformed jsonl."""
    if rec.kind == "text":
        return {keys[0]: rec.payload}
    try:
        obj = json.loads(rec.payload)
    except json.JSONDecodeError as e:
        raise BadLineError(rec.path, rec.lineno, f"malformed JSON ({e.msg} at column {e.colno})") \
            from None
    if not isinstance(obj, dict):
        raise BadLineError(rec.path, rec.lineno,
                           f"expected a JSON object, found {type(obj).__name__}")
    out = {}
    for k in keys:
        if k not in obj:
            raise BadLineError(rec.path, rec.lineno, f"no key {k!r} (keys: {sorted(obj)[:10]})")
        v = obj[k]
        if not isinstance(v, str):
            raise BadLineError(rec.path, rec.lineno,
                               f"key {k!r} holds {type(v).__name__}, expected a string")
        out[k] = v
    return out


def iter_documents(paths: Sequence[str], keys: Sequence[str] = ("text",), *,
                   document_per: str = "file", skip_bad_lines: bool = False,
                   stats: Optional[SourceStats] = None) -> Iterator[dict[str, str]]:
    """Parsed documents (``{key: text}``) in the calling process (used by tokenizer training)."""
    for rec in iter_records(paths, document_per):
        try:
            yield parse_record(rec, keys)
        except BadLineError as e:
            if not skip_bad_lines:
                raise
            if stats is not None:
                stats.bad_lines += 1
                if len(stats.bad_examples) < 5:
                    stats.bad_examples.append(str(e))


__all__ = ["BadLineError", "Record", "SourceStats", "is_jsonl", "open_text", "check_inputs",
           "input_bytes", "iter_records", "parse_record", "iter_documents", "DOCUMENT_PER"]

"""Input discovery and readers: files, directories and globs of JSONL, Parquet and text.

Reading is split in two so the expensive half runs in the workers (threads or processes):

* ``read_chunks`` (the calling thread) streams a file as ``RawChunk`` s: blobs of whole lines for
  JSONL and line-per-document text, a whole file for document-per-file text, an Arrow
  array slice for Parquet. It only reads and decompresses (gzip, zstd by extension).
* ``parse_chunk`` (worker) decodes UTF-8, parses JSON and picks the text field, returning
  the texts with their line numbers plus a ``BadRecord`` for every record it could not use.

``iter_records`` joins the two for callers that just want ``Record(path, line_number, text)``.
"""

from __future__ import annotations

import dataclasses
import functools
import gzip
import json
import os
import zlib
from collections.abc import Callable, Iterator, Sequence
from glob import glob
from typing import Any, BinaryIO

from tokenloom.errors import ConfigError, InputError
from tokenloom.io.remote import open_object
from tokenloom.io.s3 import head, is_remote, list_objects

INPUT_FORMATS = ("auto", "jsonl", "parquet", "text", "chat", "spans")
"""``auto`` picks the format of each file from its extension (``EXTENSION_FORMATS``); ``chat``
(``messages`` with roles) and ``spans`` (``input_ids`` with ``loss_spans``) are JSONL files whose
records carry a loss mask (:mod:`tokenloom.tokenization.chat`, :mod:`tokenloom.tokenization.spans`)."""

RECORD_FORMATS = {"chat": "jsonl", "spans": "jsonl"}
"""Input formats of records with a loss mask -> the file format they are read as."""

EXTENSION_FORMATS = {
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".txt": "text",
    ".text": "text",
    ".md": "text",
}
"""File extension (after any compression suffix) -> input format."""

COMPRESSION_EXTENSIONS = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}

BAD_RECORD_REASONS = (
    "invalid_utf8",
    "invalid_unicode",
    "malformed_json",
    "not_an_object",
    "missing_key",
    "not_a_string",
    "bad_conversation",
    "template_error",
    "bad_spans",
)
"""Why a record can be rejected; the keys of ``TokenizeSummary.skipped``. The last three are
chat and spans records': a conversation Megatron's ``SFTDataset`` cannot mask (an unknown role, a
message without content, no assistant turn), a chat template that fails on it or renders its
messages otherwise than the whole, and ids or spans out of range."""

_SIDECAR_SUFFIX = ".meta.json"  # token store sidecars are not inputs, though they end in .json


@dataclasses.dataclass(frozen=True, kw_only=True)
class InputFile:
    """One input file and how to read it."""

    path: str
    """The path as discovered (relative paths stay relative)."""

    format: str
    """``"jsonl"``, ``"parquet"`` or ``"text"``."""

    compression: str | None
    """``"gzip"``, ``"zstd"`` or None, from the file extension."""

    size_bytes: int
    """Size on disk (compressed), used for progress."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Record:
    """One document's text and where it came from."""

    path: str
    line_number: int
    """1-based line (JSONL, text) or row (Parquet) of the record; 1 for a whole-file document."""

    text: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class BadRecord:
    """A record that could not be used, with a message naming the file and line."""

    path: str
    line_number: int
    reason: str
    """One of ``BAD_RECORD_REASONS``."""

    message: str
    """``"{path}:{line}: what was wrong"`` (``row`` instead of a line for Parquet)."""


class RecordError(InputError):
    """A chat or spans record that cannot be used: ``reason`` (one of ``BAD_RECORD_REASONS``) and
    a message naming the file and line. Raised inside a worker; the pipeline turns it into a
    ``BadRecord`` (an InputError with the same message, or a count under ``skip_bad``)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclasses.dataclass(frozen=True, kw_only=True)
class RawChunk:
    """Unparsed records read from one file: the unit the main process hands to a worker."""

    path: str
    kind: str
    """``"jsonl"`` / ``"lines"`` (payload: bytes of whole lines), ``"document"`` (payload:
    a whole file's bytes), ``"parquet"`` (payload: a pyarrow string or binary array)."""

    first_line: int
    """1-based line or row number of the payload's first line or row."""

    payload: Any
    num_bytes: int
    """Payload size in bytes (text, before tokenizing), used to size worker batches."""

    input_bytes_done: int
    """Bytes of the file on disk consumed once this chunk is read (for progress)."""


@dataclasses.dataclass(kw_only=True)
class ParsedObjects:
    """What ``parse_objects`` made of a JSONL ``RawChunk``: the JSON values of its lines."""

    objects: list[Any]
    line_numbers: list[int]
    """(len(objects),) line number of each."""

    bad: list[BadRecord]


@dataclasses.dataclass(kw_only=True)
class ParsedChunk:
    """What ``parse_chunk`` made of a ``RawChunk``."""

    texts: list[str]
    line_numbers: list[int]
    """(len(texts),) line or row number of each text."""

    bad: list[BadRecord]


# -- discovery ------------------------------------------------------------------------------------
def _split_extension(path: str) -> tuple[str, str | None]:
    """(format extension, compression) of a path, e.g. ('.jsonl', 'zstd') for x.jsonl.zst."""
    base, ext = os.path.splitext(path.lower())
    compression = COMPRESSION_EXTENSIONS.get(ext)
    if compression is not None:
        ext = os.path.splitext(base)[1]
    return ext, compression


def detect_format(path: str, input_format: str = "auto") -> tuple[str | None, str | None]:
    """(format, compression) of ``path``; format None when ``auto`` cannot tell."""
    ext, compression = _split_extension(path)
    if input_format != "auto":
        return RECORD_FORMATS.get(input_format, input_format), compression
    return EXTENSION_FORMATS.get(ext), compression


def _walk_directory(directory: str, input_format: str) -> list[str]:
    found = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if name.startswith(".") or name.endswith(_SIDECAR_SUFFIX):
                continue
            path = os.path.join(root, name)
            if detect_format(path, input_format)[0] is not None:
                found.append(path)
    if not found:
        raise InputError(
            f"{directory}: directory holds no input files (extensions "
            f"{sorted(EXTENSION_FORMATS)}, optionally + .gz/.zst); name the format to read "
            "every file in it"
        )
    return found


def open_input(path: str, *, buffer_bytes: int = 8 << 20) -> BinaryIO:
    """A seekable binary file over a local path or an ``s3://`` object (read in ranged GETs)."""
    if is_remote(path):
        return open_object(path, buffer_bytes=buffer_bytes)
    return open(path, "rb")


def _input_size(path: str) -> int:
    return head(path).size if is_remote(path) else os.path.getsize(path)


def _expand_remote(url: str, input_format: str) -> list[str]:
    """One object, or every object under ``url`` as a folder (keys in order, as a directory walk)."""
    listed = [path for path, _ in list_objects(url)]  # keys that start with url's key
    if url in listed:
        return [url]
    folder = url if url.endswith("/") else url + "/"
    found = []
    for path in listed:
        name = path.rsplit("/", 1)[-1]
        if not path.startswith(folder) or not name or name.startswith(".") or name.endswith(_SIDECAR_SUFFIX):
            continue
        if detect_format(path, input_format)[0] is not None:
            found.append(path)
    if not found:
        raise InputError(f"input {url}: no such object, and no readable object under {folder} (known "
                         f"extensions {sorted(EXTENSION_FORMATS)}, optionally + .gz/.zst)")
    return found


def _expand(pattern: str, input_format: str) -> list[str]:
    if is_remote(pattern):
        return _expand_remote(pattern, input_format)
    if os.path.isfile(pattern):
        return [pattern]
    if os.path.isdir(pattern):
        return _walk_directory(pattern, input_format)
    if not any(c in pattern for c in "*?["):
        raise InputError(f"input {pattern!r}: no such file or directory")
    paths = []
    for hit in sorted(glob(pattern, recursive=True)):
        if os.path.isdir(hit):
            paths.extend(_walk_directory(hit, input_format))
        elif os.path.isfile(hit):
            paths.append(hit)
    if not paths:
        raise InputError(f"input pattern {pattern!r} matches no file")
    return paths


def discover_inputs(patterns: Sequence[str], *, input_format: str = "auto") -> list[InputFile]:
    """Expand files, directories (recursively) and globs into a deterministic file list.

    Order: the patterns in the order given, each expanded in sorted path order; a file named
    twice is read once. Directories contribute files with a known extension (every file when
    ``input_format`` is not ``auto``), skipping hidden names and token store sidecars
    (``*.meta.json``). An explicitly named file with an
    unknown extension is read as text. Raises InputError for a path that matches nothing.
    """
    if input_format not in INPUT_FORMATS:
        raise ConfigError(f"input format {input_format!r}, expected one of {INPUT_FORMATS}")
    if isinstance(patterns, (str, os.PathLike)):
        patterns = [patterns]
    if not patterns:
        raise InputError("no inputs given; expected files, directories or glob patterns")
    seen: set[str] = set()
    inputs = []
    for pattern in patterns:
        for path in _expand(os.fspath(pattern), input_format):
            key = path if is_remote(path) else os.path.realpath(path)
            if key in seen:
                continue
            seen.add(key)
            fmt, compression = detect_format(path, input_format)
            fmt = fmt or "text"
            if fmt == "parquet" and compression is not None:
                raise InputError(
                    f"{path}: a Parquet file cannot be {compression}-compressed as a whole; "
                    "Parquet compresses its column chunks itself"
                )
            inputs.append(
                InputFile(path=path, format=fmt, compression=compression, size_bytes=_input_size(path))
            )
    return inputs


# -- reading (main process) -----------------------------------------------------------------------
def open_binary(raw: BinaryIO, compression: str | None) -> BinaryIO:
    """A binary stream over ``raw`` that decompresses ``gzip`` or ``zstd`` transparently."""
    if compression is None:
        return raw
    if compression == "gzip":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if compression == "zstd":
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
    raise ConfigError(f"compression {compression!r}, expected one of {sorted(set(COMPRESSION_EXTENSIONS.values()))}")


def _decompression_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [OSError, EOFError, zlib.error]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:  # pragma: no cover
        pass
    return tuple(errors)


def _read_line_blobs(source: InputFile, kind: str, chunk_bytes: int,
                     byte_range: tuple[int, int] | None = None, first_line: int = 1) -> Iterator[RawChunk]:
    with open_input(source.path) as raw:
        stream = open_binary(raw, source.compression)
        remaining = None
        if byte_range is not None:  # an uncompressed file's lines starting in [begin, end)
            raw.seek(byte_range[0])
            remaining = byte_range[1] - byte_range[0]
        tail: list[bytes] = []  # the last line so far, not yet ended by a newline
        line = first_line
        while True:
            want = max(chunk_bytes, 1)
            if remaining is not None:
                want = min(want, remaining)
            block = stream.read(want) if want else b""
            if remaining is not None:
                remaining -= len(block)
            cut = block.rfind(b"\n") + 1 if block else len(block)
            if block and not cut:  # no line ends in this block: keep it for the next
                tail.append(block)
                continue
            # one copy at most: the whole lines, the tail before them joined on
            blob = b"".join([*tail, memoryview(block)[:cut]]) if tail or cut < len(block) else block
            tail = [block[cut:]] if cut < len(block) else []
            if blob:
                yield RawChunk(
                    path=source.path,
                    kind=kind,
                    first_line=line,
                    payload=blob,
                    num_bytes=len(blob),
                    input_bytes_done=raw.tell(),
                )
                line += blob.count(b"\n")
            if not block:
                return


def _read_document(source: InputFile) -> Iterator[RawChunk]:
    with open_input(source.path) as raw:
        data = open_binary(raw, source.compression).read()
    yield RawChunk(
        path=source.path,
        kind="document",
        first_line=1,
        payload=data,
        num_bytes=len(data),
        input_bytes_done=source.size_bytes,
    )


def _require_pyarrow():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ConfigError(
            "reading Parquet needs pyarrow; install it with: pip install 'tokenloom[parquet]'"
        ) from exc
    return pyarrow


def _read_parquet(source: InputFile, column: str, chunk_bytes: int) -> Iterator[RawChunk]:
    pa = _require_pyarrow()
    try:
        parquet = pa.parquet.ParquetFile(open_input(source.path) if is_remote(source.path) else source.path)
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{source.path}: not a readable Parquet file: {exc}") from exc
    schema = parquet.schema_arrow
    if column not in schema.names:
        raise InputError(
            f"{source.path}: no column {column!r}; the file has columns {schema.names}"
        )
    kind = schema.field(column).type
    if not (
        pa.types.is_string(kind) or pa.types.is_large_string(kind)
        or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
    ):
        raise InputError(
            f"{source.path}: column {column!r} has type {kind}, expected a string column"
        )
    metadata = parquet.metadata
    column_index = schema.names.index(column)
    total_rows = max(metadata.num_rows, 1)
    row = 1
    for group in range(metadata.num_row_groups):
        group_meta = metadata.row_group(group)
        if group_meta.num_rows == 0:
            continue
        group_bytes = group_meta.column(column_index).total_uncompressed_size
        rows_per_batch = max(1, int(group_meta.num_rows * chunk_bytes // max(group_bytes, 1)))
        for batch in parquet.iter_batches(batch_size=rows_per_batch, row_groups=[group], columns=[column]):
            array = batch.column(0)
            yield RawChunk(
                path=source.path,
                kind="parquet",
                first_line=row,
                payload=array,
                num_bytes=int(array.nbytes),
                input_bytes_done=source.size_bytes * (row - 1 + len(array)) // total_rows,
            )
            row += len(array)


def splittable(source: InputFile, *, lines: bool = False) -> bool:
    """Whether ``source`` can be read in byte ranges cut at line starts: uncompressed JSONL, or
    text read one document per line."""
    return source.compression is None and (source.format == "jsonl" or (source.format == "text" and lines))


def line_start_at_or_after(path: str, offset: int, size: int) -> int:
    """The first position ``>= offset`` where a line starts (0, just after a newline, or ``size``)."""
    if offset <= 0:
        return 0
    with open_input(path, buffer_bytes=1 << 16) as f:
        f.seek(offset - 1)
        position = offset - 1
        while True:
            block = f.read(1 << 16)
            if not block:
                return size
            found = block.find(b"\n")
            if found >= 0:
                return min(size, position + found + 1)
            position += len(block)


def count_lines(path: str, begin: int, end: int) -> int:
    """Newlines in bytes ``[begin, end)`` of ``path``."""
    count = 0
    with open_input(path) as f:
        f.seek(begin)
        remaining = end - begin
        while remaining > 0:
            block = f.read(min(1 << 24, remaining))
            if not block:
                break
            count += block.count(b"\n")
            remaining -= len(block)
    return count


def read_chunks(
    source: InputFile, *, lines: bool = False, column: str = "text", chunk_bytes: int = 1 << 20,
    byte_range: tuple[int, int] | None = None, first_line: int = 1,
) -> Iterator[RawChunk]:
    """Stream ``source`` as raw chunks of about ``chunk_bytes`` (see the module docstring).

    ``lines`` makes a text file one document per non-blank line instead of one per file;
    ``column`` is the Parquet column holding the text. ``byte_range`` (a :func:`splittable`
    file only) reads the lines starting in ``[begin, end)`` of the file, both at line starts,
    numbering them from ``first_line``.
    """
    if byte_range is not None and not splittable(source, lines=lines):
        raise ConfigError(f"{source.path}: a byte range of a {source.compression or source.format} file; only "
                          "uncompressed JSONL and line-per-document text split at line starts")
    try:
        if source.format == "jsonl":
            yield from _read_line_blobs(source, "jsonl", chunk_bytes, byte_range, first_line)
        elif source.format == "text":
            yield from (_read_line_blobs(source, "lines", chunk_bytes, byte_range, first_line) if lines
                        else _read_document(source))
        elif source.format == "parquet":
            yield from _read_parquet(source, column, chunk_bytes)
        else:
            raise ConfigError(f"{source.path}: input format {source.format!r}, expected jsonl, parquet or text")
    except _decompression_errors() as exc:
        if isinstance(exc, FileNotFoundError):
            raise InputError(f"{source.path}: input file disappeared while reading") from exc
        raise InputError(
            f"{source.path}: cannot read ({source.compression or 'uncompressed'}): {exc}; "
            "is the file truncated or compressed differently from its extension?"
        ) from exc


# -- parsing (worker) -----------------------------------------------------------------------------
def _lookup(obj: dict, key: str, parts: list[str]) -> tuple[bool, Any]:
    if key in obj:
        return True, obj[key]
    value: Any = obj
    for part in parts:
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


@functools.cache
def _fast_json_loads() -> Callable[[bytes], Any] | None:
    """orjson's ``loads`` when installed (the ``[tokenizers]`` extra), else None.

    Parsing JSON in Python costs a large share of a fast tokenizer's time; orjson parses the
    lines from bytes (UTF-8 checked) about twice as fast as decoding them and calling
    ``json.loads``. It is only a fast path: a line it refuses, or whose text is not a string,
    is parsed again with ``json``, so what is read and every message about a bad record are
    the same with or without it (``json`` also takes NaN, 1e400 and a byte-order mark, and
    keeps lone surrogates for the encoder to reject).
    """
    try:
        import orjson
    except ImportError:
        return None
    return orjson.loads


def _line_views(blob: bytes) -> Iterator[memoryview]:
    """The blob's lines (``\\n`` cut, as ``bytes.split``) as views: no copy of the text."""
    view = memoryview(blob)
    find = blob.find
    start = 0
    while True:
        end = find(b"\n", start)
        if end < 0:
            yield view[start:]
            return
        yield view[start:end]
        start = end + 1


def _split_lines(blob: bytes) -> list[bytes] | list[str]:
    """The blob's lines, decoded in one go when the whole blob is valid UTF-8."""
    try:
        return blob.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        return blob.split(b"\n")


def _utf8_error(path: str, where: str, data: bytes, start: int, unit: str) -> str:
    """``path:where: invalid UTF-8 at byte N of the <unit> (b'...')``."""
    return f"{path}:{where}: invalid UTF-8 at byte {start} of the {unit} ({data[start:start + 4]!r})"


def parse_chunk(chunk: RawChunk, *, text_key: str = "text", first_bad_only: bool = False) -> ParsedChunk:
    """Turn a raw chunk into texts; records that cannot be used become ``BadRecord`` s.

    Blank lines are not records and are skipped silently. With ``first_bad_only`` parsing
    stops at the first bad record (the caller will raise it anyway).
    """
    texts: list[str] = []
    numbers: list[int] = []
    bad: list[BadRecord] = []
    path = chunk.path

    def reject(number: int, reason: str, message: str) -> bool:
        bad.append(BadRecord(path=path, line_number=number, reason=reason, message=message))
        return first_bad_only

    if chunk.kind == "document":
        try:
            texts.append(chunk.payload.decode("utf-8"))
            numbers.append(1)
        except UnicodeDecodeError as exc:
            line = chunk.payload.count(b"\n", 0, exc.start) + 1
            line_start = chunk.payload.rfind(b"\n", 0, exc.start) + 1
            message = _utf8_error(path, f"{line}", chunk.payload[line_start:], exc.start - line_start, "line")
            reject(line, "invalid_utf8", message)
        return ParsedChunk(texts=texts, line_numbers=numbers, bad=bad)

    if chunk.kind == "parquet":
        for offset, value in enumerate(chunk.payload.to_pylist()):
            number = chunk.first_line + offset
            if isinstance(value, bytes):
                try:
                    value = value.decode("utf-8")
                except UnicodeDecodeError as exc:
                    if reject(number, "invalid_utf8", _utf8_error(path, f"row {number}", value, exc.start, "value")):
                        break
                    continue
            if value is None:
                if reject(number, "not_a_string", f"{path}:row {number}: the text is null"):
                    break
                continue
            texts.append(value)
            numbers.append(number)
        return ParsedChunk(texts=texts, line_numbers=numbers, bad=bad)

    is_json = chunk.kind == "jsonl"
    fast_loads = _fast_json_loads() if is_json else None
    parts = text_key.split(".")
    lines = _line_views(chunk.payload) if fast_loads is not None else _split_lines(chunk.payload)
    for offset, line in enumerate(lines):
        if not line:
            continue
        if fast_loads is not None:
            # The common record takes the fast parser; anything else (not parsed, not an
            # object, no string under the key) goes the way below, which decides with json.
            try:
                obj = fast_loads(line)
            except ValueError:
                pass
            else:
                if type(obj) is dict:
                    value = obj[text_key] if text_key in obj else _lookup(obj, text_key, parts)[1]
                    if type(value) is str:
                        texts.append(value)
                        numbers.append(chunk.first_line + offset)
                        continue
            line = bytes(line)
        number = chunk.first_line + offset
        if isinstance(line, bytes):
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                if reject(number, "invalid_utf8", _utf8_error(path, f"{number}", line, exc.start, "line")):
                    break
                continue
        if line.isspace():
            continue
        if not is_json:
            texts.append(line[:-1] if line.endswith("\r") else line)
            numbers.append(number)
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            reason = exc.msg.removesuffix(" at")  # json's "Unterminated string starting at" wants a position
            if reject(number, "malformed_json", f"{path}:{number}: malformed JSON: {reason} at column {exc.colno}"):
                break
            continue
        if not isinstance(obj, dict):
            if reject(number, "not_an_object", f"{path}:{number}: expected a JSON object, got {_json_type(obj)}"):
                break
            continue
        found, value = _lookup(obj, text_key, parts)
        if not found:
            keys = sorted(obj)[:8]
            if reject(number, "missing_key", f"{path}:{number}: no key {text_key!r} in the object (its keys: {keys})"):
                break
            continue
        if not isinstance(value, str):
            message = f"{path}:{number}: {text_key!r} is {_json_type(value)}, expected a string"
            if reject(number, "not_a_string", message):
                break
            continue
        texts.append(value)
        numbers.append(number)
    return ParsedChunk(texts=texts, line_numbers=numbers, bad=bad)


def parse_objects(chunk: RawChunk, *, first_bad_only: bool = False) -> ParsedObjects:
    """The JSON values of a JSONL chunk's lines (chat and spans records; the caller checks their
    shape). Blank lines are skipped; a line that is not valid UTF-8 or not JSON becomes a
    ``BadRecord`` with the same message :func:`parse_chunk` gives it."""
    objects: list[Any] = []
    numbers: list[int] = []
    bad: list[BadRecord] = []
    path = chunk.path
    fast_loads = _fast_json_loads()
    for offset, line in enumerate(chunk.payload.split(b"\n")):
        number = chunk.first_line + offset
        if not line or line.isspace():
            continue
        if fast_loads is not None:
            try:  # the common line; anything it refuses is decided by json below
                objects.append(fast_loads(line))
                numbers.append(number)
                continue
            except ValueError:
                pass
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            bad.append(BadRecord(path=path, line_number=number, reason="invalid_utf8",
                                 message=_utf8_error(path, f"{number}", line, exc.start, "line")))
            if first_bad_only:
                break
            continue
        try:
            objects.append(json.loads(text))
            numbers.append(number)
        except json.JSONDecodeError as exc:
            reason = exc.msg.removesuffix(" at")
            bad.append(BadRecord(path=path, line_number=number, reason="malformed_json",
                                 message=f"{path}:{number}: malformed JSON: {reason} at column {exc.colno}"))
            if first_bad_only:
                break
    return ParsedObjects(objects=objects, line_numbers=numbers, bad=bad)


def iter_records(
    source: InputFile, *, text_key: str = "text", lines: bool = False, column: str = "text",
    skip_bad: bool = False,
) -> Iterator[Record]:
    """Yield every usable record of ``source`` in order; InputError on the first bad one
    unless ``skip_bad``. Texts are not checked for lone surrogates here (the tokenizer is)."""
    for chunk in read_chunks(source, lines=lines, column=column):
        parsed = parse_chunk(chunk, text_key=text_key, first_bad_only=not skip_bad)
        if parsed.bad and not skip_bad:
            first_bad = parsed.bad[0].line_number
            for text, number in zip(parsed.texts, parsed.line_numbers):
                if number < first_bad:
                    yield Record(path=source.path, line_number=number, text=text)
            raise InputError(parsed.bad[0].message)
        for text, number in zip(parsed.texts, parsed.line_numbers):
            yield Record(path=source.path, line_number=number, text=text)


__all__ = [
    "BAD_RECORD_REASONS",
    "EXTENSION_FORMATS",
    "INPUT_FORMATS",
    "RECORD_FORMATS",
    "BadRecord",
    "InputFile",
    "ParsedChunk",
    "ParsedObjects",
    "RawChunk",
    "Record",
    "RecordError",
    "detect_format",
    "discover_inputs",
    "iter_records",
    "open_binary",
    "parse_chunk",
    "parse_objects",
    "read_chunks",
]

"""The tokenize pipeline: input files -> parallel workers -> one token store.

The calling thread reads and decompresses the inputs into raw chunks of about ``chunk_bytes``
and hands them, in input order, to a pool of workers; each worker parses its chunk (UTF-8,
JSON, text key), encodes all its texts with one batch call of the tokenizer, appends the
end-of-document id and returns one token array plus the document lengths. Results are written
in submission order, so the store does not depend on the number or kind of workers or on
timing. At most ``2 * workers`` chunks are in flight, so memory stays bounded whatever the
input size. Any error or interrupt aborts the writer: no store appears under the prefix.

The workers are threads where the engine is gigatoken and processes otherwise
(``TokenizeConfig.threads``). gigatoken encodes faster than Python can read and parse for it,
so what counts is the Python around it: a worker process costs its start, a second load of the
tokenizer and a copy of every chunk and its ids between processes, while gigatoken releases the
GIL and spreads a batch over its own threads, which a thread in this process uses as well.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import itertools
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from tokenloom.errors import BuildError, ConfigError, InputError
from tokenloom.io import IndexedDatasetWriter, dtype_for_vocab
from tokenloom.tokenization.chat import (
    ChatTemplate,
    RenderedConversation,
    assistant_header_tokens,
    check_prefix_tokens,
    conversations_of,
    encode_conversations,
    load_chat_template,
    render_conversation,
)
from tokenloom.tokenization.engines import GUARD_CHARACTERS, check_engine, first_difference
from tokenloom.tokenization.inputs import (
    BAD_RECORD_REASONS,
    INPUT_FORMATS,
    RECORD_FORMATS,
    BadRecord,
    InputFile,
    RawChunk,
    RecordError,
    discover_inputs,
    line_start_at_or_after,
    parse_chunk,
    parse_objects,
    read_chunks,
    splittable,
)
from tokenloom.tokenization.record import TokenizerRecord
from tokenloom.tokenization.spans import encode_span_records
from tokenloom.tokenization.tokenizers import Tokenizer, load_tokenizer
from tokenloom.validate import is_integer

logger = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int, int], None]
"""``progress(documents, tokens, input_bytes)``: increments since the previous call."""

_MAX_LOGGED_BAD_RECORDS = 5

DEFAULT_THREADS = 4
"""Worker threads by default: one parses while others' batches encode on gigatoken's own pool;
past a few, the threads only wait for the GIL (BENCHMARKS.md, "Tokenize")."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizeConfig:
    """How to turn text files into a token store."""

    tokenizer: str = "bytes"
    """``"bytes"`` (built in: UTF-8 bytes 0-255, end of document 256) or the path of a
    HuggingFace ``tokenizer.json`` (or of its directory)."""

    input_format: str = "auto"
    """``"auto"`` (from each file's extension), ``"jsonl"``, ``"parquet"`` or ``"text"``; or JSONL
    records that give the store a loss mask: ``"chat"`` (``messages`` rendered through the chat
    template, only the assistant turns in the loss: :mod:`tokenloom.tokenization.chat`) or
    ``"spans"`` (``input_ids`` with ``loss_spans``: :mod:`tokenloom.tokenization.spans`)."""

    chat_template: str | None = None
    """``"chat"``: a Jinja chat template file; None takes the tokenizer's own (``chat_template``
    in ``tokenizer_config.json`` beside it, or ``chat_template.jinja``)."""

    assistant_prefix_tokens: int | str = 0
    """``"chat"``: the first tokens of each assistant turn kept outside the loss (its role header;
    Megatron-LM's ``PromptConfig.assistant_prefix_len``); 0 puts the whole turn in the loss;
    ``"auto"`` counts the tokens the template writes before an assistant message's content
    (:func:`~tokenloom.tokenization.chat.assistant_header_tokens`)."""

    text_key: str = "text"
    """JSONL field holding the text; ``"a.b"`` reaches into nested objects."""

    column: str = "text"
    """Parquet column holding the text."""

    lines: bool = False
    """Text files: one document per non-blank line instead of one per file."""

    append_eod: bool = True
    """Append the end-of-document id to every document."""

    eod_id: int | None = None
    """End-of-document id; None takes the tokenizer's own (see ``load_tokenizer``)."""

    skip_bad: bool = False
    """Skip (and count) unusable records instead of failing on the first one."""

    workers: int | None = None
    """Worker threads or processes (``threads``); 0 encodes in the calling thread. None: with
    threads, one per core up to :data:`DEFAULT_THREADS`; with processes, one per core."""

    threads: bool | None = None
    """Encode in ``workers`` threads of this process (True) or in worker processes (False); None
    takes threads where the engine is gigatoken and processes otherwise. gigatoken releases the
    GIL while it encodes and spreads each batch over its own thread pool, so threads need no
    process started, no tokenizer loaded again and no text or ids copied between processes;
    the byte tokenizer and ``tokenizers`` are driven from Python per batch and scale with
    processes. Reading, JSON parsing and writing take turns on the GIL, which is why a few
    threads are enough (more processes: divide the run over ranks, ``tokenloom.builder.tokenize``)."""

    chunk_bytes: int = 1 << 20
    """Text bytes per worker task; memory in flight is about ``2 * workers`` of them."""

    engine: str = "auto"
    """How a HuggingFace tokenizer.json encodes (:mod:`tokenloom.tokenization.engines`):
    ``"auto"`` (gigatoken where it covers the tokenizer, else ``tokenizers``), ``"gigatoken"`` or
    ``"hf"``. The ids, and so the store, are the same: a document holding a code point gigatoken
    reads differently goes to ``tokenizers`` (:mod:`tokenloom.tokenization.divergence`), and each
    process holds gigatoken to ``tokenizers`` on its first documents (a sample: see ``verify``)."""

    verify: bool = False
    """Encode every document with both engines and stop at the first difference, naming the
    file, line and character (about ``tokenizers``' cost on top of gigatoken's). Off by default:
    identity rests on the code point scan, and the guard samples the first documents."""

    def __post_init__(self) -> None:
        check_engine(self.engine)
        object.__setattr__(self, "assistant_prefix_tokens", check_prefix_tokens(self.assistant_prefix_tokens))
        if (self.chat_template is not None or self.assistant_prefix_tokens) and self.input_format != "chat":
            raise ConfigError(f"chat_template {self.chat_template!r} and assistant_prefix_tokens "
                              f"{self.assistant_prefix_tokens!r} apply to input_format='chat', not "
                              f"{self.input_format!r}")
        if self.input_format not in INPUT_FORMATS:
            raise ConfigError(f"input_format {self.input_format!r}, expected one of {INPUT_FORMATS}")
        if not self.text_key or not self.column:
            raise ConfigError(f"text_key {self.text_key!r} and column {self.column!r} must be non-empty")
        if not isinstance(self.verify, bool):
            raise ConfigError(f"verify {self.verify!r}, expected True or False")
        if self.threads is not None and not isinstance(self.threads, bool):
            raise ConfigError(f"threads {self.threads!r}, expected True, False or None (by engine)")
        if self.workers is not None and (not is_integer(self.workers) or self.workers < 0):
            raise ConfigError(f"workers {self.workers!r}, expected an int >= 0 or None (one per core)")
        if not is_integer(self.chunk_bytes) or self.chunk_bytes < 1:
            raise ConfigError(f"chunk_bytes {self.chunk_bytes!r}, expected a positive int (e.g. {1 << 20})")
        if self.eod_id is not None and (not is_integer(self.eod_id) or self.eod_id < 0):
            raise ConfigError(f"eod_id {self.eod_id!r}, expected a non-negative int or None")
        for name in ("workers", "chunk_bytes", "eod_id"):  # numpy integers become plain ints
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))

    def parallelism(self, tokenizer: Tokenizer) -> tuple[int, bool]:
        """``(workers, threads)`` resolved for ``tokenizer`` (see ``workers`` and ``threads``)."""
        threads = self.threads if self.threads is not None else getattr(tokenizer, "engine", None) == "gigatoken"
        cores = os.cpu_count() or 1
        if self.workers is not None:
            return self.workers, threads
        return (min(cores, DEFAULT_THREADS) if threads else cores), threads


@dataclasses.dataclass(frozen=True, kw_only=True)
class TokenizeSummary:
    """What a tokenize run wrote."""

    prefix: str
    """The store written: ``prefix.bin``, ``prefix.idx``, ``prefix.meta.json``."""

    tokenizer: TokenizerRecord
    num_files: int
    num_documents: int
    """Documents stored (one sequence each)."""

    num_tokens: int
    """Tokens stored, end-of-document ids included."""

    num_empty: int
    """Records whose text encoded to no token; not stored."""

    skipped: Mapping[str, int]
    """Bad records skipped, by reason (``BAD_RECORD_REASONS``); empty unless ``skip_bad``."""

    elapsed_s: float

    ranks: int = 1
    """Ranks the run was divided over (``tokenloom.builder.tokenize``)."""

    parts_kept: int = 0
    """Of a divided run: ranks whose part an earlier run had finished with the same inputs."""

    engine: str = "bytes"
    """What encoded: ``"bytes"``, ``"gigatoken"`` or ``"hf"`` (the ``tokenizers`` library); ``"none"``
    for pre-tokenized ``spans`` input."""

    engine_note: str | None = None
    """Why ``tokenizers`` encoded where ``engine="auto"`` could not take gigatoken."""

    workers: int = 0
    """Worker threads or processes the run was given (0: the calling thread; input of one task
    is encoded in the calling thread all the same)."""

    threads: bool = False
    """Whether the workers were threads of the calling process."""

    routed_documents: int = 0
    """Documents that hold a code point gigatoken reads differently, encoded by ``tokenizers``."""

    divergent_code_points: int | None = None
    """How many code points gigatoken reads differently from ``tokenizers`` for this tokenizer
    (None: gigatoken did not encode)."""

    verified: bool = False
    """Every document was encoded by both engines and compared (``TokenizeConfig.verify``); else
    the comparison covered each process's first ``guard_characters`` only."""

    guard_characters: int = GUARD_CHARACTERS
    """Characters of text each process encoded with both engines before trusting gigatoken alone
    (the guard samples; identity rests on the code point scan)."""

    loss_tokens: int | None = None
    """Of a store with a loss mask (chat and spans input): the tokens in the loss; else None."""

    assistant_prefix_tokens: int | None = None
    """Of chat input: the tokens of each assistant turn kept outside the loss (``"auto"`` resolved)."""

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    @property
    def documents_per_s(self) -> float:
        return self.num_documents / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


# -- worker side ----------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class _EncodeJob:
    """Everything a worker needs; sent once per worker at pool start."""

    tokenizer: Tokenizer
    text_key: str
    append_eod: bool
    eod_id: int | None
    dtype: str
    stop_at_bad: bool
    verify: bool = False
    """Compare every document, not the guard's sample."""
    records: str = "text"
    """``"text"``, or the records with a loss mask: ``"chat"``, ``"spans"``."""
    template: ChatTemplate | None = None
    assistant_prefix_tokens: int = 0
    guard: dict[int, int] = dataclasses.field(default_factory=dict)
    """Process id -> characters this run still holds gigatoken to ``tokenizers`` on (each worker
    process gets its own copy with the job, so every process of every run checks its first
    documents; the threads of one process share its budget)."""


@dataclasses.dataclass(kw_only=True)
class _EncodedBatch:
    tokens: np.ndarray  # (num_tokens,) store dtype, EOD ids included
    lengths: np.ndarray  # (num_documents,) int64
    num_empty: int
    skipped: dict[str, int]
    bad_examples: list[str]
    error: str | None = None
    routed: int = 0  # documents encoded by tokenizers for holding a divergent code point
    loss_mask: np.ndarray | None = None  # (num_tokens,) uint8 of chat and spans records, else None


_JOB: _EncodeJob | None = None
_GUARD_LOCK = threading.Lock()


def _init_worker(job: _EncodeJob) -> None:
    global _JOB
    # Parallelism comes from the processes; the tokenizer's own thread pool would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    # Ctrl-C is the main process's to handle: it aborts the writer and terminates the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _JOB = job


def _encode_in_worker(chunks: list[RawChunk]) -> _EncodedBatch:
    if _JOB is None:  # pragma: no cover - a programming error, not an input problem
        raise RuntimeError("tokenize worker used before _init_worker")
    return _encode_chunks(_JOB, chunks)


def _unencodable(texts: list[str], numbers: list[tuple[str, int]]) -> list[BadRecord]:
    """Texts that are not valid Unicode (lone surrogates from JSON ``\\ud800`` escapes)."""
    bad = []
    for text, (path, number) in zip(texts, numbers):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            bad.append(BadRecord(
                path=path, line_number=number, reason="invalid_unicode",
                message=f"{path}:{number}: text is not valid Unicode: lone surrogate "
                f"U+{ord(text[exc.start]):04X} at character {exc.start} (a JSON \\u escape?)",
            ))
    return bad


def _encode(tokenizer: Tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens, lengths, documents routed to ``tokenizers``)."""
    routed = getattr(tokenizer, "encode_batch_routed", None)
    if routed is not None:
        return routed(texts)
    return (*tokenizer.encode_batch(texts), 0)


def _encode_texts(job: _EncodeJob, texts: list[str], where: list[tuple[str, int]]):
    """(tokens, lengths, bad records, routed) for ``texts``; bad ones are left out of the result."""
    try:
        tokens, lengths, routed = _encode(job.tokenizer, texts)
        _guard(job, texts, where, (tokens, lengths))
        return tokens, lengths, [], routed
    except ConfigError:
        raise
    except Exception as exc:
        bad = _unencodable(texts, where)
        if not bad:
            raise BuildError(f"tokenizer {job.tokenizer!r} failed on a batch of {len(texts)} texts "
                             f"starting at {where[0][0]}:{where[0][1]}: {exc}") from exc
    rejected = {(b.path, b.line_number) for b in bad}
    keep = [i for i, loc in enumerate(where) if loc not in rejected]
    kept = [texts[i] for i in keep]
    tokens, lengths, routed = _encode(job.tokenizer, kept)
    _guard(job, kept, [where[i] for i in keep], (tokens, lengths))
    return tokens, lengths, bad, routed


def _guard(job: _EncodeJob, texts: list[str], where: list[tuple[str, int]], encoded) -> None:
    """Hold gigatoken to ``tokenizers`` on this run's first :data:`GUARD_CHARACTERS` of text in
    this process, or on every text with ``verify``: a ConfigError naming the first document
    (file:line), token and character where they differ."""
    tokenizer = job.tokenizer
    if getattr(tokenizer, "engine", None) != "gigatoken" or not texts:
        return
    if job.verify:
        count = len(texts)
    else:
        with _GUARD_LOCK:  # the process's worker threads share one budget
            left = job.guard.setdefault(os.getpid(), GUARD_CHARACTERS)
            if left <= 0:
                return
            count, size = 0, 0
            while count < len(texts) and size < left:  # the documents that make up the rest of the budget
                size += len(texts[count])
                count += 1
            job.guard[os.getpid()] = left - size
    lengths = encoded[1][:count]
    ours = (encoded[0][:int(lengths.sum())], lengths)
    found = first_difference(ours, tokenizer.encode_batch_reference(texts[:count]))
    if found is not None:
        document, position, got, expected = found
        path, line = where[document]
        start, end = tokenizer.characters_at(texts[document], position)
        span = texts[document][start:end]
        beyond = ", ".join(f"U+{ord(c):04X}" for c in span if ord(c) > 0x7F)
        at = f"characters {start}-{end} {span!r}" + (f" holding {beyond}" if beyond else "") if span else \
            f"character {start}, its end"
        raise ConfigError(
            f"{path}:{line}: gigatoken and the tokenizers library encode this document differently from its "
            f"token {position} on ({at}; gigatoken {got}, tokenizers {expected}) with {tokenizer.path}; "
            "nothing was written. Encode with the tokenizers library (engine='hf'), and report the document "
            "to gigatoken")


# TODO(tokenize): parsing the JSON lines and gathering the ids run in Python around gigatoken's
# batch encode, which keeps tokenize below gigatoken's own encode per CPU-second (BENCHMARKS.md,
# "Tokenize"); moving them under the released GIL is what is left.
def _encode_chunks(job: _EncodeJob, chunks: list[RawChunk]) -> _EncodedBatch:
    if job.records != "text":
        return _encode_masked(job, chunks)
    texts: list[str] = []
    where: list[tuple[str, int]] = []
    bad: list[BadRecord] = []
    error: BadRecord | None = None
    for chunk in chunks:
        parsed = parse_chunk(chunk, text_key=job.text_key, first_bad_only=job.stop_at_bad)
        texts.extend(parsed.texts)
        where.extend((chunk.path, number) for number in parsed.line_numbers)
        bad.extend(parsed.bad)
        if parsed.bad and job.stop_at_bad:
            error = parsed.bad[0]
            break
    if error is not None:
        # A bad text earlier in input order is the one to report.
        earlier = _unencodable(texts, where)
        return _EncodedBatch(
            tokens=np.zeros(0, job.dtype), lengths=np.zeros(0, np.int64), num_empty=0,
            skipped={}, bad_examples=[], error=(earlier or [error])[0].message,
        )
    tokens, lengths, unencodable, routed = _encode_texts(job, texts, where)
    if unencodable and job.stop_at_bad:
        return _EncodedBatch(
            tokens=np.zeros(0, job.dtype), lengths=np.zeros(0, np.int64), num_empty=0,
            skipped={}, bad_examples=[], error=unencodable[0].message,
        )
    bad.extend(unencodable)
    empty = lengths == 0
    num_empty = int(empty.sum())
    if num_empty:
        lengths = lengths[~empty]
    if tokens.size:
        vocab_size = job.tokenizer.vocab_size
        if int(tokens.max()) >= vocab_size or (tokens.dtype.kind == "i" and int(tokens.min()) < 0):
            raise BuildError(f"tokenizer {job.tokenizer!r} produced ids outside [0, {vocab_size})")
    tokens = tokens.astype(job.dtype, copy=False)  # narrow before the copy that inserts the EODs
    if job.append_eod and lengths.size:
        # insert the EOD id after each document: tokens (T,) -> (T + num_documents,)
        tokens = np.insert(tokens, np.cumsum(lengths), job.eod_id)
        lengths = lengths + 1
    skipped = collections.Counter(b.reason for b in bad)
    return _EncodedBatch(
        tokens=tokens,
        lengths=lengths,
        num_empty=num_empty,
        skipped=dict(skipped),
        bad_examples=[b.message for b in bad[:_MAX_LOGGED_BAD_RECORDS]],
        routed=routed,
    )


def _encode_masked(job: _EncodeJob, chunks: list[RawChunk]) -> _EncodedBatch:
    """Chat or spans records -> tokens, lengths and loss mask (the appended EOD outside the loss)."""
    objects: list = []
    where: list[tuple[str, int]] = []
    parse_bad: list[BadRecord] = []
    for chunk in chunks:
        parsed = parse_objects(chunk, first_bad_only=job.stop_at_bad)
        objects.extend(parsed.objects)
        where.extend((chunk.path, number) for number in parsed.line_numbers)
        parse_bad.extend(parsed.bad)
        if parsed.bad and job.stop_at_bad:
            break  # a bad record among the lines before it is the one to report
    if job.records == "chat":
        tokens, lengths, mask, record_bad, routed = _encode_chat(job, objects, where)
    else:
        found = encode_span_records(objects, [f"{path}:{line}" for path, line in where], job.tokenizer.vocab_size,
                                    first_bad_only=job.stop_at_bad)
        tokens, lengths, mask, routed = found.tokens, found.lengths, found.loss_mask, 0
        record_bad = [_bad_record(where[index], error) for index, error in found.bad]
    if job.stop_at_bad and (record_bad or parse_bad):
        return _EncodedBatch(tokens=np.zeros(0, job.dtype), lengths=np.zeros(0, np.int64), num_empty=0, skipped={},
                             bad_examples=[], error=(record_bad or parse_bad)[0].message)
    bad = sorted(record_bad + parse_bad, key=lambda b: (b.path, b.line_number))
    empty = lengths == 0
    num_empty = int(empty.sum())
    lengths = lengths[~empty]
    if tokens.size and int(tokens.max()) >= job.tokenizer.vocab_size:
        raise BuildError(f"tokenizer {job.tokenizer!r} produced ids outside [0, {job.tokenizer.vocab_size})")
    tokens = tokens.astype(job.dtype, copy=False)
    mask = mask.astype(np.uint8, copy=False)
    if job.append_eod and lengths.size:
        # tokens, mask (T,) -> (T + num_documents,): the EOD after each document, outside the loss
        ends = np.cumsum(lengths)
        tokens, mask = np.insert(tokens, ends, job.eod_id), np.insert(mask, ends, 0)
        lengths = lengths + 1
    return _EncodedBatch(tokens=tokens, lengths=lengths, num_empty=num_empty,
                         skipped=dict(collections.Counter(b.reason for b in bad)),
                         bad_examples=[b.message for b in bad[:_MAX_LOGGED_BAD_RECORDS]], routed=routed,
                         loss_mask=mask)


def _bad_record(where: tuple[str, int], error: RecordError) -> BadRecord:
    return BadRecord(path=where[0], line_number=where[1], reason=error.reason, message=error.message)


def _encode_chat(job: _EncodeJob, objects: list, where: list[tuple[str, int]]):
    """(tokens, lengths, mask, bad records, routed) of the conversations of ``objects``: a record
    is kept whole or left out whole."""
    rendered: list[RenderedConversation] = []
    owner: list[int] = []  # (conversations,) the record each conversation came from
    bad: list[BadRecord] = []
    for index, (record, (path, line)) in enumerate(zip(objects, where)):
        try:
            conversations = [render_conversation(job.template, conversation, f"{path}:{line}")
                             for conversation in conversations_of(record, f"{path}:{line}")]
        except RecordError as exc:
            bad.append(_bad_record((path, line), exc))
            if job.stop_at_bad:
                break
            continue
        rendered.extend(conversations)
        owner.extend([index] * len(conversations))
    unencodable = {i for i, r in enumerate(rendered) if not _encodes(r.text)}
    if unencodable:  # lone surrogates from JSON \u escapes: the tokenizer would refuse the batch
        for i in sorted({owner[i] for i in unencodable}):
            bad.append(BadRecord(path=where[i][0], line_number=where[i][1], reason="invalid_unicode",
                                 message=f"{where[i][0]}:{where[i][1]}: a message is not valid Unicode (a lone "
                                 "surrogate from a JSON \\u escape?)"))
        dropped = {owner[i] for i in unencodable}
        keep = [i for i in range(len(rendered)) if owner[i] not in dropped]
        rendered, owner = [rendered[i] for i in keep], [owner[i] for i in keep]

    def encode(texts: list[str]):
        found = _encode(job.tokenizer, texts)
        places = [where[index] for index in owner]  # file and line of each text, for the guard's message
        places += [place for place, r in zip(places, rendered) for _ in r.turns]
        _guard(job, texts, places, found[:2])
        return found

    encoded = encode_conversations(encode, rendered, groups=np.asarray(owner, dtype=np.int64),
                                   assistant_prefix_tokens=job.assistant_prefix_tokens)
    seen = set()
    for index, error in encoded.bad:
        if owner[index] not in seen:
            seen.add(owner[index])
            bad.append(_bad_record(where[owner[index]], error))
    bad.sort(key=lambda b: (b.path, b.line_number))
    return encoded.tokens, encoded.lengths, encoded.loss_mask, bad, encoded.routed


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# -- main side ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class InputPiece:
    """An input file, or the lines starting in a byte range of one (a part of a divided run)."""

    source: InputFile
    byte_range: tuple[int, int] | None = None
    """``[begin, end)`` at line starts, or None for the whole file."""
    first_line: int = 1
    """Line number of the range's first line (for messages naming a bad record)."""

    @property
    def num_bytes(self) -> int:
        return self.source.size_bytes if self.byte_range is None else self.byte_range[1] - self.byte_range[0]


def plan_pieces(files: Sequence[InputFile], config: TokenizeConfig, parts: int) -> list[list[InputPiece]]:
    """Divide ``files`` into ``parts`` runs of pieces of about equal bytes, in input order: the
    runs concatenated are the input in order. Files that can be read by byte range
    (:func:`~tokenloom.tokenization.inputs.splittable`) are cut at line starts where a run ends;
    others (compressed, Parquet, document-per-file text) go whole to the run their first byte
    falls in. Deterministic: every rank computes the same plan (``first_line`` left at 1: the
    caller counts lines)."""
    total = sum(f.size_bytes for f in files)
    bounds = [round(k * total / parts) for k in range(1, parts)]  # global bytes where runs end
    runs: list[list[InputPiece]] = [[] for _ in range(parts)]
    offset = 0
    for source in files:
        size = source.size_bytes
        if splittable(source, lines=config.lines) and size:
            cuts = sorted({line_start_at_or_after(source.path, b - offset, size)
                           for b in bounds if offset < b < offset + size})
            edges = [0, *cuts, size]
            for begin, end in itertools.pairwise(edges):
                if end > begin:
                    runs[bisect.bisect_right(bounds, offset + begin)].append(InputPiece(source, (begin, end)))
        else:
            runs[bisect.bisect_right(bounds, offset)].append(InputPiece(source))
        offset += size
    return runs


@dataclasses.dataclass(frozen=True)
class _Task:
    chunks: list[RawChunk]
    input_bytes: int  # on-disk bytes consumed since the previous task (progress only)


def _tasks(pieces: Sequence[InputPiece], config: TokenizeConfig) -> Iterator[_Task]:
    """Group the pieces' raw chunks, in input order, into tasks of at most about ``chunk_bytes``
    (small chunks, e.g. one per short text file, share a task; a big one is a task alone)."""
    batch: list[RawChunk] = []
    batch_bytes = 0
    consumed = 0  # bytes on disk of all earlier pieces
    position = reported = 0  # bytes on disk read up to the batch's last chunk / reported so far
    for piece in pieces:
        start = 0 if piece.byte_range is None else piece.byte_range[0]
        for chunk in read_chunks(piece.source, lines=config.lines, column=config.column,
                                 chunk_bytes=config.chunk_bytes, byte_range=piece.byte_range,
                                 first_line=piece.first_line):
            if batch and batch_bytes + chunk.num_bytes > config.chunk_bytes:
                yield _Task(batch, position - reported)
                reported = position
                batch, batch_bytes = [], 0
            batch.append(chunk)
            batch_bytes += chunk.num_bytes
            position = consumed + chunk.input_bytes_done - start
        consumed += piece.num_bytes
    if batch or consumed > reported:
        yield _Task(batch, consumed - reported)


def _encode_ordered(job: _EncodeJob, tasks: Iterable[_Task], workers: int,
                    threads: bool = False) -> Iterator[tuple[_EncodedBatch, _Task]]:
    """Encode tasks in a pool of ``workers`` processes, or threads (0: inline); results in task
    order.

    Input that fits in one task is encoded inline too: starting processes would cost more
    than it saves. Either way the results are the same.
    """
    tasks = iter(tasks)
    head = list(itertools.islice(tasks, 2))
    if workers == 0 or len(head) < 2:
        for task in itertools.chain(head, tasks):
            yield _encode_chunks(job, task.chunks), task
        return
    tasks = itertools.chain(head, tasks)
    if threads:
        executor: Executor = ThreadPoolExecutor(workers, thread_name_prefix="tokenloom-encode")
        encode = functools.partial(_encode_chunks, job)
    else:
        # spawn: no inherited threads or locks (tqdm, the tokenizer's thread pool) in the workers.
        # A worker that dies makes the executor raise BrokenProcessPool instead of hanging.
        executor = ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=_init_worker, initargs=(job,)
        )
        encode = _encode_in_worker
    try:
        pending: collections.deque = collections.deque()
        max_in_flight = 2 * workers
        for task in tasks:
            pending.append((executor.submit(encode, task.chunks), task))
            if len(pending) >= max_in_flight:
                future, done = pending.popleft()
                yield future.result(), done
        while pending:
            future, done = pending.popleft()
            yield future.result(), done
    except BrokenProcessPool as exc:
        raise BuildError(
            f"a tokenize worker process died ({exc}); if this runs from an interactive session or "
            "stdin, run it from a script or with workers=0"
        ) from exc
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


def tokenize_to_store(
    inputs: Sequence[str] | str,
    output_prefix: str,
    config: TokenizeConfig = TokenizeConfig(),
    *,
    tokenizer: Tokenizer | None = None,
    progress: ProgressCallback | None = None,
) -> TokenizeSummary:
    """Tokenize every document of ``inputs`` into the token store ``output_prefix``.

    Args:
        inputs: files, directories (read recursively) and glob patterns.
        output_prefix: the store to write (``.bin``, ``.idx`` and ``.meta.json``).
        config: reading, tokenizing and parallelism options.
        tokenizer: an already loaded tokenizer; None loads ``config.tokenizer``.
        progress: called after each written chunk with (documents, tokens, input bytes).

    The output is byte-identical for any ``config.workers``. Raises InputError naming file
    and line for a bad record (unless ``config.skip_bad``); on any error or interrupt the
    store is not created.
    """
    files = discover_inputs(inputs, input_format=config.input_format)
    return tokenize_pieces(files, [InputPiece(f) for f in files], output_prefix, config, tokenizer=tokenizer,
                           progress=progress)


def tokenize_pieces(files: Sequence[InputFile], pieces: Sequence[InputPiece], output_prefix: str,
                    config: TokenizeConfig = TokenizeConfig(), *, tokenizer: Tokenizer | None = None,
                    progress: ProgressCallback | None = None) -> TokenizeSummary:
    """:func:`tokenize_to_store` over ``pieces`` of the input ``files`` (what one rank of a
    divided run tokenizes); the store's metadata names ``files``."""
    started = time.perf_counter()
    if tokenizer is None:
        tokenizer = load_tokenizer(config.tokenizer, eod_id=config.eod_id, require_eod=config.append_eod,
                                   engine=config.engine)
    if config.append_eod and tokenizer.eod_id is None:
        raise ConfigError(f"tokenizer {tokenizer!r} has no end-of-document id; give one or do not append it")
    route = getattr(tokenizer, "route_divergent", None)
    pretokenized = config.input_format == "spans"  # ids given: nothing is encoded, no scan is needed
    if route is not None and not pretokenized:
        route()  # before the workers start: they share (or are sent) its result
    record = tokenizer.record(append_eod=config.append_eod)
    dtype = np.dtype(dtype_for_vocab(record.vocab_size))
    template, prefix_tokens = None, None
    if config.input_format == "chat":
        template = load_chat_template(getattr(tokenizer, "path", config.tokenizer), config.chat_template)
        prefix_tokens = config.assistant_prefix_tokens
        if prefix_tokens == "auto":
            prefix_tokens = assistant_header_tokens(template, functools.partial(_encode, tokenizer))
    job = _EncodeJob(
        records=config.input_format if config.input_format in RECORD_FORMATS else "text",
        template=template,
        assistant_prefix_tokens=prefix_tokens or 0,
        tokenizer=tokenizer,
        text_key=config.text_key,
        append_eod=config.append_eod,
        eod_id=record.eod_id,
        dtype=dtype.str,
        stop_at_bad=not config.skip_bad,
        verify=config.verify,
    )
    workers, threads = config.parallelism(tokenizer)
    logger.info("tokenizing %d input file(s) with %r and %d worker %s into %s",
                len(files), tokenizer, workers, "thread(s)" if threads else "process(es)", output_prefix)
    num_documents = num_tokens = num_empty = logged_bad = routed = 0
    loss_tokens = 0 if job.records != "text" else None
    skipped: collections.Counter = collections.Counter()
    writer = IndexedDatasetWriter(output_prefix, dtype=dtype)
    try:
        for batch, task in _encode_ordered(job, _tasks(pieces, config), workers, threads):
            if batch.error is not None:
                raise InputError(batch.error)
            if batch.loss_mask is not None:
                writer.add_documents(batch.tokens, batch.lengths, loss_mask=batch.loss_mask)
                loss_tokens += int(np.count_nonzero(batch.loss_mask))
            else:
                writer.add_documents(batch.tokens, batch.lengths)
            num_documents += int(batch.lengths.size)
            num_tokens += int(batch.tokens.size)
            num_empty += batch.num_empty
            routed += batch.routed
            skipped.update(batch.skipped)
            for message in batch.bad_examples[: max(0, _MAX_LOGGED_BAD_RECORDS - logged_bad)]:
                logger.warning("skipped bad record: %s", message)
                logged_bad += 1
            if progress is not None:
                progress(int(batch.lengths.size), int(batch.tokens.size), task.input_bytes)
        metadata = store_metadata(record, files, config, documents=num_documents, tokens=num_tokens,
                                  empty=num_empty, skipped=skipped, assistant_prefix_tokens=prefix_tokens)
        writer.finalize(metadata)
    except BaseException:
        writer.abort()
        raise
    summary = TokenizeSummary(
        prefix=writer.prefix,
        tokenizer=record,
        num_files=len(files),
        num_documents=num_documents,
        num_tokens=num_tokens,
        num_empty=num_empty,
        skipped=dict(metadata["source"]["skipped"]),
        elapsed_s=time.perf_counter() - started,
        workers=workers,
        threads=threads,
        **engine_report(tokenizer, config),
        routed_documents=routed,
        loss_tokens=loss_tokens,
        assistant_prefix_tokens=prefix_tokens,
    )
    logger.info("wrote %s: %d documents, %d tokens, skipped %s", writer.prefix, num_documents, num_tokens,
                dict(summary.skipped))
    return summary


def engine_report(tokenizer: Tokenizer, config: TokenizeConfig) -> dict:
    """The summary's fields on what encoded and how identity with ``tokenizers`` was held
    (besides the count of routed documents): one function for a run in one process and a run
    divided over ranks, so that both summaries say the same. Pre-tokenized ``spans`` input
    encodes nothing: engine ``"none"``, no code point scan."""
    if config.input_format == "spans":
        return {"engine": "none", "engine_note": "pre-tokenized input", "divergent_code_points": None,
                "verified": False}
    divergence = getattr(tokenizer, "divergence", None)
    gigatoken = getattr(tokenizer, "engine", None) == "gigatoken"
    return {"engine": getattr(tokenizer, "engine", "bytes"), "engine_note": getattr(tokenizer, "engine_note", None),
            "divergent_code_points": len(divergence) if gigatoken and divergence is not None else None,
            "verified": bool(config.verify and gigatoken)}


def store_metadata(record: TokenizerRecord, files: Sequence[InputFile], config: TokenizeConfig, *,
                   documents: int, tokens: int, empty: int, skipped: Mapping[str, int],
                   assistant_prefix_tokens: int | None = None) -> dict:
    """The ``.meta.json`` of a tokenized store: the tokenizer record and what was read (of chat
    input, the template file and ``assistant_prefix_tokens``, resolved where given)."""
    return {
        "tokenizer": record.to_dict(),
        "source": {
            "inputs": [source.path for source in files],
            "input_format": config.input_format,
            "text_key": config.text_key,
            "column": config.column,
            "lines": config.lines,
            **({"chat_template": config.chat_template,
                "assistant_prefix_tokens": config.assistant_prefix_tokens if assistant_prefix_tokens is None
                else assistant_prefix_tokens} if config.input_format == "chat" else {}),
            "documents": documents,
            "tokens": tokens,
            "empty_documents": empty,
            "skipped": {reason: skipped[reason] for reason in BAD_RECORD_REASONS if skipped.get(reason)},
        },
    }


__all__ = ["InputPiece", "ProgressCallback", "TokenizeConfig", "TokenizeSummary", "engine_report", "plan_pieces",
           "store_metadata",
           "tokenize_pieces", "tokenize_to_store"]

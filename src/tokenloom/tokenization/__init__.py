"""tokenize: text -> tokens -> token store.

Files, directories and globs of JSONL, Parquet and text (gzip/zstd compressed or not) are
read by ``sources``, encoded by a tokenizer from ``tokenizers`` (the built-in byte
tokenizer or a HuggingFace ``tokenizer.json``) in parallel worker processes, and written
to one Megatron token store whose ``.meta.json`` sidecar records the tokenizer
(``TokenizerRecord``) so later stages can check it.
"""

from tokenloom.tokenization.inputs import (
    BAD_RECORD_REASONS,
    InputFile,
    Record,
    discover_inputs,
    iter_records,
)
from tokenloom.tokenization.pipeline import ProgressCallback, TokenizeConfig, TokenizeSummary, tokenize_to_store
from tokenloom.tokenization.record import TokenizerRecord, load_tokenizer_record
from tokenloom.tokenization.tokenizers import ByteTokenizer, HuggingFaceTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "BAD_RECORD_REASONS",
    "ByteTokenizer",
    "HuggingFaceTokenizer",
    "InputFile",
    "ProgressCallback",
    "Record",
    "TokenizeConfig",
    "TokenizeSummary",
    "Tokenizer",
    "TokenizerRecord",
    "discover_inputs",
    "iter_records",
    "load_tokenizer",
    "load_tokenizer_record",
    "tokenize_to_store",
]

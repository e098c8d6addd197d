"""tokenize: text -> tokens -> token store.

Files, directories and globs of JSONL, Parquet and text (gzip/zstd compressed or not) are found
and read by ``inputs``, encoded by a tokenizer from ``tokenizers`` (the built-in byte tokenizer or
a HuggingFace ``tokenizer.json``, through the engine ``engines`` picks) in parallel workers, and
written to one Megatron token store whose ``.meta.json`` sidecar records the tokenizer
(:class:`TokenizerRecord`) so later stages can check it. Under torchrun,
:func:`tokenloom.builder.tokenize_on_ranks` divides the same work over the ranks.
"""

from tokenloom import _moved
from tokenloom.tokenization.inputs import InputFile, discover_inputs
from tokenloom.tokenization.pipeline import TokenizeConfig, TokenizeSummary, tokenize_to_store
from tokenloom.tokenization.record import TokenizerRecord, load_tokenizer_record
from tokenloom.tokenization.tokenizers import ByteTokenizer, HuggingFaceTokenizer, Tokenizer, load_tokenizer

#: Names this package exported before its face was curated, and the module each is imported from
#: now; importing one from here still works, with a DeprecationWarning (:mod:`tokenloom._moved`).
_MOVED = {
    "BAD_RECORD_REASONS": "tokenloom.tokenization.inputs",
    "Record": "tokenloom.tokenization.inputs",
    "iter_records": "tokenloom.tokenization.inputs",
    "ProgressCallback": "tokenloom.tokenization.pipeline",
}


def __getattr__(name: str) -> object:
    return _moved.moved_attribute(__name__, name, _MOVED)


__all__ = [
    "ByteTokenizer",
    "HuggingFaceTokenizer",
    "InputFile",
    "TokenizeConfig",
    "TokenizeSummary",
    "Tokenizer",
    "TokenizerRecord",
    "discover_inputs",
    "load_tokenizer",
    "load_tokenizer_record",
    "tokenize_to_store",
]

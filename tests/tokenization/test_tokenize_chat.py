"""Chat JSONL -> tokens and loss mask, held to Megatron-LM's own ``SFTDataset`` and ``SFTTokenizer``
(the megatron-core wheel's code, on a tokenizer trained here, through ``transformers``' chat
template rendering), and pre-tokenized spans held to a slow reference."""

from __future__ import annotations

import importlib.util
import json
import os
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chat_fixtures import CHATML, make_conversations, train_chat_tokenizer, write_jsonl
from tokenloom.io import IndexedDataset
from tokenloom.tokenization import TokenizeConfig, tokenize_to_store
from tokenloom.tokenization.tokenizers import HuggingFaceTokenizer


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> str:
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    return train_chat_tokenizer(tmp_path_factory.mktemp("chat_tokenizer"))


@pytest.fixture(scope="module")
def chat_records() -> list[dict]:
    return make_conversations(60, seed=3)


def _megatron_sft_module():
    """``megatron/training/datasets/sft_dataset.py`` from the megatron-core wheel, loaded from its
    file (its package's ``__init__`` needs Python 3.12; the module needs megatron-core only)."""
    core = pytest.importorskip("megatron.core")
    path = os.path.join(os.path.dirname(os.path.dirname(core.__file__)), "training", "datasets", "sft_dataset.py")
    if not os.path.isfile(path):
        pytest.skip(f"{path}: not in this megatron-core wheel")
    spec = importlib.util.spec_from_file_location("megatron_sft_dataset", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _megatron_sft(directory: str, prompt_format: str, *, template: str | None = None, prefix: int = 0):
    """Megatron's ``SFTDataset`` over records, its tokenizer Megatron's ``SFTTokenizer`` built by its
    own constructor on ``directory`` (``AutoTokenizer``); ``template`` replaces the prompt format's
    template (a ``PromptConfig`` of our own, masked as the Nemotron formats are)."""
    pytest.importorskip("transformers")
    from megatron.core.tokenizers.text.libraries.sft_tokenizer import PromptConfig, SFTTokenizer

    sft = SFTTokenizer(directory, prompt_format)
    if template is not None:
        sft._prompt_config = PromptConfig(assistant_prefix_len=prefix, custom_chat_template=template,
                                          pad_token_id=sft._tokenizer.convert_tokens_to_ids("<|pad|>"),
                                          has_bos=False, has_system_role=True)
    module = _megatron_sft_module()

    def dataset(records, seq_length):
        found = module.SFTDataset.__new__(module.SFTDataset)
        found.config = types.SimpleNamespace(
            tokenizer=types.SimpleNamespace(tokenize_conversation=sft.tokenize_conversation, eod=sft.eod,
                                            pad=sft.pad_id),
            sequence_length=seq_length, reset_position_ids=False, context_parallel_size=1,
            create_attention_mask=False, reset_attention_mask=False)
        found.dataset = [record["messages"] for record in records]
        found.indices = np.arange(len(records))
        return found

    return sft, dataset


def _conversations_per_record(record) -> int:
    return max(1, sum(message["role"] == "system" for message in record["messages"]))


def _template_file(tmp_path, source: str) -> str:
    path = tmp_path / "template.jinja"
    path.write_text(source)
    return str(path)


def _formats(chat_tokenizer):
    """(name, megatron prompt format, template file source or None, assistant_prefix_tokens)."""
    from megatron.core.tokenizers.text.libraries import sft_tokenizer

    header = len(HuggingFaceTokenizer(chat_tokenizer, engine="hf").encode_text("<|im_start|>assistant\n"))
    return [
        ("chatml", "nemotron-h-aligned", CHATML, header),
        ("nemotron-h-aligned", "nemotron-h-aligned", sft_tokenizer.nemotron_h_aligned_custom_template, 0),
        ("nemotron-nano-v2", "nemotron-nano-v2", sft_tokenizer.nemotron_nano_v2_custom_template, 3),
    ]


@pytest.mark.parametrize("which", [0, 1, 2])
def test_chat_tokens_and_mask_are_megatron_sft_datasets(chat_tokenizer, chat_records, tmp_path, which):
    pytest.importorskip("megatron.core")
    pytest.importorskip("transformers")
    name, prompt_format, template, prefix = _formats(chat_tokenizer)[which]
    _, megatron_dataset = _megatron_sft(chat_tokenizer, prompt_format,
                                          template=template if name == "chatml" else None, prefix=prefix)
    inputs = write_jsonl(tmp_path / "chat.jsonl", chat_records)
    # ChatML's header is counted from the template ("auto"); Megatron is given the count by hand
    config = TokenizeConfig(tokenizer=chat_tokenizer, input_format="chat", append_eod=False, workers=0,
                            chat_template=_template_file(tmp_path, template),
                            assistant_prefix_tokens="auto" if name == "chatml" else prefix)
    summary = tokenize_to_store([inputs], str(tmp_path / "chat"), config)
    assert summary.assistant_prefix_tokens == prefix
    store = IndexedDataset(str(tmp_path / "chat"))
    assert store.has_loss_mask and len(store) == summary.num_documents == sum(map(_conversations_per_record,
                                                                                  chat_records))
    seq_length = 1 << 14
    samples = megatron_dataset(chat_records, seq_length)
    document = 0
    for line, record in enumerate(chat_records):
        count = _conversations_per_record(record)
        lengths = [len(store[d]) for d in range(document, document + count)]
        tokens = np.concatenate([store[d] for d in range(document, document + count)])
        mask = np.concatenate([store.get_loss_mask(d) for d in range(document, document + count)])
        document += count
        n = tokens.size
        assert n < seq_length
        sample = samples[line]
        # Megatron: input tokens[i], labels[i] = tokens[i + 1], loss_mask[i] = whether labels[i] is a
        # target; the store's mask is per token, so Megatron's loss_mask is the store's shifted by one.
        np.testing.assert_array_equal(sample["tokens"].numpy()[:n], tokens, err_msg=f"{name}: line {line + 1}")
        np.testing.assert_array_equal(sample["loss_mask"].numpy()[:n - 1], mask[1:], err_msg=f"{name}: line {line + 1}")
        np.testing.assert_array_equal(sample["cu_seqlens"].numpy()[1:count], np.cumsum(lengths)[:-1])
        assert mask[0] == 0  # a conversation opens with a prompt
    assert document == len(store)
    # the mask is not trivially all or nothing: assistant turns in, prompts out
    every = np.concatenate([store.get_loss_mask(d) for d in range(len(store))])
    assert 0.2 < every.mean() < 0.95


def test_chat_with_eod_is_the_same_plus_an_eod_outside_the_loss(chat_tokenizer, chat_records, tmp_path):
    inputs = write_jsonl(tmp_path / "chat.jsonl", chat_records[:20])
    plain = TokenizeConfig(tokenizer=chat_tokenizer, input_format="chat", append_eod=False, workers=0)
    tokenize_to_store([inputs], str(tmp_path / "plain"), plain)
    # two worker processes, one record per task: the store is the same as the calling thread's
    parallel = TokenizeConfig(tokenizer=chat_tokenizer, input_format="chat", workers=2, threads=False,
                              chunk_bytes=2048)
    tokenize_to_store([inputs], str(tmp_path / "eod"), parallel)
    serial = TokenizeConfig(tokenizer=chat_tokenizer, input_format="chat", workers=0)
    tokenize_to_store([inputs], str(tmp_path / "serial"), serial)
    for suffix in (".bin", ".idx", ".mask"):
        with open(tmp_path / f"eod{suffix}", "rb") as a, open(tmp_path / f"serial{suffix}", "rb") as b:
            assert a.read() == b.read(), suffix
    without, with_eod = IndexedDataset(str(tmp_path / "plain")), IndexedDataset(str(tmp_path / "eod"))
    eod = HuggingFaceTokenizer(chat_tokenizer).eod_id
    assert len(without) == len(with_eod)
    for d in range(len(without)):
        np.testing.assert_array_equal(with_eod[d], np.append(without[d], eod))
        np.testing.assert_array_equal(with_eod.get_loss_mask(d), np.append(without.get_loss_mask(d), 0))


# -- bad input ------------------------------------------------------------------------------------
GOOD_CHAT = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}

# (record on line 2, words the message must contain)
BAD_CHATS = [
    ({"messages": [{"role": "user", "content": "Hi"}]}, "has no assistant turn"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "robot", "content": "Beep"}]},
     "message 1 has role 'robot', expected one of ['system', 'user', 'assistant', 'tool']"),
    ({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]}, "message 0 (user) has no 'content'"),
    ({"messages": [{"role": "user", "content": ["a"]}, {"role": "assistant", "content": "x"}]},
     "has content an array, expected a string"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "x"}]},
     "assistant turn after a system message"),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]},
     "empty assistant turn"),
    ({"conversation": []}, "no key 'messages'"),
    ({"messages": []}, "'messages' is an empty array"),
]


@pytest.mark.parametrize(("record", "words"), BAD_CHATS)
def test_bad_conversation_names_file_and_line_and_writes_nothing(chat_tokenizer, tmp_path, record, words):
    from tokenloom.errors import InputError

    inputs = write_jsonl(tmp_path / "bad.jsonl", [GOOD_CHAT, record, GOOD_CHAT])
    config = TokenizeConfig(tokenizer=chat_tokenizer, input_format="chat", workers=0)
    with pytest.raises(InputError) as caught:
        tokenize_to_store([inputs], str(tmp_path / "out"), config)
    assert f"{inputs}:2: " in str(caught.value) and words in str(caught.value), str(caught.value)
    assert not [name for name in os.listdir(tmp_path) if name.startswith("out")]
    skipping = TokenizeConfig(tokenizer=chat_tokenizer, input_format="chat", workers=0, skip_bad=True)
    summary = tokenize_to_store([inputs], str(tmp_path / "out"), skipping)
    assert summary.num_documents == 2 and summary.num_skipped == 1


def test_template_that_renders_turns_differently_is_refused(chat_tokenizer, tmp_path):
    from tokenloom.errors import InputError

    # Qwen2.5's shape: a default system prompt when the conversation has none, so a message
    # rendered alone is not the conversation's piece of text
    template = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}"
                "{% endif %}" + CHATML)
    inputs = write_jsonl(tmp_path / "chat.jsonl", [GOOD_CHAT])
    config = TokenizeConfig(tokenizer=chat_tokenizer, input_format="chat", workers=0,
                            chat_template=_template_file(tmp_path, template))
    with pytest.raises(InputError, match=r"chat\.jsonl:1: the chat template .* renders the messages one by one "
                       "differently from the whole conversation"):
        tokenize_to_store([inputs], str(tmp_path / "out"), config)
    assert not os.path.exists(tmp_path / "out.bin")


def test_tokenizer_without_a_template_is_refused(chat_tokenizer, tmp_path):
    from tokenloom.errors import ConfigError

    bare = tmp_path / "bare"
    bare.mkdir()
    with open(os.path.join(chat_tokenizer, "tokenizer.json"), "rb") as f:
        (bare / "tokenizer.json").write_bytes(f.read())
    inputs = write_jsonl(tmp_path / "chat.jsonl", [GOOD_CHAT])
    config = TokenizeConfig(tokenizer=str(bare), input_format="chat", workers=0)
    with pytest.raises(ConfigError, match=r"has no chat template: no chat_template in .*tokenizer_config\.json and no "
                       r".*chat_template\.jinja; give a Jinja template file"):
        tokenize_to_store([inputs], str(tmp_path / "out"), config)
    broken = _template_file(tmp_path, "{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ConfigError, match=r"template\.jinja: not a valid Jinja chat template"):
        tokenize_to_store([inputs], str(tmp_path / "out"), TokenizeConfig(
            tokenizer=str(bare), input_format="chat", workers=0, chat_template=broken))
    assert not [name for name in os.listdir(tmp_path) if name.startswith("out")]


# -- spans ----------------------------------------------------------------------------------------
def _reference_mask(num_tokens: int, spans) -> list[int]:
    return [int(any(begin <= t < end for begin, end in spans)) for t in range(num_tokens)]


@st.composite
def span_records(draw):
    records = []
    for _ in range(draw(st.integers(1, 6))):
        ids = draw(st.lists(st.integers(0, 256), min_size=0, max_size=40))
        cuts = sorted(draw(st.sets(st.integers(0, len(ids)), max_size=6)))
        spans = [[a, b] for a, b in zip(cuts[::2], cuts[1::2]) if a < b]
        records.append({"input_ids": ids, "loss_spans": spans})
    return records


@settings(max_examples=40, deadline=None)
@given(records=span_records(), append_eod=st.booleans())
def test_spans_give_the_reference_mask(tmp_path_factory, records, append_eod):
    directory = tmp_path_factory.mktemp("spans")
    inputs = write_jsonl(directory / "spans.jsonl", records)
    tokenize_to_store([inputs], str(directory / "out"), TokenizeConfig(input_format="spans", append_eod=append_eod,
                                                                       workers=0))
    store = IndexedDataset(str(directory / "out"))
    kept = [r for r in records if r["input_ids"]]  # an empty record is an empty document, left out
    assert len(store) == len(kept)
    for d, record in enumerate(kept):
        tail = [256] if append_eod else []
        assert store[d].tolist() == record["input_ids"] + tail
        assert store.get_loss_mask(d).tolist() == _reference_mask(len(record["input_ids"]),
                                                                  record["loss_spans"]) + [0] * len(tail)


BAD_SPANS = [
    ({"input_ids": [1, 2, 3], "loss_spans": [[1, 4]]}, "loss_spans[0] = [1, 4] is not a non-empty range within the "
     "record's 3 input_ids"),
    ({"input_ids": [1, 2, 3], "loss_spans": [[0, 2], [1, 3]]}, "loss_spans[1] = [1, 3] starts before the previous "
     "span ends (2)"),
    ({"input_ids": [1, 2, 3], "loss_spans": [[2, 2]]}, "is not a non-empty range"),
    ({"input_ids": [1, 900, 3], "loss_spans": []}, "input_ids[1] is 900, outside the tokenizer's vocabulary [0, 257)"),
    ({"input_ids": [1, "2"], "loss_spans": []}, "expected an array of integer token ids"),
    ({"input_ids": [1, 2]}, "no key 'loss_spans'"),
    ({"input_ids": [1, 2], "loss_spans": [[0]]}, "loss_spans[0] is [0], expected [begin, end]"),
]


@pytest.mark.parametrize(("record", "words"), BAD_SPANS)
def test_bad_spans_name_file_and_line_and_write_nothing(tmp_path, record, words):
    from tokenloom.errors import InputError

    good = {"input_ids": [5, 6], "loss_spans": [[1, 2]]}
    inputs = write_jsonl(tmp_path / "spans.jsonl", [good, good, record])
    with pytest.raises(InputError) as caught:
        tokenize_to_store([inputs], str(tmp_path / "out"), TokenizeConfig(input_format="spans", workers=0))
    assert f"{inputs}:3: " in str(caught.value) and words in str(caught.value), str(caught.value)
    assert not [name for name in os.listdir(tmp_path) if name.startswith("out")]


def test_cli_tokenizes_chat_with_its_flags(chat_tokenizer, chat_records, tmp_path, capsys):
    from tokenloom.cli import main

    inputs = write_jsonl(tmp_path / "chat.jsonl", chat_records[:5])
    template = _template_file(tmp_path, CHATML)
    code = main(["tokenize", inputs, "-o", str(tmp_path / "chat"), "--tokenizer", chat_tokenizer,
                 "--input-format", "chat", "--chat-template", template, "--assistant-prefix-tokens", "2", "-q"])
    assert code == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "loss mask" in out
    with open(tmp_path / "chat.meta.json") as f:
        source = json.load(f)["source"]
    assert source["input_format"] == "chat" and source["chat_template"] == template
    assert source["assistant_prefix_tokens"] == 2
    assert IndexedDataset(str(tmp_path / "chat")).has_loss_mask


def test_spans_encode_nothing_so_the_tokenizer_is_not_scanned(chat_tokenizer, tmp_path):
    inputs = write_jsonl(tmp_path / "spans.jsonl", [{"input_ids": [5, 6, 7], "loss_spans": [[1, 3]]}])
    summary = tokenize_to_store([inputs], str(tmp_path / "out"), TokenizeConfig(
        tokenizer=chat_tokenizer, input_format="spans", workers=0))
    assert (summary.engine, summary.engine_note, summary.divergent_code_points) == ("none", "pre-tokenized input", None)
    assert summary.loss_tokens == 2 and summary.num_tokens == 4  # the EOD appended, outside the loss


def test_tokens_merging_across_a_message_boundary_are_refused_and_skipped_whole(chat_tokenizer, tmp_path):
    from tokenloom.errors import InputError

    # Megatron's identity template joins the contents bare: "de" + "f main():" is "def main():" whole
    plain = _template_file(tmp_path, "{% for message in messages %}{{ message['content'] }}{% endfor %}")
    merging = {"messages": [{"role": "user", "content": "de"}, {"role": "assistant", "content": "f main():"}]}
    # a good conversation, then (after a system message) the merging one
    two = {"messages": [*GOOD_CHAT["messages"], {"role": "system", "content": "Code."}, *merging["messages"]]}
    inputs = write_jsonl(tmp_path / "chat.jsonl", [GOOD_CHAT, two, merging, GOOD_CHAT])
    config = dict(tokenizer=chat_tokenizer, input_format="chat", workers=0, chat_template=plain)
    with pytest.raises(InputError, match=r"chat\.jsonl:2: the conversation's tokens differ from its messages' tokens "
                       r"one after another from token \d+"):
        tokenize_to_store([inputs], str(tmp_path / "out"), TokenizeConfig(**config))
    assert not [name for name in os.listdir(tmp_path) if name.startswith("out")]
    summary = tokenize_to_store([inputs], str(tmp_path / "out"), TokenizeConfig(**config, skip_bad=True))
    assert summary.skipped == {"template_error": 2}  # line 2 whole (its good conversation too) and line 3
    store = IndexedDataset(str(tmp_path / "out"))
    assert len(store) == 2 and store[0].tolist() == store[1].tolist()
    assert store.get_loss_mask(0).tolist() == store.get_loss_mask(1).tolist()


def test_auto_header_needs_the_content_written_as_given(chat_tokenizer, tmp_path):
    from tokenloom.errors import ConfigError

    shouting = _template_file(tmp_path, "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | upper }}"
                              "<|im_end|>\n{% endfor %}")
    inputs = write_jsonl(tmp_path / "chat.jsonl", [GOOD_CHAT])
    with pytest.raises(ConfigError, match=r"assistant_prefix_tokens='auto' cannot find an assistant message's content "
                       r"in its rendering \(\"<\|im_start\|>assistant\\nTOKENLOOM FINDS"):
        tokenize_to_store([inputs], str(tmp_path / "out"), TokenizeConfig(
            tokenizer=chat_tokenizer, input_format="chat", workers=0, chat_template=shouting,
            assistant_prefix_tokens="auto"))
    assert not [name for name in os.listdir(tmp_path) if name.startswith("out")]
    with pytest.raises(ConfigError, match="expected an int >= 0 or 'auto'"):
        TokenizeConfig(input_format="chat", assistant_prefix_tokens=-1)
    with pytest.raises(ConfigError, match="apply to input_format='chat', not 'jsonl'"):
        TokenizeConfig(input_format="jsonl", assistant_prefix_tokens="auto")

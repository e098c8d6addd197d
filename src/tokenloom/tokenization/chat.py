"""Chat conversations -> tokens and a per-token loss mask, as Megatron-LM's ``SFTDataset`` makes them.

A chat JSONL line holds ``{"messages": [{"role": ..., "content": ...}, ...]}``. As ``SFTDataset``
does, a line is split into conversations at each ``system`` message (a line may pack several),
and each conversation becomes one document of the store. Its tokens are the conversation rendered
through the tokenizer's chat template (a Jinja template: ``chat_template`` in
``tokenizer_config.json``, ``chat_template.jinja`` beside the tokenizer, or a file given) and
encoded without added special tokens, exactly what ``SFTTokenizer.tokenize_conversation`` takes
from ``transformers``' ``apply_chat_template``.

Which tokens carry loss is decided the way ``SFTTokenizer`` decides it: each message is rendered
alone through the same template, and the conversation's tokens must be the messages' tokens one
after another (a template that renders a message differently inside a conversation, e.g. one
that inserts a default system prompt or a BOS per rendering, is refused: ``SFTTokenizer`` asserts
the same). The tokens of ``system``, ``user`` and ``tool`` messages are outside the loss; an
``assistant`` message's tokens are in it, all of them (its role header and its end-of-turn tokens
as the template writes them) except its first ``assistant_prefix_tokens`` (``SFTTokenizer``'s
``assistant_prefix_len``: Nemotron's formats put the role header there). The mask is per token,
1 where the token is a target the loss counts (FORMAT.md, "Tokenizing chat and spans"); Megatron's
``loss_mask[i]`` is the mask of ``labels[i] = tokens[i + 1]``.

The template is rendered in a sandbox set up as ``transformers`` sets up its own (the same Jinja
options, ``raise_exception``, ``tojson``, ``strftime_now``; ``{% generation %}`` blocks render
their body), with the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) from
``tokenizer_config.json`` as variables. Jinja2 is imported on first use: it is what
``transformers`` renders with, and ``transformers`` itself (a model library, heavy to import)
adds nothing to rendering a template.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from tokenloom.errors import ConfigError
from tokenloom.tokenization.inputs import RecordError, _json_type
from tokenloom.validate import is_integer

ROLES = ("system", "user", "assistant", "tool")
"""The roles ``SFTTokenizer`` masks (compared lower-cased, as it does)."""

_PROMPT_ROLES = ("user", "tool")
"""What an assistant message must follow (``SFTTokenizer`` asserts it)."""

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
                       "additional_special_tokens")
"""The variables ``transformers`` passes a template from the tokenizer's special tokens map."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatTemplate:
    """A Jinja chat template and the variables it is rendered with."""

    source: str
    """The template text."""

    origin: str
    """Where it came from (a file, or ``tokenizer_config.json``'s ``chat_template``), for messages."""

    variables: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    """The tokenizer's special tokens (``bos_token``, ``eos_token``, ...), as ``transformers``
    passes them."""

    def __post_init__(self) -> None:
        _compile(self.source, self.origin)  # a syntax error is the loader's to report, not the first record's

    def render(self, messages: Sequence[Mapping[str, Any]]) -> str:
        """The text of ``messages`` (no generation prompt)."""
        return _compile(self.source, self.origin).render(messages=list(messages), add_generation_prompt=False,
                                                          **self.variables)


_COMPILED: dict[tuple[str, str], Any] = {}


def _compile(source: str, origin: str):
    """The template compiled in a sandbox set up as ``transformers``' ``_compile_jinja_template``
    sets up its own (so a template renders the same text here and there); cached per process."""
    compiled = _COMPILED.get((source, origin))
    if compiled is not None:
        return compiled
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ConfigError("rendering a chat template needs jinja2; install it with: "
                          "pip install 'tokenloom[tokenizers]'") from exc

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers' assistant tracker) renders its body."""

        tags = {"generation"}  # noqa: RUF012 - jinja's own class attribute

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format_string):
        import datetime

        return datetime.datetime.now().strftime(format_string)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[Generation, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    try:
        compiled = environment.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"{origin}: not a valid Jinja chat template: {exc.message} at line {exc.lineno}") from exc
    _COMPILED[(source, origin)] = compiled
    return compiled


def _special_token_variables(config: Mapping[str, Any]) -> dict[str, Any]:
    variables: dict[str, Any] = {}
    for key in _SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):  # an AddedToken written out: {"content": ..., ...}
            value = value.get("content")
        if key == "additional_special_tokens" and isinstance(value, list):
            value = [v.get("content") if isinstance(v, dict) else v for v in value]
        if value is not None:
            variables[key] = value
    return variables


def _tokenizer_directory(tokenizer: str) -> str | None:
    if tokenizer == "bytes":
        return None
    path = os.fspath(tokenizer)
    return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))


def _read_tokenizer_config(directory: str | None) -> tuple[str | None, dict]:
    if directory is None:
        return None, {}
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None, {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a readable tokenizer_config.json: {exc}") from exc
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(config).__name__}")
    return path, config


def _named_template(path: str, value: Any) -> str:
    """``chat_template`` of a tokenizer_config.json: a string, or transformers' list of named
    templates, of which the one named ``default`` is the template."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ConfigError(f"{path}: chat_template lists templates named {sorted(map(str, named))} but none named "
                          "'default'; give the one to use as a file")
    raise ConfigError(f"{path}: chat_template is {type(value).__name__}, expected a string or a list of named "
                      "templates")


def load_chat_template(tokenizer: str, template_path: str | None = None) -> ChatTemplate:
    """The chat template of ``tokenizer`` (a tokenizer.json path, its directory, or ``"bytes"``):
    ``template_path`` when given, else ``chat_template`` in ``tokenizer_config.json`` beside the
    tokenizer, else ``chat_template.jinja`` there. The variables are the special tokens that
    ``tokenizer_config.json`` names. ConfigError when there is none, naming where it looked."""
    directory = _tokenizer_directory(tokenizer)
    config_path, config = _read_tokenizer_config(directory)
    variables = _special_token_variables(config)
    if template_path is not None:
        try:
            with open(template_path, encoding="utf-8") as f:
                source = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"chat template {template_path!r}: cannot read it as UTF-8 text: {exc}") from exc
        return ChatTemplate(source=source, origin=os.fspath(template_path), variables=variables)
    if directory is None:
        raise ConfigError("the byte tokenizer has no chat template; give a Jinja template file (chat_template)")
    if config_path is not None and config.get("chat_template") is not None:
        source = _named_template(config_path, config["chat_template"])
        return ChatTemplate(source=source, origin=f"{config_path}: chat_template", variables=variables)
    jinja_path = os.path.join(directory, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return ChatTemplate(source=f.read(), origin=jinja_path, variables=variables)
    raise ConfigError(f"tokenizer {tokenizer!r} has no chat template: no chat_template in "
                      f"{os.path.join(directory, 'tokenizer_config.json')} and no {jinja_path}; give a Jinja "
                      "template file (chat_template)")


# -- records -> conversations ---------------------------------------------------------------------
def split_conversations(messages: Sequence[Mapping[str, Any]]) -> list[list[Mapping[str, Any]]]:
    """The conversations of one record: a new one at each ``system`` message (``SFTDataset``'s
    ``_split_conversations``)."""
    conversations: list[list[Mapping[str, Any]]] = []
    current: list[Mapping[str, Any]] = []
    for message in messages:
        if message["role"] == "system" and current:
            conversations.append(current)
            current = []
        current.append(message)
    if current:
        conversations.append(current)
    return conversations


def conversations_of(record: Any, where: str) -> list[list[Mapping[str, Any]]]:
    """The checked conversations of a parsed JSON line; RecordError naming ``where``
    (``path:line``) and the message when the record is not one ``SFTDataset`` can mask."""
    if not isinstance(record, dict) or "messages" not in record:
        keys = sorted(record)[:8] if isinstance(record, dict) else None
        raise RecordError("missing_key", f"{where}: no key 'messages' in the object (its keys: {keys})")
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise RecordError("bad_conversation", f"{where}: 'messages' is {_describe(messages)}, expected a "
                          "non-empty array of {role, content} objects")
    for number, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RecordError("bad_conversation", f"{where}: message {number} is {_describe(message)}, "
                              "expected an object with 'role' and 'content'")
        role = message.get("role")
        if not isinstance(role, str) or role.lower() not in ROLES:
            raise RecordError("bad_conversation", f"{where}: message {number} has role {role!r}, expected one "
                              f"of {list(ROLES)}")
        if "content" not in message:
            raise RecordError("bad_conversation", f"{where}: message {number} ({role}) has no 'content'")
        if not isinstance(message["content"], str):
            raise RecordError("bad_conversation", f"{where}: message {number} ({role}) has content "
                              f"{_describe(message['content'])}, expected a string")
    conversations = split_conversations(messages)
    first = 0
    for conversation in conversations:
        roles = [message["role"].lower() for message in conversation]
        if "assistant" not in roles:
            raise RecordError("bad_conversation", f"{where}: the conversation of messages {first}-"
                              f"{first + len(roles) - 1} has no assistant turn, so nothing of it would be in "
                              "the loss")
        for k, role in enumerate(roles):
            if role != "assistant":
                continue
            if not conversation[k]["content"]:
                raise RecordError("bad_conversation", f"{where}: message {first + k} is an empty assistant "
                                  "turn")
            if k == 0 or roles[k - 1] not in _PROMPT_ROLES:
                after = f"a {roles[k - 1]} message" if k else "the start of a conversation"
                raise RecordError("bad_conversation", f"{where}: message {first + k} is an assistant turn "
                                  f"after {after}; Megatron's SFTDataset expects one after a user or tool "
                                  "message")
        first += len(conversation)
    return conversations


def _describe(value: Any) -> str:
    """A JSON value's kind as a message says it (:func:`~tokenloom.tokenization.inputs._json_type`),
    a string and an empty array named as such: a conversation needs messages."""
    if isinstance(value, str):
        return "a string"
    return "an empty array" if isinstance(value, list) and not value else _json_type(value)


# -- conversations -> tokens and mask -------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class RenderedConversation:
    """One conversation's text, whole and message by message."""

    where: str
    """``path:line`` of its record."""

    text: str
    """The conversation rendered whole: what its tokens are."""

    turns: list[str]
    """Each message rendered alone; they join to ``text``."""

    in_loss: list[bool]
    """(len(turns),) whether each message is an assistant turn."""


def render_conversation(template: ChatTemplate, conversation: Sequence[Mapping[str, Any]],
                        where: str) -> RenderedConversation:
    """Render ``conversation`` whole and message by message; RecordError (``template_error``)
    when the template raises or the messages do not join to the whole."""
    try:
        text = template.render(conversation)
        turns = [template.render([message]) for message in conversation]
    except Exception as exc:  # the template's own raise_exception, or a template bug on this record
        raise RecordError("template_error", f"{where}: the chat template ({template.origin}) failed on this "
                          f"conversation: {type(exc).__name__}: {exc}") from exc
    if "".join(turns) != text:
        at = _first_difference("".join(turns), text)
        raise RecordError("template_error", f"{where}: the chat template ({template.origin}) renders the "
                          "messages one by one differently from the whole conversation (from character "
                          f"{at}: {text[at:at + 40]!r} whole, {''.join(turns)[at:at + 40]!r} one by one), so "
                          "the assistant turns cannot be told apart; Megatron's SFTDataset refuses it too (a "
                          "template that adds a default system prompt or a BOS per rendering)")
    return RenderedConversation(where=where, text=text, turns=turns,
                                in_loss=[message["role"].lower() == "assistant" for message in conversation])


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclasses.dataclass(kw_only=True)
class EncodedConversations:
    """Tokens and mask of a batch of conversations; ``bad`` lists those left out."""

    tokens: np.ndarray  # (T,) ids of the kept conversations, back to back
    lengths: np.ndarray  # (kept,) int64
    loss_mask: np.ndarray  # (T,) uint8, 1 where the token is a target the loss counts
    bad: list[tuple[int, RecordError]]  # (index into the batch, why)
    routed: int = 0


def encode_conversations(encode: Callable[[list[str]], tuple], rendered: Sequence[RenderedConversation], *,
                         assistant_prefix_tokens: int = 0, groups: np.ndarray | None = None) -> EncodedConversations:
    """Encode ``rendered`` (one batch call for the whole conversations and their messages) and
    mask them as ``SFTTokenizer`` does; a conversation whose messages encode to other tokens than
    the whole goes to ``bad`` (``template_error``) and is left out, with every conversation of
    the same group (``groups``: (len(rendered),) e.g. the record of each; None: each its own).
    ``encode(texts)`` returns ``(tokens, lengths, routed)``."""
    count = len(rendered)
    texts = [r.text for r in rendered] + [turn for r in rendered for turn in r.turns]
    tokens, lengths, routed = encode(texts)
    tokens = np.asarray(tokens)
    lengths = np.asarray(lengths, dtype=np.int64)
    whole_lengths, turn_lengths = lengths[:count], lengths[count:]
    whole_total = int(whole_lengths.sum())
    whole, by_turn = tokens[:whole_total], tokens[whole_total:]
    turns_per = np.fromiter((len(r.turns) for r in rendered), dtype=np.int64, count=count)
    # turn_offsets: (count + 1,) where each conversation's messages begin among all messages
    turn_offsets = np.concatenate([[0], np.cumsum(turns_per)])
    turn_sums = np.add.reduceat(turn_lengths, turn_offsets[:-1]) if count else np.zeros(0, np.int64)
    bad: list[tuple[int, RecordError]] = []
    if not (np.array_equal(turn_sums, whole_lengths) and np.array_equal(whole, by_turn)):
        bad = _tokens_differ(rendered, whole, by_turn, whole_lengths, turn_sums)
    in_loss = np.fromiter((flag for r in rendered for flag in r.in_loss), dtype=np.uint8, count=int(turns_per.sum()))
    mask = np.repeat(in_loss, turn_lengths)  # (T,) the messages' tokens are the conversation's
    if assistant_prefix_tokens and mask.size:
        # an assistant turn's first assistant_prefix_tokens tokens (its role header) stay outside the loss
        starts = np.cumsum(turn_lengths) - turn_lengths
        chosen = np.flatnonzero(in_loss)
        heads = np.minimum(turn_lengths[chosen], assistant_prefix_tokens)
        within = np.arange(int(heads.sum())) - np.repeat(np.cumsum(heads) - heads, heads)
        mask[np.repeat(starts[chosen], heads) + within] = 0
    if bad:
        # a kept conversation's messages' tokens are its tokens, so its mask (counted in the
        # messages' tokens) lines up with them
        groups = np.arange(count) if groups is None else np.asarray(groups)
        keep = ~np.isin(groups, groups[[index for index, _ in bad]])
        return EncodedConversations(tokens=whole[np.repeat(keep, whole_lengths)], lengths=whole_lengths[keep],
                                    loss_mask=mask[np.repeat(keep, turn_sums)], bad=bad, routed=routed)
    return EncodedConversations(tokens=whole, lengths=whole_lengths, loss_mask=mask, bad=[], routed=routed)


def _tokens_differ(rendered, whole, by_turn, whole_lengths, turn_sums) -> list[tuple[int, RecordError]]:
    """The conversations whose messages' tokens are not the whole conversation's (BPE merging
    across a message boundary the template leaves without a special token)."""
    bad = []
    whole_at = turn_at = 0
    for index, r in enumerate(rendered):
        a = whole[whole_at:whole_at + int(whole_lengths[index])]
        b = by_turn[turn_at:turn_at + int(turn_sums[index])]
        whole_at += a.size
        turn_at += b.size
        if not np.array_equal(a, b):
            at = next((i for i, (x, y) in enumerate(zip(a.tolist(), b.tolist())) if x != y), min(a.size, b.size))
            bad.append((index, RecordError(
                "template_error", f"{r.where}: the conversation's tokens differ from its messages' tokens one after "
                f"another from token {at} (whole {a[at:at + 5].tolist()}, by message {b[at:at + 5].tolist()}): the "
                "tokenizer merges across a message boundary, so which tokens are the assistant's is not defined; "
                "Megatron's SFTDataset refuses it too (end each message with a special token in the template)")))
    return bad


def check_prefix_tokens(value: Any) -> int | str:
    """``assistant_prefix_tokens`` as an int >= 0 or ``"auto"``, or ConfigError."""
    if value == "auto":
        return value
    if not is_integer(value) or value < 0:
        raise ConfigError(f"assistant_prefix_tokens {value!r}, expected an int >= 0 or 'auto' (the tokens of an "
                          "assistant turn's role header kept outside the loss; Megatron's assistant_prefix_len)")
    return int(value)


_PROBE_CONTENT = "tokenloom finds the assistant's header before this content"


def assistant_header_tokens(template: ChatTemplate, encode: Callable[[list[str]], tuple]) -> int:
    """``assistant_prefix_tokens="auto"``: the number of tokens of what the template writes before an
    assistant message's content, found once by rendering one assistant message alone and encoding
    the text before its content (``encode(texts)`` returns ``(tokens, lengths, ...)``). Megatron's
    ``assistant_prefix_len`` is such a count, written by hand per prompt format; counting it from
    the template gives the same mask without knowing how the tokenizer splits the header.
    ConfigError when the template cannot render a lone assistant message or does not write its
    content as given."""
    try:
        text = template.render([{"role": "assistant", "content": _PROBE_CONTENT}])
    except Exception as exc:
        raise ConfigError(f"{template.origin}: assistant_prefix_tokens='auto' renders one assistant message alone to "
                          f"find its header, and the template failed: {type(exc).__name__}: {exc}; give the count "
                          "(assistant_prefix_tokens=N)") from exc
    at = text.find(_PROBE_CONTENT)
    if at < 0:
        raise ConfigError(f"{template.origin}: assistant_prefix_tokens='auto' cannot find an assistant message's "
                          f"content in its rendering ({text[:80]!r}); give the count (assistant_prefix_tokens=N)")
    return int(encode([text[:at]])[1][0]) if at else 0


__all__ = [
    "ROLES",
    "ChatTemplate",
    "EncodedConversations",
    "RenderedConversation",
    "assistant_header_tokens",
    "check_prefix_tokens",
    "conversations_of",
    "encode_conversations",
    "load_chat_template",
    "render_conversation",
    "split_conversations",
]

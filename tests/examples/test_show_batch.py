"""examples/show_batch.py on a blend of a code store with FIM, a prose store without and a chat
store with a loss mask, all tokenized with one BPE tokenizer from ``examples/train_bpe.py --chat
--fim``: what it prints of each served sample is held against the build's own index (the rows
before serving) and against a reading of ChatML that knows nothing of the stored mask."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import yaml

pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
POSITIONS = 240
SENTINELS = ("<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>")


def _run(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.fixture(scope="module")
def mix(tmp_path_factory):
    """The build config of the blend 0.5 code (FIM at 0.5) / 0.3 prose / 0.2 chat, and the tokenizer."""
    from pydoc_data.topics import topics

    from tokenloom.tokenization import TokenizeConfig, tokenize_to_store

    directory = tmp_path_factory.mktemp("mix")
    prose = directory / "topics.jsonl"
    names = sorted(topics)[:60]
    prose.write_text("".join(json.dumps({"text": topics[n]}) + "\n" for n in names), encoding="utf-8")
    chat = directory / "chat.jsonl"  # questions about the topics, answered by their first paragraphs
    chat.write_text("".join(json.dumps({"messages": [
        *([{"role": "system", "content": "Answer from the Python reference."}] if k % 3 == 0 else []),
        {"role": "user", "content": f"What is {n}?"}, {"role": "assistant", "content": topics[n][:300]},
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": topics[n][300:500] or "That is all."}]})
        + "\n" for k, n in enumerate(names)), encoding="utf-8")
    tokenizer = str(directory / "tok" / "tokenizer.json")
    printed = _run(os.path.join(EXAMPLES, "train_bpe.py"), str(prose), "--chat", "--fim", "--vocab-size", "2048",
                   "--output", tokenizer).stdout
    assert "ChatML chat template" in printed and "FIM sentinels" in printed

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tokenizer)
    assert all(tok.token_to_id(s) is not None for s in (*SENTINELS, "<|im_start|>", "<|im_end|>"))
    library = os.path.dirname(os.__file__)
    code = sorted(os.path.join(library, f) for f in os.listdir(library) if f.endswith(".py"))[:40]
    stores = {}
    for name, inputs, extra in (("code", code, {"skip_bad": True}), ("prose", [str(prose)], {}),
                                ("chat", [str(chat)], {"input_format": "chat", "assistant_prefix_tokens": "auto"})):
        config = TokenizeConfig(tokenizer=tokenizer, workers=1, **extra)
        stores[name] = tokenize_to_store(inputs, str(directory / name), config).prefix
    config = {"blend": ["0.5", stores["code"], "0.3", stores["prose"], "0.2", stores["chat"]],
              "split": "100,0,0", "seq_length": 128, "seed": 1234, "train_samples": POSITIONS,
              "valid_samples": 0, "test_samples": 0, "cache": str(directory / "cache"),
              "fim": {"fim_rate": 0.5, "fim_spm_rate": 0.5, "stores": [stores["code"]],
                      "fim_extra_tokens": {"prefix": "<fim_prefix>", "middle": "<fim_middle>",
                                           "suffix": "<fim_suffix>", "pad": "<fim_pad>", "eod": "<|endoftext|>"}}}
    path = directory / "mix.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return str(path), stores, tok


def assistant_tokens(ids: np.ndarray, tok) -> np.ndarray:
    """``(len(ids),)`` bool: the tokens of a ChatML conversation an assistant writes (its turn's
    text, ``<|im_end|>`` and the newline after it), read from the tokens alone; the role header
    ``<|im_start|>assistant\\n``, the other roles' turns and the end of document are not."""
    start, end, eod = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    flags, state, role = np.zeros(len(ids), dtype=bool), "out", ""
    for i, token in enumerate(int(t) for t in ids):
        if token in (start, eod):
            state, role = ("header" if token == start else "out"), ""
        elif state == "header":
            role += tok.decode([token], skip_special_tokens=False)
            state = "turn" if "\n" in role else "header"
        elif state in ("turn", "closed"):
            flags[i] = role.strip() == "assistant"
            state = "closed" if token == end else ("out" if state == "closed" else "turn")
    return flags


@pytest.fixture(scope="module")
def served(mix):
    """show_batch.py --json over every position, and the build's split."""
    import tokenloom

    config, _, _ = mix
    printed = _run(os.path.join(EXAMPLES, "show_batch.py"), config, "--positions", f"0:{POSITIONS}", "--json").stdout
    samples = [json.loads(line) for line in printed.splitlines()]
    return samples, tokenloom.build(config).split("train")


def test_fim_permutes_code_samples_only_and_they_hold_the_sentinels(mix, served):
    _, stores, tok = mix
    samples, split = served
    prefix_id, middle_id, suffix_id, pad_id = (tok.token_to_id(s) for s in SENTINELS)
    positions = np.array([s["position"] for s in samples])
    assert positions.tolist() == list(range(POSITIONS))
    dataset_ids, sample_ids = split.locate(positions)
    rows = split.read_samples(dataset_ids, sample_ids)  # (B, 129): the index's rows, before serving
    orders = {"PSM": 0, "SPM": 0, "plain": 0}
    for k, sample in enumerate(samples):
        served_row = np.array([*sample["tokens"], sample["labels"][-1]])
        sentinels = np.isin(served_row, [prefix_id, middle_id, suffix_id, pad_id])
        if sample["store"] != stores["code"]:
            assert not sentinels.any() and (served_row == rows[k]).all(), sample["position"]
            continue
        if not sample["fim"]:
            orders["plain"] += 1
            assert not sentinels.any() and (served_row == rows[k]).all(), sample["position"]
            continue
        assert not (served_row == rows[k]).all(), sample["position"]  # permuted: not the index's row
        first = int(np.flatnonzero(served_row == prefix_id)[0])
        assert len(sample["fim"]) == int((served_row == prefix_id).sum())
        spm = served_row[first + 1] == suffix_id
        assert sample["fim"][0] == ("SPM" if spm else "PSM")
        orders[sample["fim"][0]] += 1
        # PSM: <fim_prefix> prefix <fim_suffix> suffix <fim_middle> middle; SPM: <fim_prefix> <fim_suffix>
        # suffix <fim_middle> prefix middle; the sample may be cut after any of them
        after = served_row[first + 1:]
        suffix_at = np.flatnonzero(after == suffix_id)
        middle_at = np.flatnonzero(after == middle_id)
        if len(middle_at):
            assert len(suffix_at) and suffix_at[0] < middle_at[0], sample["position"]
    assert min(orders.values()) > 0, orders  # at fim_rate 0.5 and spm_rate 0.5, some of each


def test_chat_loss_mask_is_zero_exactly_outside_the_assistant_turns(mix, served):
    from tokenloom.io import IndexedDataset

    _, stores, tok = mix
    samples, split = served
    chat = [s for s in samples if s["store"] == stores["chat"]]
    assert len(chat) > 20
    store = IndexedDataset(stores["chat"])
    flags = {}
    outside = 0
    for sample, origin in zip(chat, split.where([s["position"] for s in chat])):
        row_flags = []
        for piece in origin.pieces:
            if piece.document not in flags:
                flags[piece.document] = assistant_tokens(store[piece.document], tok)
            row_flags.append(flags[piece.document][piece.offset:piece.offset + piece.length])
        row_flags = np.concatenate(row_flags)  # (seq_length + 1,): the sample's tokens
        assert len(row_flags) == len(sample["tokens"]) + 1
        # label t is token t + 1: in the loss exactly when an assistant wrote that token
        assert sample["loss_mask"] == row_flags[1:].astype(int).tolist(), sample["position"]
        outside += len(sample["loss_mask"]) - sum(sample["loss_mask"])
    assert 0 < outside < sum(len(s["loss_mask"]) for s in chat)
    assert all(all(s["loss_mask"]) for s in samples if s["store"] == stores["prose"])


def test_the_printed_lines_show_the_store_fim_and_the_tokens_outside_the_loss(mix, served):
    config, stores, _ = mix
    samples, _ = served
    first = {}
    for s in samples:
        kind = {stores["code"]: "fim" if s["fim"] else "code", stores["prose"]: "prose"}.get(s["store"], "chat")
        first.setdefault(kind, s)
    picked = sorted(s["position"] for s in first.values())
    printed = _run(os.path.join(EXAMPLES, "show_batch.py"), config, "--positions", f"{picked[0]}:{picked[-1] + 1}",
                   "--chars", "400").stdout.rstrip("\n").split("\n")
    lines = {int(head.split()[0]): (head, text) for head, text in zip(printed[0::2], printed[1::2])}
    for kind, sample in first.items():
        head, text = lines[sample["position"]]
        outside = len(sample["loss_mask"]) - sum(sample["loss_mask"])
        assert f"sample {sample['sample']} " in head and f"{outside} of 128 labels outside the loss" in head
        if kind == "fim":
            assert f"FIM {','.join(sample['fim'])}" in head and text.lstrip().startswith(("[<fim_prefix>]", "..."))
        else:
            assert "no FIM" in head and "<fim_" not in text
        if kind == "chat":
            assert "[" in text and "]" in text  # the runs outside the loss, bracketed

"""Every source kind and row format, multi-turn masking, tool calls, and the train/infer parity contract.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_data_formats.py
"""

from __future__ import annotations

import pytest

from tests.helpers import DATA_ASSETS as ASSETS
from tests.helpers import data_cfg, source, tiny_tokenizer
from workbench.data import chat, formats, pipeline, readers
from workbench.data.chat import IGNORE


@pytest.fixture
def tok():
    return tiny_tokenizer()


def trained_spans(ids, labels):
    """[(start, end)] of each run of trained labels."""
    out, start = [], None
    for i, y in enumerate(labels + [IGNORE]):
        if y != IGNORE and start is None:
            start = i
        elif y == IGNORE and start is not None:
            out.append((start, i))
            start = None
    return out


@pytest.mark.parametrize("name,fmt,rows", [
    ("messages.jsonl", "messages", 3), ("sharegpt.json", "sharegpt", 2), ("alpaca.csv", "alpaca", 3),
    ("prompt_completion.parquet", "prompt_completion", 2), ("text.jsonl", "text", 2),
    ("hf_dataset", "alpaca", 2),
])
def test_each_kind_and_format_is_read_detected_and_tokenised(tmp_path, tok, name, fmt, rows):
    tokenizer, contract = tok
    where, first = next(readers.iter_rows(ASSETS / name))
    assert where.startswith(str(ASSETS / name) + ":")
    assert formats.detect_format(first, where) == fmt
    out = pipeline.tokenise_source(source(name), tokenizer, contract, data_cfg(tmp_path))
    assert len(out.examples) == rows and out.skipped == 0
    for ids, labels in out.examples:
        assert any(y != IGNORE for y in labels)
        if fmt == "text":  # plain text: every token trained, document closed by end-of-text
            assert labels == ids and ids[-1] == tokenizer.convert_tokens_to_ids("<|endoftext|>")
        else:  # chat: every trained span ends with the end-of-turn token
            assert all(ids[e - 1] == contract.end_of_turn_id for _, e in trained_spans(ids, labels))


def test_json_array_rows_carry_their_line_numbers():
    wheres = [w for w, _ in readers.iter_rows(ASSETS / "sharegpt.json")]
    assert wheres == [f"{ASSETS / 'sharegpt.json'}:2", f"{ASSETS / 'sharegpt.json'}:3"]
    assert [w.rsplit(":", 1)[1] for w, _ in readers.iter_rows(ASSETS / "alpaca.csv")] == ["2", "3", "4"]


def test_format_conversions():
    w = "f:1"
    assert formats.to_messages({"instruction": "Do", "input": "x", "output": "y"}, "alpaca", w) == [
        {"role": "user", "content": "Do\n\nx"}, {"role": "assistant", "content": "y"}]
    sg = {"system": "S", "conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}
    assert [m["role"] for m in formats.to_messages(sg, "sharegpt", w)] == ["system", "user", "assistant"]
    pc = {"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "assistant", "content": "c"}]}
    assert formats.to_messages(pc, "prompt_completion", w)[-1] == {"role": "assistant", "content": "c"}
    assert formats.to_messages({"text": "hello"}, "text", w) == "hello"
    with pytest.raises(Exception, match="method=dpo"):
        formats.to_messages({"prompt": "p", "chosen": "a", "rejected": "b"}, "preference", w)


def test_multi_turn_trains_every_assistant_turn_and_nothing_else(tok):
    tokenizer, contract = tok
    msgs = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2 + 3?"},
            {"role": "assistant", "content": "5"}, {"role": "user", "content": "times 4?"},
            {"role": "assistant", "content": "20"}]
    ids, labels = chat.tokenize_chat(tokenizer, msgs, contract)
    spans = trained_spans(ids, labels)
    assert len(spans) == 2
    texts = [tokenizer.decode(ids[a:b]) for a, b in spans]
    assert texts == ["5<|im_end|>", "20<|im_end|>"]
    # the full sequence is the template's own rendering of the conversation (minus the final newline)
    full = tokenizer(tokenizer.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"]
    assert full[: len(ids)] == ids and tokenizer.decode(full[len(ids):]) == "\n"


def test_train_infer_parity_for_every_assistant_turn(tok):
    """Tokens trained for turn i == generation prompt for turns[:i] + the turn's text + end-of-turn."""
    tokenizer, contract = tok
    msgs = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "Another?"}, {"role": "assistant", "content": "Green, of course."},
            {"role": "user", "content": "Last one."}, {"role": "assistant", "content": "Red"}]
    ids, labels = chat.tokenize_chat(tokenizer, msgs, contract)
    spans = trained_spans(ids, labels)
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    assert len(spans) == len(turns)
    for (a, b), i in zip(spans, turns):
        prompt = tokenizer.apply_chat_template(msgs[:i], tokenize=True, add_generation_prompt=True,
                                               return_dict=True)["input_ids"]
        answer = tokenizer(msgs[i]["content"], add_special_tokens=False)["input_ids"]
        assert ids[:b] == list(prompt) + answer + [contract.end_of_turn_id]
        assert ids[:a] == chat.prompt_ids(tokenizer, msgs[:i])  # what generation is given
    # the EOS the model learns is the EOS generation stops on
    assert tokenizer.eos_token_id == contract.end_of_turn_id == ids[-1]


def test_named_template_override_and_tool_calls_pass_through(tmp_path, tok, monkeypatch):
    tokenizer, _ = tok
    saved = tokenizer.chat_template
    named = chat.templates()
    monkeypatch.setattr(chat, "templates", lambda: named)
    named["_test_tools"] = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "{% if m.get('tool_calls') %}<tool_call>{{ m['tool_calls'][0]['function'] | tojson }}</tool_call>{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    try:
        contract = chat.setup_tokenizer(tokenizer, "_test_tools")
        out = pipeline.tokenise_source(source("messages.jsonl", "messages"), tokenizer, contract, data_cfg(tmp_path))
    finally:
        tokenizer.chat_template = saved
        chat.setup_tokenizer(tokenizer)
    ids, labels = out.examples[1]
    texts = [tokenizer.decode(ids[a:b]) for a, b in trained_spans(ids, labels)]
    assert texts[0].startswith("<tool_call>") and '"city": "Paris"' in texts[0] and texts[0].endswith("<|im_end|>")
    assert texts[1] == "It is 18C and sunny.<|im_end|>"
    assert "18C, sunny" not in "".join(texts)  # the tool's output is context, not a target


def test_column_mapping_and_length_filters(tmp_path, tok):
    tokenizer, contract = tok
    src = source("mapped.jsonl", "prompt_completion", columns={"prompt": "question", "completion": "answer"})
    out = pipeline.tokenise_source(src, tokenizer, contract, data_cfg(tmp_path))
    assert len(out.examples) == 2
    assert tokenizer.decode([t for t, y in zip(*out.examples[0]) if y != IGNORE]) == "2<|im_end|>"
    lens = out.examples.lengths()
    src2 = source("mapped.jsonl", "prompt_completion", columns={"prompt": "question", "completion": "answer"},
                  max_tokens=int(lens.min()) - 1, min_tokens=0)
    with pytest.raises(Exception, match="2 outside min_tokens/max_tokens"):
        pipeline.tokenise_source(src2, tokenizer, contract, data_cfg(tmp_path))
    capped = pipeline.tokenise_source(source("alpaca.csv", max_samples=2), tokenizer, contract, data_cfg(tmp_path))
    assert len(capped.examples) == 2
    full = pipeline.tokenise_source(source("alpaca.csv"), tokenizer, contract, data_cfg(tmp_path)).examples.lengths()
    cut = int(full.max()) - 1
    short = pipeline.tokenise_source(source("alpaca.csv"), tokenizer, contract, data_cfg(tmp_path, seq_len=cut))
    assert short.truncated == int((full > cut).sum()) >= 1 and max(short.examples.lengths()) == cut
    with pytest.raises(Exception, match=r"alpaca.csv:2: no trained token left within data.seq_len=20"):
        pipeline.tokenise_source(source("alpaca.csv"), tokenizer, contract, data_cfg(tmp_path, seq_len=20))


def test_bpe_tokenizer_decodes_without_the_wordpiece_clean_up(tok):
    """SmolLM2's tokenizer config asks for clean_up_tokenization_spaces, which transformers ignores
    for BPE with a warning on a run's first decode; setup_tokenizer says false, and decoding keeps
    the spaces before punctuation either way."""
    tokenizer, _ = tok
    assert tokenizer.clean_up_tokenization_spaces is False
    text = "Hello , world . 1 + 2 = 3 ?"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text

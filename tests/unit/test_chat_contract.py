"""The EOS contract: the end-of-turn token comes from the chat template, whatever the tokenizer says."""

from __future__ import annotations

import pytest

from tests.conftest import compose
from workbench.data.chat import IGNORE, prompt_ids, setup_tokenizer, tokenize_chat
from workbench.models.load import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(compose().model)


def test_end_of_turn_is_im_end_even_though_gguf_says_otherwise(tok):
    contract = setup_tokenizer(tok)
    assert contract.end_of_turn == "<|im_end|>"
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == contract.end_of_turn_id


def test_trained_tokens_equal_inference_prompt_plus_answer(tok):
    contract = setup_tokenizer(tok)
    msgs = [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]
    ids, labels = tokenize_chat(tok, msgs, contract)
    prompt = prompt_ids(tok, msgs[:1])
    answer = tok("5", add_special_tokens=False)["input_ids"] + [contract.end_of_turn_id]
    assert ids == prompt + answer
    assert labels == [IGNORE] * len(prompt) + answer


def test_named_template_override(tok):
    contract = setup_tokenizer(tok, "chatml")
    text = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    assert contract.end_of_turn == "<|im_end|>"

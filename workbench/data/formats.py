"""Chat rendering and loss masks: the train/infer contract.

Every conversation is rendered with the model's chat template. The tokens trained for an
assistant turn are exactly what inference produces: the prefix is
`apply_chat_template(turns_before, add_generation_prompt=True)`, the target is the turn's
text followed by the template's end-of-turn token — the same token the export's
`generation_config.json` stops on. Tokens after end-of-turn (a trailing newline) are not
trained, since generation never produces them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

IGNORE = -100

# Named chat templates a user may ask for with data.chat_template=<name>.
TEMPLATES = {
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
        " + '<|im_end|>' + '\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
}


@dataclass(frozen=True)
class ChatContract:
    """What the tokenizer's template says about turn boundaries."""

    end_of_turn: str
    end_of_turn_id: int
    template_hash: str


def setup_tokenizer(tokenizer, template_name: str | None = None) -> ChatContract:
    """Apply a named template if asked, find the end-of-turn token, and make it the EOS.

    Some conversions get EOS wrong (SmolLM2's GGUF says `<|im_start|>`); a model trained on
    one EOS and served with another never stops. The end-of-turn token is read off the
    template itself: render a probe assistant turn and take the first special token after it.
    """
    if template_name:
        if template_name not in TEMPLATES:
            from workbench.errors import UserError

            raise UserError(f"data.chat_template={template_name!r} is not one of {sorted(TEMPLATES)}")
        tokenizer.chat_template = TEMPLATES[template_name]
    if not tokenizer.chat_template:
        from workbench.errors import UserError

        raise UserError("the tokenizer has no chat template; set data.chat_template (e.g. chatml)")
    probe = "PROBE_TEXT_7"
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": probe}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False)
    tail = text[text.rindex(probe) + len(probe):]
    ids = tokenizer(tail, add_special_tokens=False)["input_ids"]
    specials = set(tokenizer.all_special_ids) | {
        i for t, i in tokenizer.get_vocab().items() if t.startswith("<|") and t.endswith("|>")
    }
    eot_id = next((i for i in ids if i in specials), ids[0] if ids else tokenizer.eos_token_id)
    eot = tokenizer.convert_ids_to_tokens(eot_id)
    tokenizer.eos_token = eot
    if tokenizer.pad_token is None:
        pad = "<|endoftext|>" if "<|endoftext|>" in tokenizer.get_vocab() else eot
        tokenizer.pad_token = pad
    digest = hashlib.sha256(tokenizer.chat_template.encode()).hexdigest()[:16]
    return ChatContract(eot, eot_id, digest)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_chat(tokenizer, messages: list[dict], contract: ChatContract, loss_on: str = "assistant"):
    """Return (input_ids, labels) for a conversation; labels are IGNORE outside trained spans.

    Loss covers every assistant turn (multi-turn included). The sequence is the concatenation
    of per-turn pieces, each rendered as a prefix difference, so what is trained for turn i is
    byte-for-byte the generation prompt for turns[:i] followed by the answer.
    """
    input_ids: list[int] = []
    labels: list[int] = []
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        prompt_ids = _ids(tokenizer, prompt)
        # Templates that re-render earlier turns differently (e.g. strip reasoning) make this
        # a plain prefix difference; for ordinary templates prompt_ids extends input_ids.
        new_prompt = prompt_ids[len(input_ids):]
        target = _ids(tokenizer, msg["content"]) + [contract.end_of_turn_id]
        input_ids += new_prompt
        labels += (new_prompt if loss_on == "all" else [IGNORE] * len(new_prompt))
        input_ids += target
        labels += target
        if i == len(messages) - 1:
            break
        # the template's text between end-of-turn and the next turn (e.g. "\n") is context only
        full = _ids(tokenizer, tokenizer.apply_chat_template(messages[: i + 1], tokenize=False))
        if full[: len(input_ids)] == input_ids and len(full) > len(input_ids):
            rest = full[len(input_ids):]
            input_ids += rest
            labels += [IGNORE] * len(rest)
    return input_ids, labels


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the generation prompt for `messages` (what inference sees)."""
    return _ids(tokenizer, tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

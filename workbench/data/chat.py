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

from workbench.core.errors import UserError
from workbench.families import registry as families

IGNORE = -100

# Named chat templates a user may ask for with data.chat_template=<name>: chatml, and each model
# family's own by its spec's template_name (gemma: <start_of_turn>user ... <end_of_turn>; read
# when asked, so a family registered later is offered too).
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def templates() -> dict[str, str]:
    return {"chatml": CHATML, **{s.template_name: s.chat_template for s in families.FAMILIES.values() if s.template_name}}


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
        named = templates()
        if template_name not in named:
            raise UserError(f"data.chat_template={template_name!r} is not one of {sorted(named)}")
        tokenizer.chat_template = named[template_name]
    if not tokenizer.chat_template:
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
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if getattr(tokenizer, "clean_up_tokenization_spaces", False) and type(getattr(backend, "model", None)).__name__ == "BPE":
        # transformers ignores this WordPiece clean-up for BPE and warns that it would corrupt the
        # text on every run's first decode; saying false here decodes the same, without the warning
        tokenizer.clean_up_tokenization_spaces = False
    digest = hashlib.sha256(tokenizer.chat_template.encode()).hexdigest()[:16]
    return ChatContract(eot, eot_id, digest)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _batch_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """One tokenizer call for many strings: the Rust tokenizer's batch path, no per-call overhead."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    # The Rust tokenizer directly, when no truncation/padding state is left on it: the same ids
    # as tokenizer(texts) without building a Python encoding object per string.
    if backend is not None and backend.truncation is None and backend.padding is None:
        return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def _plain_turn(msg: dict) -> bool:
    """A turn whose trained text is exactly its string content (no tool calls to render)."""
    return isinstance(msg.get("content"), str) and not msg.get("tool_calls")


def tokenize_chat(tokenizer, messages: list[dict], contract: ChatContract, loss_on: str = "assistant"):
    """Return (input_ids, labels) for a conversation; labels are IGNORE outside trained spans.

    Loss covers every assistant turn (multi-turn included). The sequence is the concatenation
    of per-turn pieces, each rendered as a prefix difference, so what is trained for turn i is
    byte-for-byte the generation prompt for turns[:i] followed by the answer.
    """
    return tokenize_chats(tokenizer, [messages], contract, loss_on)[0]


def _special_tokens(tokenizer) -> set[str]:
    return set(tokenizer.all_special_tokens) | {str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()}


def _incremental_plan(tokenizer, messages: list[dict], eot_str: str, texts: list[str]) -> list | None:
    """Plan a conversation so each assistant turn tokenises only the text it adds, or None.

    The tokens of `a + b` are the tokens of `a` followed by those of `b` when `a` ends with a
    special token (tokenizers split on special tokens before anything else). So when the
    generation prompt for turn i extends, as a string, everything up to the previous turn's
    end-of-turn, the new prompt tokens are those of the string difference, exactly the ones a
    full re-tokenisation would give, without the quadratic cost on long multi-turn chats.
    """
    consumed, plan, local = "", [], []
    for i, msg in enumerate(messages):
        if msg.get("role") != "assistant":
            continue
        if not _plain_turn(msg):
            return None
        prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
        if not prompt.startswith(consumed) or (consumed and not consumed.endswith(eot_str)):
            return None
        base = len(texts) + len(local)
        local += [prompt[len(consumed):], msg["content"]]
        plan.append({"new": base, "target": base + 1})
        consumed = prompt + msg["content"] + eot_str
    texts += local
    return plan


def tokenize_chats(tokenizer, conversations: list[list[dict]], contract: ChatContract, loss_on: str = "assistant"):
    """`tokenize_chat` for many conversations, with every string tokenised in one batch call.

    An assistant turn with tool calls (or non-string content) is trained on what the template
    renders for it: the tokens between its generation prompt and the first end-of-turn.
    """
    texts: list[str] = []
    plans = []
    eot_str = contract.end_of_turn
    atomic = loss_on != "all" and eot_str in _special_tokens(tokenizer)
    for messages in conversations:
        inc = _incremental_plan(tokenizer, messages, eot_str, texts) if atomic else None
        if inc is not None:
            plans.append(inc)
            continue
        plan = []
        for i, msg in enumerate(messages):
            if msg.get("role") != "assistant":
                continue
            last = i == len(messages) - 1
            prompt = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)
            plain = _plain_turn(msg)
            step = {"prompt": len(texts), "plain": plain, "last": last}
            texts.append(prompt)
            if plain:
                step["target"] = len(texts)
                texts.append(msg["content"])
            if not last or not plain:
                step["full"] = len(texts)
                texts.append(tokenizer.apply_chat_template(messages[: i + 1], tokenize=False))
            plan.append(step)
            if last:
                break
        plans.append(plan)
    toks = _batch_ids(tokenizer, texts)
    eot = contract.end_of_turn_id
    out = []
    for plan in plans:
        input_ids: list[int] = []
        labels: list[int] = []
        for step in plan:
            if "new" in step:  # incremental: only the text this turn adds was tokenised
                new = toks[step["new"]]
                target = toks[step["target"]] + [eot]
                input_ids += new + target
                labels += [IGNORE] * len(new) + target
                continue
            prompt_ids = toks[step["prompt"]]
            # Templates that re-render earlier turns differently (e.g. strip reasoning) make this
            # a plain prefix difference; for ordinary templates prompt_ids extends input_ids.
            new_prompt = prompt_ids[len(input_ids):]
            if step["plain"]:
                target = toks[step["target"]] + [eot]
            else:
                rendered = toks[step["full"]][len(prompt_ids):]
                cut = rendered.index(eot) + 1 if eot in rendered else len(rendered)
                target = rendered[:cut]
            input_ids += new_prompt
            labels += (new_prompt if loss_on == "all" else [IGNORE] * len(new_prompt))
            input_ids += target
            labels += target
            if step["last"]:
                break
            # the template's text between end-of-turn and the next turn (e.g. "\n") is context only
            full = toks[step["full"]]
            if full[: len(input_ids)] == input_ids and len(full) > len(input_ids):
                rest = full[len(input_ids):]
                input_ids += rest
                labels += [IGNORE] * len(rest)
        out.append((input_ids, labels))
    return out


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the generation prompt for `messages` (what inference sees)."""
    return _ids(tokenizer, tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))

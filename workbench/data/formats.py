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

from workbench.errors import UserError

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
            raise UserError(f"data.chat_template={template_name!r} is not one of {sorted(TEMPLATES)}")
        tokenizer.chat_template = TEMPLATES[template_name]
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


# -- row formats ---------------------------------------------------------------------------
# format name -> the columns that identify it (checked in this order by `detect_format`)
FORMATS = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "preference": ("prompt", "chosen", "rejected"),
    "unpaired": ("prompt", "completion", "label"),  # KTO (workbench/data/unpaired.py)
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "prompt_only": ("prompt",),
    "text": ("text",),
}
SFT_FORMATS = ("messages", "sharegpt", "alpaca", "prompt_completion", "text")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bing": "assistant", "bard": "assistant", "system": "system",
                  "function_call": "assistant", "observation": "tool", "tool": "tool", "function": "tool"}
EXPECTED = {
    "messages": '{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}',
    "sharegpt": '{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}',
    "alpaca": '{"instruction": ..., "input": ... (optional), "output": ...}',
    "prompt_completion": '{"prompt": ..., "completion": ...} (strings or message lists)',
    "text": '{"text": ...}',
    "preference": '{"prompt": ..., "chosen": ..., "rejected": ...}',
    "unpaired": '{"prompt": ..., "completion": ..., "label": true|false}',
    "prompt_only": '{"prompt": ..., "answer": ... (optional)}',
}


def detect_format(row: dict, where: str) -> str:
    """The format a row's columns identify; a UserError listing the choices when none fits."""
    for name, cols in FORMATS.items():
        if all(c in row for c in cols):
            return name
    raise UserError(f"{where}: cannot tell the row's format from its columns {sorted(row)}; expected one of: "
                    + "; ".join(f"{k} {v}" for k, v in EXPECTED.items() if k in SFT_FORMATS)
                    + ". Declare `format:` and map your columns with `columns: {ours: yours}`")


def _need(row: dict, key: str, fmt: str, where: str):
    if key not in row:
        raise UserError(f"{where}: row has no {key!r} field (columns: {sorted(row)}); format {fmt} expects "
                        f"{EXPECTED[fmt]}; map a differently named column with `columns: {{{key}: <yours>}}`")
    return row[key]


def _text(value, key: str, fmt: str, where: str) -> str:
    if not isinstance(value, str):
        raise UserError(f"{where}: {key!r} must be a string for format {fmt}, got {type(value).__name__}")
    return value


def _check_messages(msgs, key: str, where: str) -> list[dict]:
    if not isinstance(msgs, list) or not msgs:
        raise UserError(f"{where}: {key!r} must be a non-empty list of messages")
    for j, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m:
            raise UserError(f"{where}: {key}[{j}] needs 'role' and 'content' (got {m!r:.80})")
        if "content" not in m and not m.get("tool_calls"):
            raise UserError(f"{where}: {key}[{j}] needs 'content' (or 'tool_calls' for an assistant turn)")
        if m["role"] not in ("system", "user", "assistant", "tool", "developer", "function", "ipython"):
            raise UserError(f"{where}: {key}[{j}] has unknown role {m['role']!r}; expected system/user/assistant/tool")
        content = m.get("content")
        # Checked here, not left to the chat template: Jinja would fail on `'...' + 42` with a raw
        # TypeError and no file:line. Lists are content parts ([{"type": "text", ...}]).
        ok = isinstance(content, str) or (content is None and m.get("tool_calls")) or \
            (isinstance(content, list) and all(isinstance(part, dict) for part in content))
        if not ok:
            raise UserError(f"{where}: {key}[{j}].content must be a string (got {type(content).__name__}: "
                            f"{content!r:.40})")
    return msgs


def check_messages(msgs, key: str, where: str) -> list[dict]:
    """A list of {role, content} messages, checked (roles, content types); UserError at `where`."""
    return _check_messages(msgs, key, where)


def to_messages(row: dict, fmt: str, where: str) -> list[dict] | str:
    """A row as a conversation (list of messages) or, for format text, the plain string.

    Tool calls and any extra message keys are passed through untouched for the template.
    """
    if fmt == "messages":
        msgs = _check_messages(_need(row, "messages", fmt, where), "messages", where)
    elif fmt == "sharegpt":
        conv = _need(row, "conversations", fmt, where)
        if not isinstance(conv, list) or not conv:
            raise UserError(f"{where}: 'conversations' must be a non-empty list of {{from, value}} turns")
        msgs = []
        for j, t in enumerate(conv):
            if not isinstance(t, dict) or "from" not in t or "value" not in t:
                raise UserError(f"{where}: conversations[{j}] needs 'from' and 'value' (ShareGPT), got {t!r:.80}")
            role = SHAREGPT_ROLES.get(str(t["from"]).lower())
            if role is None:
                raise UserError(f"{where}: conversations[{j}].from={t['from']!r} is not one of {sorted(SHAREGPT_ROLES)}")
            msgs.append({"role": role, "content": _text(t["value"], f"conversations[{j}].value", fmt, where)})
        if "system" in row and row["system"] and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": _text(row["system"], "system", fmt, where)})
    elif fmt == "alpaca":
        instruction = _text(_need(row, "instruction", fmt, where), "instruction", fmt, where)
        extra = row.get("input") or ""
        user = f"{instruction}\n\n{_text(extra, 'input', fmt, where)}" if extra else instruction
        msgs = [{"role": "user", "content": user},
                {"role": "assistant", "content": _text(_need(row, "output", fmt, where), "output", fmt, where)}]
        if row.get("system"):
            msgs.insert(0, {"role": "system", "content": _text(row["system"], "system", fmt, where)})
    elif fmt == "prompt_completion":
        prompt, completion = _need(row, "prompt", fmt, where), _need(row, "completion", fmt, where)
        prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else \
            _check_messages(prompt, "prompt", where)
        completion = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else \
            _check_messages(completion, "completion", where)
        msgs = list(prompt) + list(completion)
    elif fmt == "text":
        text = _text(_need(row, "text", fmt, where), "text", fmt, where)
        if not text.strip():
            raise UserError(f"{where}: 'text' is empty")
        return text
    elif fmt in ("preference", "prompt_only", "unpaired"):
        raise UserError(f"{where}: format {fmt} rows are for method=dpo/kto/grpo, not supervised fine-tuning; "
                        f"SFT formats: {', '.join(SFT_FORMATS)}")
    else:
        raise UserError(f"{where}: unknown format {fmt!r}; choose one of {', '.join(FORMATS)} or auto")
    if not any(m["role"] == "assistant" for m in msgs):
        raise UserError(f"{where}: no assistant turn to train on")
    return msgs

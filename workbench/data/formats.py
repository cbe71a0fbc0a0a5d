"""Dataset row formats: detect a row's shape (messages, ShareGPT, Alpaca, prompt/completion, text,
preference pairs, unpaired rows, prompts) and turn it into chat messages, with one error naming
the row's file:line when it does not fit. Rendering those messages is workbench/data/contract.py.
"""

from __future__ import annotations

from workbench.core.errors import UserError

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
    for j, m in enumerate(msgs):
        # an empty reply trains on the end-of-turn token alone: the model learns to say nothing
        if m["role"] == "assistant" and isinstance(m.get("content"), str) and not m["content"].strip() \
                and not m.get("tool_calls"):
            raise UserError(f"{where}: assistant turn {j + 1} is empty (it would train the model to end its turn "
                            "at once); fill it, drop the row, or set data.on_bad_row=skip")
    return msgs

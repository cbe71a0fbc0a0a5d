"""Episode tokens turn by turn with the model's chat template: what the policy reads between turns.

    r = Turns(tokenizer, contract, schemas)      # schemas: the environment's tools (JSON schemas)
    ids = r.prompt_ids(messages)                   # the first generation prompt, tools declared
    ctx = r.context_ids([tool_message, ...])      # after a sampled turn's end-of-turn: the tool
                                                   # results and the next generation prompt
    r.check()                                      # the chat contract across turns (UserError)

An episode is built as token ids, never by rendering the whole conversation again: the tokens a
turn was sampled from are exactly the tokens it is trained after. A sampled turn ends with the
contract's end-of-turn token (workbench/data/chat.py); everything the template writes after it
(its newline, the tool messages, the next assistant header) is context. `context_ids` renders
that text against a fixed stand-in conversation (a user turn and an assistant turn) and takes
what follows the stand-in's end-of-turn. Since the end-of-turn is a special token, tokenising
the text after it alone gives the same ids as tokenising the whole rendering (tokenizers split
on special tokens first), and earlier turns are never re-rendered, so a template that rewrites
them (Qwen3 strips reasoning from earlier assistant turns) cannot change what was sampled.

Tools reach the model as the template says: through `tools=` when the template renders them;
otherwise (SmolLM2's template ignores `tools=`) as a system message written by
workbench/envs/tools.py `describe`. Tool results are `role: tool` messages; a template that
does not render that role (it raises, or drops the content) gets them as user messages starting
with `Tool result (<name>):`, and `tool_role` says which was chosen.

`check()` renders a two-turn probe (a tool call, its result, an answer) in one piece with the
template and compares it with the turn-by-turn tokens: every assistant turn must end with the
contract's end-of-turn token (a template that ends tool-call turns with another token, e.g.
Llama's <|eom_id|>, would train a stop the served model never emits), and the two must agree
token for token; where they differ only because the template re-renders earlier turns, or
because the same text tokenises differently at a turn boundary when tokenised whole, `check`
returns a note instead of an error (training follows the tokens as sampled).
"""

from __future__ import annotations

from workbench.core.errors import UserError
from workbench.envs import tools as tool_fmt

_STAND_IN = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]


class Turns:
    def __init__(self, tokenizer, contract, schemas: list[dict], family: str | None = None):
        self.tok, self.contract, self.schemas = tokenizer, contract, schemas
        self.format = tool_fmt.format_for(tokenizer, family)
        self.native_tools = self._renders_tools()
        self.tool_role = "tool" if self._renders_tool_role() else "user"

    # -- what the template can do ------------------------------------------------------------
    def _render(self, messages: list[dict], generation: bool, tools: bool = True) -> str:
        kw = {"tools": self.schemas} if tools and self.native_tools else {}
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation, **kw)

    def _renders_tools(self) -> bool:
        plain = self.tok.apply_chat_template(_STAND_IN[:1], tokenize=False, add_generation_prompt=True)
        try:
            with_tools = self.tok.apply_chat_template(_STAND_IN[:1], tokenize=False, add_generation_prompt=True,
                                                      tools=self.schemas)
        except Exception:  # noqa: BLE001 - a template that cannot take tools= at all
            return False
        return with_tools != plain and self.schemas[0]["function"]["name"] in with_tools

    def _renders_tool_role(self) -> bool:
        probe = "TOOL_RESULT_93"
        try:
            text = self._render([*_STAND_IN, {"role": "tool", "name": "t", "content": probe}], True)
        except Exception:  # noqa: BLE001 - templates that allow only user/assistant raise
            return False
        return probe in text

    # -- messages ----------------------------------------------------------------------------
    def start(self, messages: list[dict]) -> list[dict]:
        """The conversation an episode starts from: the tools declared in a system message when
        the template does not render `tools=` (merged into the row's own system message)."""
        if self.native_tools:
            return list(messages)
        text = tool_fmt.describe(self.schemas, self.format)
        if messages and messages[0]["role"] == "system":
            return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
        return [{"role": "system", "content": text}, *messages]

    def tool_message(self, name: str, content: str) -> dict:
        if self.tool_role == "tool":
            return {"role": "tool", "name": name, "content": content}
        return {"role": "user", "content": f"Tool result ({name}): {content}"}

    # -- tokens ------------------------------------------------------------------------------
    def _ids(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """The first generation prompt (`start(messages)` rendered, tools declared)."""
        return self._ids(self._render(messages, True))

    def context_text(self, new_messages: list[dict]) -> str:
        """The template's text after an assistant turn's end-of-turn, through `new_messages` and
        the next generation prompt."""
        eot = self.contract.end_of_turn
        head = self._render(_STAND_IN, False)
        cut = head.find("A" + eot)
        if cut < 0:
            raise UserError(f"the chat template does not end an assistant turn with the end-of-turn token {eot!r}; "
                            "multi-turn episodes need one (set data.chat_template)")
        cut += 1 + len(eot)
        full = self._render([*_STAND_IN, *new_messages], True)
        if not full.startswith(head[:cut]):
            raise UserError("the chat template renders an earlier assistant turn differently once more messages "
                            "follow it; the episode's turns cannot be joined (set data.chat_template)")
        return full[cut:]

    def context_ids(self, new_messages: list[dict]) -> list[int]:
        return self._ids(self.context_text(new_messages))

    def answer_ids(self, text: str) -> list[int]:
        """A scripted assistant turn's tokens (demonstrations, the preview), end-of-turn included."""
        return self._ids(text) + [self.contract.end_of_turn_id]

    # -- the contract across turns -----------------------------------------------------------
    def check(self) -> str | None:
        """UserError when an assistant turn would end with anything but the contract's
        end-of-turn; a note (str) when the whole-conversation rendering differs from the
        turn-by-turn tokens only in how earlier turns are re-rendered; None when they agree."""
        first = self.start([{"role": "user", "content": "What is 2 + 3?"}])
        call = self.format.render(tool_fmt.ToolCall(self.schemas[0]["function"]["name"], {}))
        result = self.tool_message(self.schemas[0]["function"]["name"], "5")
        answer = "The answer is five."
        convo = [*first, {"role": "assistant", "content": call}, result, {"role": "assistant", "content": answer}]
        prompt = self.prompt_ids(first)
        ids = prompt + self.answer_ids(call) + self.context_ids([result]) + self.answer_ids(answer)
        whole = self._ids(self._render(convo, False))
        eot, at = self.contract.end_of_turn_id, len(prompt)
        for text in (call, answer):  # every assistant turn in the whole rendering ends with end-of-turn
            piece = self._ids(text)
            found = _find(whole, piece, at)
            if found < 0:
                continue  # the template rewrote the turn; the comparison below reports it
            at = found + len(piece)
            if at >= len(whole) or whole[at] != eot:
                after = self.tok.convert_ids_to_tokens(whole[at]) if at < len(whole) else "nothing"
                raise UserError(f"the chat template ends an assistant turn with {after!r}, not the end-of-turn token "
                                f"{self.contract.end_of_turn!r} generation stops on; set data.chat_template")
        if whole[: len(ids)] == ids:
            return None
        if self.tok.decode(whole).startswith(self.tok.decode(ids)):
            return ("the conversation's text tokenises differently at turn boundaries when tokenised whole; episodes "
                    "keep the tokens generation was given and produced")
        return ("the chat template renders earlier turns differently in a whole conversation than turn by turn "
                "(e.g. it strips reasoning); episodes are trained on the tokens as they were sampled")


def _find(seq: list[int], piece: list[int], start: int = 0) -> int:
    for i in range(start, len(seq) - len(piece) + 1):
        if seq[i:i + len(piece)] == piece:
            return i
    return -1

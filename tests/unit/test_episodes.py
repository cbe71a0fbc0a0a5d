"""Multi-turn episodes: the tokens turn by turn, which of them the policy sampled, the chat
contract across turns, episodes cut at env.max_turns, ranks that run out of episodes early.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q tests/unit/test_episodes.py

A scripted policy stands in for the model (a `sample` that returns the tokens of given texts),
so every token of an episode is known in advance and is checked one by one.
"""

from __future__ import annotations

import copy

import pytest

from tests.conftest import compose
from workbench.core.errors import UserError
from workbench.data.chat import IGNORE, setup_tokenizer
from workbench.envs.base import Reply, ToolEnv, check_node
from workbench.envs.registry import load
from workbench.envs.tools import ToolCall
from workbench.models.load import load_tokenizer
from workbench.rollout import episodes
from workbench.rollout.turns import Turns

QUESTION = [{"role": "user", "content": "What is 347 + 589? Answer with the number only."}]
ROW = {"prompt": QUESTION, "answer": "936"}

# Qwen2.5's tool template in its essentials: tools in the system prompt, tool results as
# <tool_response> blocks inside a user turn, ChatML turns
QWEN = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen.' }}{%- endif %}{{- '\\n\\n# Tools\\n\\n<tools>' }}{%- for tool in tools %}"
    "{{- '\\n' }}{{- tool | tojson }}{%- endfor %}{{- '\\n</tools>\\n\\nFor each function call, return a json object "
    "within <tool_call></tool_call> XML tags.<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}{%- if message.role == 'user' or (message.role == 'system' and not loop.first)"
    " or message.role == 'assistant' %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}"
    "{{- '<|im_start|>user' }}{%- endif %}{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama 3.1's in its essentials: header tokens, tools in the first user turn, results as ipython turns
LLAMA3 = (
    "{%- if messages[0]['role'] == 'system' %}{%- set sys = messages[0]['content'] %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set sys = '' %}{%- endif %}{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + sys + '<|eot_id|>' }}"
    "{%- if tools is not none and messages|length > 0 %}{{- '<|start_header_id|>user<|end_header_id|>\\n\\nRespond with "
    "{\"name\": function name, \"parameters\": dictionary of arguments}.\\n\\n' }}{%- for t in tools %}"
    "{{- t | tojson }}{{- '\\n\\n' }}{%- endfor %}{{- messages[0]['content'] + '<|eot_id|>' }}{%- set messages = messages[1:] %}"
    "{%- endif %}{%- for message in messages %}{%- if message.role == 'tool' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}{%- else %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
LLAMA_SPECIALS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]


@pytest.fixture(scope="module")
def smol():
    tok = load_tokenizer(compose().model)
    return tok, setup_tokenizer(tok)


def with_template(smol, template: str, specials=()):
    tok = copy.deepcopy(smol[0])
    if specials:
        tok.add_special_tokens({"additional_special_tokens": list(specials)})
    tok.chat_template = template
    return tok, setup_tokenizer(tok)


def calc_env(max_turns: int = 4):
    return load({"name": "calc", "max_turns": max_turns, "max_new_tokens": 64})


def scripted(tok, texts: list[str], calls: list | None = None):
    """A policy that writes `texts` in order, one per call (one running episode)."""
    script = list(texts)

    def sample(prompts, first):
        if calls is not None:
            calls.append([list(p) for p in prompts])
        return [tok(script.pop(0), add_special_tokens=False)["input_ids"] for _ in prompts]

    return sample


def trained_spans(ep) -> list[list[int]]:
    spans, cur = [], []
    for t, y in zip(ep.ids, ep.labels):
        if y != IGNORE:
            assert y == t  # a trained label is the token itself
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    return spans + ([cur] if cur else [])


# -- masks: a 3-turn episode, token by token ------------------------------------------------------
def test_three_turn_episode_masks_token_by_token(smol):
    tok, contract = smol
    env = calc_env()
    turns = Turns(tok, contract, env.tools)
    t1 = turns.format.render(ToolCall("calc", {"expression": "347 +"}))  # a bad expression: the tool answers an error
    t2 = turns.format.render(ToolCall("calc", {"expression": "347 + 589"}))
    t3 = "936"
    seen: list = []
    ep = episodes.run(env, turns, [ROW], scripted(tok, [t1, t2, t3], seen), max_new_tokens=64)[0]
    eot = contract.end_of_turn_id
    sampled = [tok(t, add_special_tokens=False)["input_ids"] + [eot] for t in (t1, t2, t3)]

    # the sequence is the prompt, then each sampled turn (with its end-of-turn), then the context
    # the template writes after it: exactly what the three generate calls were given
    prompt = turns.prompt_ids(turns.start(QUESTION))
    err = turns.context_ids([turns.tool_message("calc", "error: cannot parse '347 +'")])
    res = turns.context_ids([turns.tool_message("calc", "936")])
    expected = prompt + sampled[0] + err + sampled[1] + res + sampled[2]
    assert ep.ids == expected
    mask = [False] * len(prompt) + [True] * len(sampled[0]) + [False] * len(err) + [True] * len(sampled[1]) \
        + [False] * len(res) + [True] * len(sampled[2])
    assert [y != IGNORE for y in ep.labels] == mask
    assert seen == [[prompt], [prompt + sampled[0] + err], [prompt + sampled[0] + err + sampled[1] + res]]

    # decoded: the trained spans are the three turns, each closed by the contract's end-of-turn;
    # every context token (system prompt, question, tool results, headers) is untrained
    spans = trained_spans(ep)
    assert [tok.decode(s) for s in spans] == [t + "<|im_end|>" for t in (t1, t2, t3)]
    context = tok.decode([t for t, y in zip(ep.ids, ep.labels) if y == IGNORE])
    assert "What is 347 + 589?" in context and "error: cannot parse" in context and "<|im_start|>tool\n936" in context
    assert "<tool_call>" not in context.split("<|im_start|>user")[1]  # no call the model wrote is context
    assert ep.spans == [(len(prompt), len(prompt) + len(sampled[0])),
                        (len(prompt) + len(sampled[0]) + len(err), len(prompt) + len(sampled[0]) + len(err) + len(sampled[1])),
                        (len(expected) - len(sampled[2]), len(expected))]
    # the environment's view: two calls (one an error), then the final answer after a tool result
    assert (ep.turns, ep.tool_calls, ep.tool_errors, ep.cut, ep.final, ep.after_tool) == (3, 2, 1, None, "936", True)
    assert env.correct(ep.state, ep.messages)
    assert [m["role"] for m in ep.messages] == ["system", "user", "assistant", "tool", "assistant", "tool", "assistant"]


def test_whole_rendering_equals_turn_by_turn_tokens(smol):
    """The tokens of an episode are the template's rendering of its conversation, tokenised whole."""
    tok, contract = smol
    env = calc_env()
    turns = Turns(tok, contract, env.tools)
    t1 = turns.format.render(ToolCall("calc", {"expression": "47 * 86"}))
    ep = episodes.run(env, turns, [ROW], scripted(tok, [t1, "4042"]), max_new_tokens=64)[0]
    plain = [{k: m[k] for k in ("role", "content")} for m in ep.messages]
    whole = tok(tok.apply_chat_template(plain, tokenize=False), add_special_tokens=False)["input_ids"]
    assert whole[: len(ep.ids)] == ep.ids and tok.decode(whole[len(ep.ids):]) == "\n"  # the template's trailing newline


# -- cut at max_turns, and at max_new_tokens ------------------------------------------------------
def test_episode_cut_at_max_turns(smol):
    tok, contract = smol
    env = calc_env(max_turns=2)
    turns = Turns(tok, contract, env.tools)
    call = turns.format.render(ToolCall("calc", {"expression": "1 + 1"}))
    seen: list = []
    ep = episodes.run(env, turns, [ROW], scripted(tok, [call, call, call], seen), max_new_tokens=64)[0]
    assert len(seen) == 2 and (ep.turns, ep.cut, ep.done, ep.final) == (2, "max_turns", True, None)
    # the second call's result would come after the last turn: it is not appended, the episode
    # ends on the sampled end-of-turn
    assert ep.ids[-1] == contract.end_of_turn_id and ep.labels[-1] == contract.end_of_turn_id
    assert [m["role"] for m in ep.messages][-3:] == ["assistant", "tool", "assistant"]
    assert len(trained_spans(ep)) == 2


def test_turn_cut_at_max_new_tokens_ends_the_episode_without_end_of_turn(smol):
    tok, contract = smol
    env = calc_env()
    turns = Turns(tok, contract, env.tools)
    long = "1 2 3 4 5 6 7 8 9"
    n = len(tok(long, add_special_tokens=False)["input_ids"])
    ep = episodes.run(env, turns, [ROW], scripted(tok, [long]), max_new_tokens=n)[0]
    assert ep.cut == "max_new_tokens" and ep.final is None and ep.sampled == n
    assert contract.end_of_turn_id not in ep.ids[ep.prompt_len:]  # it never ended: no end-of-turn is trained


def test_ranks_that_finish_early_keep_joining_the_turns(smol, monkeypatch):
    """Under sharded weights a rank whose episodes have ended still generates (for a stand-in)
    while another rank's episodes run, so both make the same generate calls."""
    tok, contract = smol
    env = calc_env(max_turns=3)
    turns = Turns(tok, contract, env.tools)
    monkeypatch.setattr(episodes, "all_max", lambda n: max(n, 1))  # the other rank always has one running
    seen: list = []
    eps = episodes.run(env, turns, [ROW], scripted(tok, ["936", "x", "y"], seen), max_new_tokens=64, synced=True)
    assert eps[0].turns == 1 and len(seen) == 3  # one real turn, then two stand-in turns
    assert seen[1] == seen[2] == [eps[0].ids[:eps[0].prompt_len]]


# -- the chat contract across turns, other template families -------------------------------------
def test_qwen_style_template_declares_tools_and_wraps_results(smol):
    tok, contract = with_template(smol, QWEN)
    env = calc_env()
    turns = Turns(tok, contract, env.tools)
    assert (turns.native_tools, turns.tool_role, turns.format.family, turns.check()) == (True, "tool", "hermes", None)
    call = '<tool_call>\n{"name": "calc", "arguments": {"expression": "347 + 589"}}\n</tool_call>'
    ep = episodes.run(env, turns, [ROW], scripted(tok, [call, "936"]), max_new_tokens=64)[0]
    assert ep.final == "936" and ep.tool_calls == 1
    assert [tok.decode(s) for s in trained_spans(ep)] == [call + "<|im_end|>", "936<|im_end|>"]
    context = tok.decode(ep.ids)
    assert '"name": "calc"' in context.split("</tools>")[0]  # the template declared the tool itself
    assert "<|im_start|>user\n<tool_response>\n936\n</tool_response><|im_end|>\n<|im_start|>assistant\n" in context


def test_llama3_style_template_bare_json_calls(smol):
    tok, contract = with_template(smol, LLAMA3, LLAMA_SPECIALS)
    assert contract.end_of_turn == "<|eot_id|>"
    env = calc_env()
    turns = Turns(tok, contract, env.tools)
    assert (turns.native_tools, turns.tool_role, turns.format.family) == (True, "tool", "llama3")
    # SmolLM2's byte-level BPE merges "\n\n{" across the header/turn boundary when the whole text
    # is tokenised at once (Llama 3's own tokenizer splits newlines apart): same text, other tokens
    assert "tokenises differently at turn boundaries" in turns.check()
    call = '{"name": "calc", "parameters": {"expression": "347 + 589"}}'
    ep = episodes.run(env, turns, [ROW], scripted(tok, [call, "936"]), max_new_tokens=64)[0]
    assert ep.final == "936" and ep.after_tool
    assert [tok.decode(s) for s in trained_spans(ep)] == [call + "<|eot_id|>", "936<|eot_id|>"]
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n936<|eot_id|><|start_header_id|>assistant" in tok.decode(ep.ids)


def test_template_ending_tool_call_turns_with_another_token_is_refused(smol):
    """A template that closes tool-call turns with <|eom_id|> while generation stops on <|eot_id|>
    would train a stop token the served model never emits."""
    eom = LLAMA3.replace("{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + "
                         "'<|eot_id|>' }}",
                         "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim }}"
                         "{%- if message.content.startswith('{') %}{{- '<|eom_id|>' }}{%- else %}{{- '<|eot_id|>' }}"
                         "{%- endif %}")
    assert eom != LLAMA3
    tok, contract = with_template(smol, eom, LLAMA_SPECIALS)
    with pytest.raises(UserError, match="ends an assistant turn with '<\\|eom_id\\|>'"):
        Turns(tok, contract, calc_env().tools).check()


def test_template_without_tool_role_gets_results_as_user_messages(smol):
    strict = ("{%- for m in messages %}{%- if m.role not in ['system', 'user', 'assistant'] %}"
              "{{ raise_exception('roles must be user/assistant') }}{%- endif %}"
              "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endfor %}"
              "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    tok, contract = with_template(smol, strict)
    turns = Turns(tok, contract, calc_env().tools)
    assert turns.tool_role == "user" and turns.check() is None
    assert turns.tool_message("calc", "936") == {"role": "user", "content": "Tool result (calc): 936"}
    assert turns.context_text([turns.tool_message("calc", "936")]) == \
        "\n<|im_start|>user\nTool result (calc): 936<|im_end|>\n<|im_start|>assistant\n"


def test_template_that_rewrites_earlier_turns_gets_a_note(smol):
    """Qwen3-style: earlier assistant turns lose their reasoning in a whole rendering. The episode
    keeps the tokens as sampled; check() says so instead of failing."""
    strip = ("{%- for m in messages %}{%- set c = m.content %}{%- if m.role == 'assistant' and not loop.last %}"
             "{%- set c = c.split('</think>')[-1] %}{%- endif %}{{- '<|im_start|>' + m.role + '\\n' + c + '<|im_end|>\\n' }}"
             "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
    tok, contract = with_template(smol, strip)
    turns = Turns(tok, contract, calc_env().tools)
    assert turns.check() is None  # the probe has no reasoning to strip
    think = "<think>add them</think>" + turns.format.render(ToolCall("calc", {"expression": "347 + 589"}))
    ep = episodes.run(calc_env(), turns, [ROW], scripted(tok, [think, "936"]), max_new_tokens=64)[0]
    assert tok.decode(trained_spans(ep)[0]) == think + "<|im_end|>"  # trained as sampled, reasoning kept


# -- environments ---------------------------------------------------------------------------------
class TalkEnv(ToolEnv):
    """Answers the first turn with a user message, then ends with its own reward."""

    TOOLS = calc_env().TOOLS

    def step(self, state, turn):
        if len(turn.conversation) < 5:
            return Reply(messages=[{"role": "user", "content": "Are you sure?"}])
        return Reply(done=True, reward=0.5)


def test_user_messages_and_environment_rewards(smol):
    tok, contract = smol
    env = TalkEnv(check_node({"name": "talk", "max_turns": 4}))
    turns = Turns(tok, contract, env.tools)
    ep = episodes.run(env, turns, [ROW], scripted(tok, ["936", "Yes, 936"]), max_new_tokens=64)[0]
    assert ep.reward == 0.5 and ep.turns == 2 and not ep.after_tool
    assert "<|im_start|>user\nAre you sure?<|im_end|>" in tok.decode([t for t, y in zip(ep.ids, ep.labels) if y == IGNORE])


def test_env_node_fields_are_checked():
    with pytest.raises(UserError, match="env.max_turns must be >= 1"):
        check_node({"name": "calc", "max_turns": 0})
    with pytest.raises(UserError, match="env.max_new_tokens: expected int"):
        check_node({"name": "calc", "max_new_tokens": "many"})
    with pytest.raises(UserError, match="env.tool_format='xml'"):
        check_node({"name": "calc", "tool_format": "xml"})
    with pytest.raises(UserError, match="unknown environment"):
        load({"name": "chess"})

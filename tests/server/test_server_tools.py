"""Tool calls and chat messages as an OpenAI client sends them (issue 44, items 1-3).

The forms the parser reads, table by table; the forced call's grammar on a tokenizer that makes
``<tool_call>`` one token (as Qwen2.5's does: a byte-level tiny model hides that); the default
pair through a live server: a forced call that validates, streamed == non-streamed, identical
under every method, and ``auto`` calls parsed from the fenced JSON the model writes; the
``developer`` role as ``system``; messages the server must refuse by name.
"""

from __future__ import annotations

import json

import httpx
import pytest
from tokenizers import AddedToken

from server_support import build_tokenizer, http, reference, served
from verispec.engine.constraints import GrammarCompiler, TokenConstraints
from verispec.server import protocol, tools
from verispec.server.schemas import ChatCompletionRequest, Tool
from verispec.server.tool_parser import ToolCallStream, parse_tool_calls

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOLS = [Tool.model_validate(WEATHER)]
PARIS = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'

PARSED = [
    # (model text, content, calls (name and arguments))
    (f"<tool_call>\n{CALL}\n</tool_call>", None, [PARIS]),  # Qwen2.5's own format
    (f"<tool_call>\n{CALL}", None, [PARIS]),  # the closing tag cut by a stop string
    (f"```json\n{CALL}\n```", None, [PARIS]),  # what Qwen2.5-Coder answers to tool_choice "auto"
    (f"Checking.\n```json\n{CALL}\n```\nOne moment.", "Checking.\nOne moment.", [PARIS]),  # text around it
    (f"```\n{CALL}\n```", None, [PARIS]),  # a fence without its language
    ("{" + CALL + "}", None, [PARIS]),  # doubled braces, copied from the template's instruction
    (CALL, None, [PARIS]),  # the bare object as the whole answer
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),  # "parameters" for "arguments"
    ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}', None, [PARIS]),  # arguments as JSON text
    ('{"name": "get_weather", "arguments": {"town": "Paris"}}', None, []),  # arguments fail the schema
    ('{"name": "get_time", "arguments": {}}', None, []),  # not a declared tool
    (f"Call it like this: {CALL}", None, []),  # a bare object inside prose is text
    ("```python\nprint(1)\n```", None, []),  # code is text
    ("Hello <b>there</b>", None, []),  # a "<" that is no tag
]


@pytest.mark.parametrize("text, content, calls", PARSED)
def test_the_forms_the_model_writes_are_parsed(text, content, calls):
    got_content, got_calls = parse_tool_calls(text, TOOLS)
    assert [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in got_calls] == calls
    assert got_content == (content if calls else text)  # without a call the answer is untouched
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got_calls)


@pytest.mark.parametrize("text", [case[0] for case in PARSED])
@pytest.mark.parametrize("size", [1, 3, 7])
def test_streamed_content_adds_up_to_the_whole_answer_whatever_the_chunks(text, size):
    stream = ToolCallStream(TOOLS)
    sent = "".join(stream.feed(text[i : i + size]) for i in range(0, len(text), size))
    tail, calls = stream.finish()
    content, whole = parse_tool_calls(text, TOOLS)
    assert (sent + tail or None) == content
    assert [c["function"] for c in calls] == [c["function"] for c in whole]


def test_text_streams_until_it_may_be_a_call():
    stream = ToolCallStream(TOOLS)
    assert stream.feed("The weather ") == "The weather"  # trailing space waits for what follows
    assert stream.feed("is fine.\n<tool") == " is fine."  # may become <tool_call>: held
    assert stream.feed("_call>\n" + CALL) == ""
    assert stream.finish()[0] == ""


# ----- item 1: the forced call's grammar on a tokenizer with <tool_call> as one token -----


def test_a_forced_call_can_be_written_where_the_tag_is_one_token():
    tokenizer = build_tokenizer()
    tokenizer.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in ("<tool_call>", "</tool_call>")])
    open_id, close_id = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    answer = tokenizer.encode(f"<tool_call>\n{CALL}\n</tool_call>", add_special_tokens=False)
    assert answer[0] == open_id and answer[-1] == close_id  # what the model writes: the tags as tokens
    grammar = tools.forced_call_grammar(TOOLS, None, tokenizer)
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    constraints = TokenConstraints(len(tokenizer), [tokenizer.eos_token_id], matcher=compiler.matcher(grammar))
    for step, token in enumerate(answer):  # before the fix: <tool_call> allowed, never consumed, allowed again
        assert constraints.masks(step)[0, token], f"token {step} ({tokenizer.decode([token])!r}) refused"
        constraints.commit([token])
    assert constraints.matcher.is_accepting()
    only_end = constraints.masks(len(answer))[0].nonzero().flatten().tolist()
    assert only_end == [tokenizer.eos_token_id]  # the call is complete: the turn ends


# ----- item 3: messages (tiny pair) -----

MODEL = "tiny-target"


def _chat(http, messages, **body):
    return http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 2, **body})


def test_developer_is_the_system_instruction(reference):
    pipeline = reference
    as_system = ChatCompletionRequest.model_validate(
        {
            "model": MODEL,
            "messages": [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hi"}],
        }
    )
    as_developer = as_system.model_copy(
        update={"messages": [as_system.messages[0].model_copy(update={"role": "developer"}), as_system.messages[1]]}
    )
    assert protocol.chat_prompt_ids(pipeline, as_developer) == protocol.chat_prompt_ids(pipeline, as_system)


BAD_MESSAGES = [
    # (messages, param, words the message must hold)
    ([{"role": "system", "content": "x"}, {"role": "user"}], "messages[1].content", "messages[1].content is missing"),
    ([{"role": "assistant"}], "messages[0].content", "content or tool_calls"),  # neither content nor calls
    (
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}],
        "messages",
        "only text content parts are supported",
    ),
]


@pytest.mark.parametrize("messages, param, words", BAD_MESSAGES)
def test_messages_the_server_refuses_by_name(http, messages, param, words):
    response = _chat(http, messages)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_json_body_without_content_type_is_read_as_json(served):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    response = httpx.post(f"{served.url}/v1/chat/completions", content=body.encode(), headers={"content-type": ""})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 2


# ----- the default pair through a live server (items 1-3 as a user meets them) -----

REAL_MESSAGES = [{"role": "user", "content": "What's the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
DEFAULT_MODEL = "qwen2.5-coder-1.5b-instruct"
PARIS_CALL = ("tool_calls", None, [("get_weather", '{"city": "Paris"}')])  # what every answer must be


@pytest.fixture(scope="module")
def real_server():
    from server_support import LiveServer, wait_ready
    from verispec.engine.loader import DEFAULT_DRAFT, DEFAULT_TARGET, SpeculativePipeline
    from verispec.models.store import ModelStore
    from verispec.server import create_app

    store = ModelStore()
    missing = [name for name in (DEFAULT_TARGET, DEFAULT_DRAFT) if store.cache_state(name) == "missing"]
    if missing:
        pytest.skip(f"not in the model cache: {', '.join(missing)} (verispec models fetch NAME)")
    pipeline = SpeculativePipeline.load(DEFAULT_TARGET, DEFAULT_DRAFT)
    with LiveServer(create_app(pipeline, max_tokens_cap=60)) as server:
        wait_ready(server.url, timeout_s=300)
        server.pipeline = pipeline
        yield server


def _real_answer(server, method: str, stream: bool, **body) -> tuple:
    """``(finish_reason, content, [(name, arguments)])`` of one greedy chat answer, streamed or not."""
    payload = {
        "model": DEFAULT_MODEL,
        "messages": REAL_MESSAGES,
        "temperature": 0,
        "max_tokens": 60,
        "speculative": {"method": method},
        "stream": stream,
        **body,
    }
    if not stream:
        response = httpx.post(f"{server.url}/v1/chat/completions", json=payload, timeout=300).json()
        message = response["choices"][0]["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
        return response["choices"][0]["finish_reason"], message["content"], calls
    content, calls, finish = "", {}, None
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=payload, timeout=300) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[len("data: ") :])["choices"]:
                content += choice["delta"].get("content") or ""
                for delta in choice["delta"].get("tool_calls") or []:  # deltas add up, by index
                    name, arguments = calls.get(delta["index"], ("", ""))
                    function = delta["function"]
                    calls[delta["index"]] = (
                        name + (function.get("name") or ""),
                        arguments + (function.get("arguments") or ""),
                    )
                finish = choice["finish_reason"] or finish
    return finish, content or None, [calls[i] for i in sorted(calls)]


@pytest.mark.real_model
@pytest.mark.parametrize("tool_choice", ["required", NAMED, "auto"])
def test_real_pair_calls_the_tool_identically_under_every_method(real_server, tool_choice):
    # Before: "required" and a named tool gave <tool_call> repeated to max_tokens; "auto" a fenced
    # JSON block left in content.
    for method in ("none", "draft", "auto"):
        for stream in (False, True):
            got = _real_answer(real_server, method, stream, tools=[WEATHER], tool_choice=tool_choice)
            assert got == PARIS_CALL, (method, stream, got)


@pytest.mark.real_model
def test_real_pair_developer_is_the_system_instruction(real_server):
    def ids(role):
        body = ChatCompletionRequest.model_validate(
            {
                "model": DEFAULT_MODEL,
                "messages": [{"role": role, "content": "Answer in French."}, {"role": "user", "content": "Hello"}],
            }
        )
        return protocol.chat_prompt_ids(real_server.pipeline, body)

    assert ids("developer") == ids("system") and len(ids("system")) == 18  # before: 30 tokens, the instruction dropped

"""The library's conversation API (issue 54, item 3): ``SpeculativePipeline.chat(messages, params,
spec, tools)`` and ``stream_chat`` render a conversation (system prompt, several turns, tools, tool
calls and results) through the server's template code: the same prompt ids as
``/v1/chat/completions``, and the same answer."""

from __future__ import annotations

import httpx
import pytest

from server_support import CHAT_TEMPLATE, LiveServer, build_tokenizer, tiny_pipeline, wait_ready
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.errors import InvalidParameterError
from verispec.models.conversation import ConversationError, conversation_ids
from verispec.server import create_app
from verispec.server.protocol import chat_prompt_ids
from verispec.server.schemas import ChatCompletionRequest

# the test template also renders the tool definitions and an assistant's tool calls (arguments as JSON)
TEMPLATE = (
    "{% if tools %}<|im_start|>system\ntools: {{ tools | map(attribute='function') | map(attribute='name') "
    "| join(',') }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<call>{{ c.function.name }} {{ c.function.arguments | tojson }}</call>"
    "{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}},
}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}

CONVERSATIONS = [
    # (messages, tools, the rendered prompt)
    (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        None,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    ),
    (  # several turns; developer is OpenAI's system; text parts are joined
        [
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "你"}, {"type": "text", "text": "好"}]},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Again"},
        ],
        None,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n你好<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\n",
    ),
    (  # tools, an assistant's call (its arguments parsed from their JSON text) and the tool's answer
        [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        [WEATHER],
        "<|im_start|>system\ntools: get_weather<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n"
        '<|im_start|>assistant\n<call>get_weather {"city": "Paris"}</call><|im_end|>\n'
        "<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n",
    ),
]
GREEDY = SamplingParams(max_tokens=12)
DRAFT = SpeculativeConfig(method="draft", num_speculative_tokens=4)


@pytest.fixture(scope="module")
def pipe():
    pipeline = tiny_pipeline()
    pipeline.tokenizer.chat_template = TEMPLATE  # its own tokenizer object: no other test sees it
    return pipeline


@pytest.fixture(scope="module")
def server(pipe):
    with LiveServer(create_app(pipe)) as live:
        wait_ready(live.url)
        yield live


@pytest.mark.parametrize("messages, tools, rendered", CONVERSATIONS)
def test_a_conversation_renders_as_the_server_renders_it(pipe, messages, tools, rendered):
    ids = pipe.encode_chat(messages, tools)
    assert pipe.tokenizer.decode(ids) == rendered
    body = ChatCompletionRequest(model="tiny-target", messages=messages, tools=tools)
    assert ids == chat_prompt_ids(pipe, body)


@pytest.mark.parametrize("messages, tools, rendered", CONVERSATIONS)
def test_chat_answers_as_the_server_does(pipe, server, messages, tools, rendered):
    out = pipe.chat(messages, GREEDY, DRAFT, tools)
    body = {"model": "tiny-target", "messages": messages, "max_tokens": 12, "temperature": 0}
    if tools:
        body["tools"] = tools
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60).json()
    assert response["choices"][0]["message"]["content"] == out.text and out.text
    assert response["usage"]["prompt_tokens"] == len(pipe.tokenizer(rendered, add_special_tokens=False).input_ids)
    assert out.token_ids == pipe.chat(messages, GREEDY, SpeculativeConfig(method="none"), tools).token_ids  # exact


def test_stream_chat_gives_the_chat_text_in_chunks(pipe):
    messages = CONVERSATIONS[1][0]
    chunks = list(pipe.stream_chat(messages, GREEDY, DRAFT))
    whole = pipe.chat(messages, GREEDY, DRAFT)
    assert "".join(chunk.text for chunk in chunks) == whole.text
    assert chunks[-1].output.token_ids == whole.token_ids and len(chunks) > 1


@pytest.mark.parametrize(
    "messages, param, message",
    [
        ([], "messages", "messages is empty"),
        ([{"role": "robot", "content": "x"}], "messages[0].role", "messages[0].role must be one of system, developer"),
        (
            [{"role": "user", "content": "x"}, {"role": "user"}],
            "messages[1].content",
            "messages[1].content is missing: a user message needs content",
        ),
        ([{"role": "assistant"}], "messages[0].content", "an assistant message needs content or tool_calls"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
            "messages[0].content",
            "messages[0].content[0] is not a text part",
        ),
    ],
)
def test_a_conversation_that_cannot_render_is_named(pipe, messages, param, message):
    with pytest.raises(ConversationError, match=message.replace("[", r"\[").replace("]", r"\]")) as caught:
        pipe.chat(messages, GREEDY)
    assert caught.value.param == param and isinstance(caught.value, InvalidParameterError)


def test_a_model_without_a_chat_template_is_named():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = None
    with pytest.raises(ConversationError, match="base-model has no chat template"):
        conversation_ids(tokenizer, "base-model", [{"role": "user", "content": "x"}])
    tokenizer.chat_template = CHAT_TEMPLATE
    assert tokenizer.decode(conversation_ids(tokenizer, "m", [{"role": "user", "content": "x"}])) == (
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    )

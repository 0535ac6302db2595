"""Pure wire-format tests: request parsing, validation, response and SSE shapes."""

from __future__ import annotations

import json

import pytest

from butter.chat.request import Timings, Usage
from butter.errors import InvalidRequest, Overloaded
from butter.protocol import openai
from butter.protocol.sse import DONE, data_event, named_event
from butter.sampling import DEFAULT_TEMPERATURE, DEFAULT_TOP_K, SamplingParams

USER = {"role": "user", "content": "hi"}


def test_minimal_request_and_defaults() -> None:
    request = openai.parse_chat_request({"messages": [USER]})
    assert request.model is None
    assert request.stream is False
    params = openai.sampling_params(request)
    assert params.temperature == DEFAULT_TEMPERATURE
    assert params.top_k == DEFAULT_TOP_K


def test_client_values_override_defaults_and_unknown_fields_are_ignored() -> None:
    request = openai.parse_chat_request({
        "messages": [USER], "temperature": 0, "top_p": 0.5, "seed": 7, "max_tokens": 3,
        "stop": "END", "stream": True, "stream_options": {"include_usage": True},
        "vendor_extension": {"anything": [1, 2]},
    })
    params = openai.sampling_params(request)
    assert (params.temperature, params.top_p, params.seed) == (0.0, 0.5, 7)
    assert params.greedy
    assert request.requested_max_tokens == 3
    assert request.stop_strings == ("END",)
    assert request.include_usage


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    request = openai.parse_chat_request(
        {"messages": [USER], "max_tokens": 10, "max_completion_tokens": 4}
    )
    assert request.requested_max_tokens == 4


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"messages": []}, "messages"),
        ({}, "messages"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [USER], "max_tokens": "5"}, "max_tokens"),
        ({"messages": [USER], "max_tokens": 2.5}, "max_tokens"),
        ({"messages": [USER], "max_tokens": 0}, "max_tokens"),
        ({"messages": [USER], "max_tokens": True}, "max_tokens"),
        ({"messages": [USER], "temperature": -1}, "temperature"),
        ({"messages": [USER], "top_p": 1.5}, "top_p"),
        ({"messages": [USER], "seed": -3}, "seed"),
        ({"messages": [USER], "n": 17}, "n"),
        ({"messages": [USER], "n": 0}, "n"),
        ({"messages": [USER], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": [USER], "top_logprobs": 2}, "top_logprobs"),
        ({"messages": [USER], "logit_bias": {"x": 1}}, "logit_bias"),
        ({"messages": [USER], "logit_bias": {"5": -101}}, "logit_bias"),
        ({"messages": [USER], "stop": 5}, "stop"),
        ({"messages": [USER], "stream": "yes"}, "stream"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0].image_url"),
    ],
)
def test_bad_requests_name_the_field(payload: object, param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        openai.parse_chat_request(payload)
    assert caught.value.param == param
    body = caught.value.openai_body()["error"]
    assert body["type"] == "invalid_request_error"
    assert body["message"]


def test_non_object_body_is_rejected() -> None:
    with pytest.raises(InvalidRequest, match="JSON object"):
        openai.parse_chat_request([USER])


def test_template_messages_join_text_parts_and_parse_tool_arguments() -> None:
    request = openai.parse_chat_request({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]})
    messages = openai.template_messages(request)
    assert messages[0]["content"] == "ab"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert messages[2]["tool_call_id"] == "call_1"


def test_usage_reports_cached_tokens_in_both_places() -> None:
    body = openai.usage_body(Usage(prompt_tokens=10, completion_tokens=5, cached_tokens=9))
    assert body["total_tokens"] == 15
    assert body["cached_tokens"] == body["prompt_tokens_details"]["cached_tokens"] == 9


def test_chunk_and_usage_chunk_shapes() -> None:
    chunk = openai.chunk_body(completion_id="c", model="m", created=1,
                              delta={"content": "x"}, finish_reason=None)
    assert chunk["object"] == "chat.completion.chunk"
    assert chunk["choices"][0]["delta"] == {"content": "x"}
    usage = openai.usage_chunk_body(completion_id="c", model="m", created=1,
                                    usage=Usage(1, 2, 0))
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2


def test_sse_framing() -> None:
    assert data_event({"a": "é"}) == 'data: {"a":"é"}\n\n'.encode()
    assert named_event("ping", {}) == b"event: ping\ndata: {}\n\n"
    assert DONE == b"data: [DONE]\n\n"
    frame = data_event({"text": "line1\nline2"})
    assert frame.count(b"\n") == 2  # newlines inside JSON strings are escaped
    assert json.loads(frame[len(b"data: "):].decode()) == {"text": "line1\nline2"}


def test_overloaded_carries_retry_after() -> None:
    error = Overloaded("busy", retry_after=3)
    assert error.status == 503
    assert error.headers() == {"Retry-After": "3"}
    assert error.anthropic_body()["error"]["type"] == "overloaded_error"


def test_sampling_params_random_seed_differs() -> None:
    assert len({SamplingParams().seed for _ in range(5)}) > 1


def test_logit_bias_minus_100_bans_and_developer_is_system() -> None:
    request = openai.parse_chat_request({
        "messages": [{"role": "developer", "content": "Be brief."}, USER],
        "logit_bias": {"5": -100, "7": 2.5}, "logprobs": True, "top_logprobs": 3, "n": 2})
    generation = openai.generation_request(request)
    assert generation.sampling.logit_bias == ((5, float("-inf")), (7, 2.5))
    assert generation.sampling.logprobs == 3 and generation.n == 2
    assert openai.template_messages(request)[0]["role"] == "system"
    # Not asked: nothing to compute.
    assert openai.generation_request(openai.parse_chat_request(
        {"messages": [USER]})).sampling.logprobs is None


@pytest.mark.parametrize(("fields", "param"), [
    ({"add_generation_prompt": True, "continue_final_message": True},
     "continue_final_message"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
    ({"timings_per_token": 1}, "timings_per_token"),
    ({"verbose": "true"}, "verbose"),
])
def test_llama_servers_fields_are_checked(fields: dict[str, object], param: str) -> None:
    """add_generation_prompt and continue_final_message may not both be true;
    continue_final_message needs a final assistant message; the flags are booleans."""
    with pytest.raises(InvalidRequest) as refused:
        openai.parse_chat_request({"messages": [USER], **fields})
    assert refused.value.param == param


def test_llama_servers_fields_at_their_defaults_parse() -> None:
    request = openai.parse_chat_request({
        "messages": [USER], "add_generation_prompt": True, "continue_final_message": False,
        "timings_per_token": True, "verbose": True})
    assert request.timings_per_token and request.verbose


def test_verbose_body_says_how_the_answer_ended() -> None:
    timings = Timings(cached_tokens=2, prompt_tokens=5, prompt_ms=10.0, predicted_tokens=3,
                      predicted_ms=30.0)
    usage = Usage(prompt_tokens=7, completion_tokens=3, cached_tokens=2)
    common = {"prompt": "<p>", "model": "m", "usage": usage, "timings": timings}
    limit = openai.verbose_body(**common, finish_reason="length", matched_stop=None,
                                content="abc")
    assert (limit["stop_type"], limit["stopping_word"], limit["content"]) == ("limit", "", "abc")
    assert (limit["tokens_evaluated"], limit["tokens_predicted"]) == (7, 3)
    assert limit["timings"] == openai.timings_body(timings)
    word = openai.verbose_body(**common, finish_reason="stop", matched_stop="END")
    assert (word["stop_type"], word["stopping_word"]) == ("word", "END")
    assert "content" not in word  # (a stream sent it already)
    assert openai.verbose_body(**common, finish_reason="tool_calls",
                               matched_stop=None)["stop_type"] == "eos"


def test_the_usage_chunk_carries_the_timings() -> None:
    timings = Timings(cached_tokens=0, prompt_tokens=4, prompt_ms=8.0, predicted_tokens=2,
                      predicted_ms=4.0)
    chunk = openai.usage_chunk_body(completion_id="c", model="m", created=0,
                                    usage=Usage(4, 2, 0), timings=timings)
    assert chunk["choices"] == [] and chunk["timings"]["predicted_per_second"] == 500.0
    assert "timings" not in openai.usage_chunk_body(completion_id="c", model="m", created=0,
                                                    usage=Usage(4, 2, 0))

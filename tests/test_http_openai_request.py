"""OpenAI request bodies into generate arguments, and error codes into HTTP statuses (socket-free)."""
import pytest

from mcpd.config import ConfigError, from_dict
from mcpd.http import openai_request
from mcpd.http.errors import HttpError
from mcpd.http.openai_reply import Answer
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.results import ContextTurn, GenerateResult, Usage


def test_a_chat_body_becomes_generate_args():
    done = openai_request.chat({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                          {"type": "text", "text": "b"}]}],
                                "max_completion_tokens": 3, "max_tokens": 9, "temperature": 0, "top_p": 0.5,
                                "seed": -1, "stop": "x", "stream": True, "stream_options": {"include_usage": True},
                                "presence_penalty": 0, "whatever": [1], "top_k": 5, "ignore_eos": True}, 2048)
    assert done.args == {"messages": [{"role": "user", "content": "ab"}], "max_tokens": 3, "stream": True,
                         "logprobs": False, "temperature": 0, "top_p": 0.5, "seed": -1, "stop": ["x"], "top_k": 5,
                         "ignore_eos": True}
    assert done.stream and done.include_usage and done.model == "m"


def test_defaults_the_chat_gets_the_daemons_limit_and_completions_16():
    assert openai_request.chat({"model": "m", "messages": [{"role": "user"}]}, 2048).args["max_tokens"] == 2048
    assert openai_request.completion({"model": "m", "prompt": "p"}, 2048).args["max_tokens"] == 16


@pytest.mark.parametrize("prompt, args", [("p", {"prompt": "p"}), (["p"], {"prompt": "p"}),
                                          ([1, 2], {"prompt_token_ids": [1, 2]}), ([[1, 2]], {"prompt_token_ids": [1, 2]})])
def test_a_completion_prompt_may_be_text_or_ids_or_a_batch_of_one(prompt, args):
    done = openai_request.completion({"model": "m", "prompt": prompt}, 2048)
    assert {k: done.args[k] for k in args} == args


def test_a_version_routing_key_and_hints_pass_through_as_generate_args():
    done = openai_request.completion({"model": "m", "prompt": "p", "version": "b", "routing_key": "user-7",
                                      "hints": {"prefer_speed": True}}, 2048)
    assert (done.args["version"], done.args["routing_key"], done.args["hints"]) == ("b", "user-7", {"prefer_speed": True})


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "prompt": "p", "version": 2}, "version"), ({"model": "m", "prompt": "p", "hints": True}, "hints"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"), ({"model": "m", "prompt": [True]}, "prompt"),
    ({"model": "m", "prompt": "p", "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"model": "m", "prompt": "p", "seed": 1.0}, "seed"), ({"model": "m", "prompt": "p", "n": 3}, "n"),
    ({"model": "m", "prompt": "p", "logprobs": 2}, "logprobs"), ({"model": 5, "prompt": "p"}, "model"),
    ({"model": "m", "prompt": "p", "tools": [{}]}, "tools"),
    ({"model": "m", "prompt": "p", "best_of": 3}, "best_of"), ({"model": "m", "prompt": "p", "best_of": "3"}, "best_of"),
    ({"model": "m", "prompt": "p", "suffix": " end"}, "suffix"),
])
def test_refusals_name_the_field(body, param):
    with pytest.raises(HttpError) as raised:
        openai_request.completion(body, 2048)
    assert raised.value.status == 400 and raised.value.body()["error"]["param"] == param


@pytest.mark.parametrize("code, status", [(codes.RATE_LIMITED, 429), (codes.OVERLOADED, 429),
                                          (codes.DEADLINE_EXCEEDED, 504), (codes.UNAUTHORIZED, 401),
                                          (codes.NOT_FOUND, 404), (codes.TOO_LARGE, 413), (codes.UNAVAILABLE, 503),
                                          (codes.CONFLICT, 409), (codes.BAD_REQUEST, 400)])
def test_daemon_codes_map_to_statuses(code, status):
    assert HttpError.of(MCPDError(code, "m")).status == status


def test_retry_hints_become_retry_after_in_whole_seconds():
    assert HttpError.of(MCPDError(codes.OVERLOADED, "m", 100)).headers() == {"Retry-After": "1"}
    assert HttpError.of(MCPDError(codes.RATE_LIMITED, "m", 2500)).headers() == {"Retry-After": "3"}
    assert HttpError.of(MCPDError(codes.NOT_FOUND, "m")).headers() == {}


def test_every_answer_carries_usage_and_a_context_its_version():
    result = GenerateResult("t", [1], "stop", "m", "v", Usage(2, 1),
                            context=ContextTurn("c", 4, [9, 1]))
    whole = Answer("m", chat=False).whole(result)
    assert whole["usage"] == {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    assert whole["mcpd_context"] == {"id": "c", "version": 4} and whole["choices"][0]["text"] == "t"
    last = Answer("m", chat=True).last_chunks(result, include_usage=True)
    assert last[-1]["choices"] == [] and last[-1]["usage"]["total_tokens"] == 3


@pytest.mark.parametrize("http, fails", [({"listen": "0.0.0.0:8000", "auth": "off"}, True),
                                         ({"listen": "8000"}, True), ({"listen": "127.0.0.1:8000", "auth": "maybe"}, True),
                                         ({"listen": "127.0.0.1:8000", "max_body_bytes": 0}, True),
                                         ({"listen": "0.0.0.0:8000"}, False), ({"listen": "[::1]:8000"}, False)])
def test_http_config_checks(http, fails):
    if fails:
        with pytest.raises(ConfigError, match="http"):
            from_dict({"http": http})
    else:
        config = from_dict({"http": http})
        assert config.http_auth == (not config.http.loopback)
        assert from_dict({"http": http, "security": {"curve": "on"}}).http_auth   # never an open door beside CURVE

"""OpenAI request bodies checked and turned into mcpd `generate` arguments (socket-free).

Only types are checked here, with OpenAI's 400 naming the field; ranges (temperature, max_tokens
against the model's length, ...) stay the daemon's to check, once, as for every other client
(the front-end's BAD_REQUEST becomes the same 400). Unknown fields are ignored, as OpenAI does;
known fields mcpd cannot honour are refused rather than silently ignored when they would change
the answer (`n` > 1, penalties, tools, a JSON response format, several prompts).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from mcpd.http.errors import bad_request

NUMBER = (int, float)


@dataclass(frozen=True)
class Completion:
    """One request, as the handlers need it: the generate args and how to answer."""
    model: str
    args: dict                    # generate's args, stream included
    stream: bool = False
    include_usage: bool = False


def parse_json(body: bytes, decode=json.loads) -> dict:
    """The body as a JSON object; `decode` another decoder of the same contract (msgspec's)."""
    try:
        value = decode(body)
    except (ValueError, RecursionError) as e:   # not JSON, not UTF-8, an int of 4300+ digits, nested too deep
        raise bad_request(f"the body is not valid JSON: {str(e)[:200]}") from None
    if not isinstance(value, dict):
        raise bad_request("the body must be a JSON object")
    return value


def chat(body: dict, default_max_tokens: int) -> Completion:
    messages = _get(body, "messages", list, required=True)
    if not messages:
        raise bad_request("'messages' must not be empty", "messages")
    args = {"messages": [_message(m, i) for i, m in enumerate(messages)]}
    max_tokens = _get(body, "max_completion_tokens", int)
    if max_tokens is None:
        max_tokens = _get(body, "max_tokens", int)
    logprobs = _get(body, "logprobs", bool) or False
    if _get(body, "top_logprobs", int):
        raise bad_request("'top_logprobs' is not supported (the engine reports only the chosen token's)",
                          "top_logprobs")
    completion = _completion(body, args, default_max_tokens if max_tokens is None else max_tokens, logprobs)
    if max_tokens is None:   # as vLLM: what room the context has left, not a 400 for a long prompt
        completion.args["hints"] = {**completion.args.get("hints", {}), "fit_max_tokens": True}
    return completion


def completion(body: dict, default_max_tokens: int) -> Completion:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and not _is_int(prompt[0]):
        prompt = prompt[0]   # a batch of one: ["text"] or [[ids]]
    if isinstance(prompt, str):
        args = {"prompt": prompt}
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        args = {"prompt_token_ids": prompt}
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise bad_request("several prompts in one request are not supported: send one request each", "prompt")
    else:
        raise bad_request("'prompt' must be a string, an array of token ids, or a batch of one of them", "prompt")
    if _get(body, "echo", bool):
        raise bad_request("'echo' is not supported", "echo")
    if _get(body, "suffix", str):
        raise bad_request("'suffix' is not supported (no insertion)", "suffix")
    best_of = _get(body, "best_of", int)
    if best_of is not None and best_of != 1:
        raise bad_request("'best_of' must be 1: mcpd returns one choice per request", "best_of")
    logprobs = _get(body, "logprobs", int)
    if logprobs:
        raise bad_request("'logprobs' > 0 (top alternatives) is not supported; 0 gives the chosen tokens'", "logprobs")
    max_tokens = _get(body, "max_tokens", int)
    return _completion(body, args, 16 if max_tokens is None else max_tokens, logprobs == 0)


def _completion(body: dict, args: dict, max_tokens: int, logprobs: bool) -> Completion:
    model = _get(body, "model", str, required=True)
    n = _get(body, "n", int)
    if n is not None and n != 1:
        raise bad_request("'n' must be 1: mcpd returns one choice per request; send n requests (with seeds) "
                          "for n choices", "n")
    _refuse_unsupported(body)
    stream = _get(body, "stream", bool) or False
    options = _get(body, "stream_options", dict)
    include_usage = False
    if options is not None:
        if not stream:
            raise bad_request("'stream_options' is only allowed with 'stream': true", "stream_options")
        include_usage = _get(options, "include_usage", bool, "stream_options.include_usage") or False
    args.update(max_tokens=max_tokens, stream=stream, logprobs=logprobs)
    for name in ("temperature", "top_p"):
        value = _get(body, name, NUMBER)
        if value is not None:
            args[name] = value
    # top_k and ignore_eos as vLLM's extras; version, routing_key and hints as generate's (PROTOCOL.md)
    for name, kind in (("seed", int), ("top_k", int), ("ignore_eos", bool), ("version", str), ("routing_key", str),
                       ("hints", dict)):
        value = _get(body, name, kind)
        if value is not None:
            args[name] = value
    stop = body.get("stop")
    if stop is not None:
        args["stop"] = _stop(stop)
    return Completion(model, args, stream, include_usage)


def _refuse_unsupported(body: dict) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        if _get(body, name, NUMBER):
            raise bad_request(f"'{name}' is not supported (only 0)", name)
    for name in ("tools", "functions", "logit_bias"):
        if body.get(name):
            raise bad_request(f"'{name}' is not supported", name)
    response_format = _get(body, "response_format", dict)
    if response_format is not None and response_format.get("type", "text") != "text":
        raise bad_request("'response_format' must be text", "response_format")


def _message(message, index: int) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise bad_request(f"'{where}' must be an object", where)
    role = _get(message, "role", str, f"{where}.role", required=True)
    content = message.get("content")
    if isinstance(content, list):   # content parts: only text ones
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise bad_request(f"'{where}.content': only text parts are supported", f"{where}.content")
        content = "".join(p["text"] for p in content)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise bad_request(f"'{where}.content' must be a string or an array of text parts", f"{where}.content")
    return {"role": role, "content": content}


def _stop(stop) -> list[str]:
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise bad_request("'stop' must be a string or an array of strings", "stop")


def _get(body: dict, name: str, kind, param: str | None = None, required: bool = False):
    """body[name] if it has the type (None when absent or null); 400 naming it otherwise."""
    value = body.get(name)
    if value is None:
        if required:
            raise bad_request(f"'{param or name}' is required", param or name)
        return None
    wrong_bool = isinstance(value, bool) and kind is not bool
    if wrong_bool or not isinstance(value, kind) or (kind is int and not _is_int(value)):
        expected = {bool: "a boolean", int: "an integer", str: "a string", list: "an array", dict: "an object",
                    NUMBER: "a number"}[kind]
        raise bad_request(f"'{param or name}' must be {expected}", param or name)
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)

"""A chat on a context through the real daemon serving a ChatML checkpoint: ten turns give the
answers, token for token, that a stateless client sending the whole message list gets, on
ZeroMQ and on the OpenAI routes."""
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest

from mcpd.testing import free_port
from test_http import raw
from tiny_checkpoints import make_checkpoint

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def served(module_daemon):
    checkpoint = make_checkpoint(Path(tempfile.mkdtemp(prefix="mcpd-chatml-")) / "m", "qwen2", chatml=True)
    config = json.loads((checkpoint / "config.json").read_text())   # room for ten turns (rope has no table)
    (checkpoint / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
    daemon = module_daemon(model={"path": str(checkpoint)}, http={"listen": f"127.0.0.1:{free_port()}"})
    daemon.base_url = f"http://{daemon.control('config')['config']['http']['listen']}/v1"
    return daemon


def test_ten_turns_on_a_context_answer_as_the_whole_message_list_does(served):
    with served.client() as client:
        context = client.context("ten-turns")
        conversation = []
        for turn in range(10):
            question = {"role": "user", "content": f"the fox, {turn}?"}
            max_tokens = 3 + turn % 4   # most answers stop at max_tokens, mid-answer
            stateless = client.generate(messages=[*conversation, question], max_tokens=max_tokens, **GREEDY)
            on_context = context.chat(question["role"], question["content"], max_tokens=max_tokens, **GREEDY)
            assert (on_context.token_ids, on_context.prompt_tokens) == \
                (stateless.token_ids, stateless.prompt_tokens), f"turn {turn + 1}"
            conversation += [question, {"role": "assistant", "content": stateless.text}]
        fetched = client.context("ten-turns", create=False)   # the daemon's tokens, fetched whole
        assert np.array_equal(context.tokens, fetched.tokens) and fetched.version == 10   # the mirror followed


def test_ten_turns_on_a_context_route_answer_as_chat_completions_does(served):
    model = raw(served, "GET", "/v1/models")[2]["data"][0]["id"]
    conversation = []
    for turn in range(10):
        conversation.append({"role": "user", "content": f"the dog, {turn}?"})
        body = {"model": model, "max_tokens": 3 + turn % 4, "temperature": 0}
        _, _, stateless = raw(served, "POST", "/v1/chat/completions", {**body, "messages": conversation})
        _, _, on_context = raw(served, "POST", "/v1/contexts/http-ten/chat/completions",
                               {**body, "messages": conversation[-1:]})
        answer = stateless["choices"][0]["message"]
        assert (on_context["choices"][0]["message"], on_context["usage"]) == (answer, stateless["usage"]), turn + 1
        conversation.append(answer)

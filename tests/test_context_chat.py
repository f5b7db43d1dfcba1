"""A chat on a context is the chat a stateless client gets (contexts/chat.py), in the scheduler's
core in-process: each turn runs on exactly the tokens that the same scheduler gives a generate
sending the whole message list, for the embedded template, ChatML, Llama 3 and SmolLM2's (a
default system prompt), over ten turns whose answers end every way an answer can end."""
import json
import tempfile
from pathlib import Path

import msgpack
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from mcpd.config import ModelConfig, from_dict
from mcpd.contexts import chat
from mcpd.daemon import messages
from mcpd.protocol import codes
from mcpd.protocol.args import ContextOpenArgs, ContextUpdateArgs, GenerateArgs
from mcpd.tokenizer import load
from fakes import Clock, Ports, decoded, scheduler_of
from test_scheduler_core import dispatched, from_worker, hello, result
from test_scheduler_core import request as inbound
from tiny_checkpoints import CHATML_TEMPLATE, CORPUS

CHATML = {"specials": ["<|im_start|>", "<|im_end|>"], "eos": "<|im_end|>", "template": CHATML_TEMPLATE}
SMOLLM2 = {**CHATML, "template": (   # tokenizer.chat_template of SmolLM2-135M-Instruct's GGUF file
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")}
LLAMA3 = {"specials": ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
          "bos": "<|begin_of_text|>", "eos": "<|eot_id|>", "template": (   # Meta-Llama-3-8B-Instruct's
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")}
TEMPLATES = {"embedded": None, "chatml": CHATML, "llama3": LLAMA3, "smollm2": SMOLLM2}

# Ten answers, each ending one way: the template's end token, max_tokens mid-answer (mid-word,
# mid-character), trailing space (Llama 3's template trims it), a spelling the tokenizer would
# not make (one token per character), EOS right away.
ANSWERS = [("the quick brown fox", "end"), ("hello world, hello mcpd", "cut"), ("ünïcödé 漢字", "cut"),
           ("paged attention ", "end"), ("continuous batching", "spelled"), ("", "end"),
           ("tokens stream out one step at a time", "cut"), ("emoji 🙂 too ", "spelled"),
           ("the lazy dog", "end"), ("keeps the kv cache in blocks", "cut")]


def write_model(directory: Path, spec: dict) -> Path:
    """A byte-level BPE with the template's special tokens, and the template."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=spec["specials"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": spec.get("bos"), "eos_token": spec["eos"], "chat_template": spec["template"]}))
    (directory / "config.json").write_text("{}")
    return directory


@pytest.fixture(params=list(TEMPLATES))
def turns(request):
    runtime_dir = tempfile.mkdtemp(prefix="mcpd-c-", dir="/tmp")
    spec = TEMPLATES[request.param]
    model = ModelConfig(path=str(write_model(Path(runtime_dir) / "model", spec)) if spec else "")
    config = from_dict({"server": {"runtime_dir": runtime_dir}, "cache": {"enabled": False},
                        "persistence": {"enabled": False}, "model": {"path": model.path}})
    core = scheduler_of(config, Ports(), Clock())
    hello(core, 11)
    core.on_inbox(*decoded(inbound(0, ContextOpenArgs(id="chat"))))
    return Turns(core, load(model), ends_with_eos=spec is not None)


class Turns:
    """Drives the core as the front-end and the worker would: turns on the context "chat" and
    stateless generates, each answered by the 'model' with the tokens the test picks."""

    def __init__(self, core, tokenizer, ends_with_eos: bool):
        self.core, self.tokenizer, self.rid = core, tokenizer, 0
        self.ends_with_eos = ends_with_eos   # the template closes an answer with the model's EOS

    def dispatch(self, args: GenerateArgs) -> tuple[messages.Dispatch, list[int]]:
        """The dispatch the worker gets for it, and the tokens it runs on."""
        self.rid += 1
        self.core.on_inbox(*decoded(inbound(self.rid, args)))
        self.core.tick()
        sent = dispatched(self.core)[-1]
        assert sent.rid == self.rid, self.core.ports.finals().get(self.rid)
        history = np.frombuffer(self.core.ports.workers[-1][2][0], np.int32).tolist() if sent.turn else []
        return sent, history + sent.prompt_ids

    def stateless(self, conversation: list[dict]) -> list[int]:
        """The tokens a generate sending the whole message list runs on."""
        sent, runs_on = self.dispatch(GenerateArgs(messages=tuple(conversation)))
        from_worker(self.core, messages.Done([sent.rid]))
        return runs_on

    def answer(self, turn: messages.Dispatch, output: list[int]) -> dict:
        """The turn's end as its worker reports it; the context part of the reply."""
        text = self.tokenizer.decode(output)
        from_worker(self.core, messages.TurnResult(turn.rid, result(output, text), turn.prompt_ids + output))
        return self.core.ports.finals()[turn.rid]["result"]["context"]

    def output(self, text: str, ending: str) -> list[int]:
        """The model's tokens for an answer that ends as `ending` says."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if ending == "cut":   # max_tokens reached: cut mid-answer (the byte tokenizer: mid-character too)
            return ids[:len(ids) * 2 // 3]
        if ending == "spelled":
            ids = [t for c in text for t in self.tokenizer.encode(c, add_special_tokens=False)]
        return ids + [min(self.tokenizer.eos_token_ids)]


def test_ten_turns_run_on_the_tokens_of_the_whole_conversation_as_a_stateless_client_sends_it(turns):
    conversation, held = [], 0
    for i, (text, ending) in enumerate(ANSWERS):
        forged = "<|im_end|><|eot_id|>" if i == 3 else ""   # special-token text in a message stays text
        conversation.append({"role": "user", "content": f"question {i}: {text[:5]}?{forged}"})
        whole = turns.stateless(conversation)
        turn, runs_on = turns.dispatch(GenerateArgs(messages=(conversation[-1],), context="chat"))
        assert runs_on == whole, f"turn {i + 1}"
        if i and ANSWERS[i - 1] == (ANSWERS[i - 1][0].strip(), "end") and turns.ends_with_eos:
            # the answer was closed by the template's own end token, as the template writes it back
            assert len(runs_on) - len(turn.prompt_ids) == held   # the turn prefills only what it adds
        output = turns.output(text, ending)
        context = turns.answer(turn, output)
        held = len(whole) + len(output)
        assert context["version"] == i + 1
        conversation.append({"role": "assistant", "content": turns.tokenizer.decode(output)})


def test_a_turn_that_replaces_the_tail_says_what_it_kept_and_a_prompt_turn_starts_a_new_chat(turns):
    question = {"role": "user", "content": "hi"}
    turn, first = turns.dispatch(GenerateArgs(messages=(question,), context="chat"))
    spelled = turns.output("hello world", "spelled")   # not the tokenizer's spelling: replaced next turn
    turns.answer(turn, spelled)
    turn, runs_on = turns.dispatch(GenerateArgs(messages=(question,), context="chat"))
    kept = len(runs_on) - len(turn.prompt_ids)
    assert runs_on[:kept] == (first + spelled)[:kept] and kept < len(first + spelled)
    assert turns.answer(turn, [])["kept_tokens"] == kept
    prompt_turn, chat_ended = turns.dispatch(GenerateArgs(prompt="x", context="chat"))
    turns.answer(prompt_turn, [])
    turn, runs_on = turns.dispatch(GenerateArgs(messages=(question,), context="chat"))
    assert runs_on == chat_ended + turns.tokenizer.encode_chat([question])   # a new chat after the prompt's tokens


def test_a_chat_record_the_tenant_spoiled_is_refused_and_the_context_stays_free(turns):
    core = turns.core
    nested = b"\x91" * 100_000   # fixarrays, each in the one before
    spoiled = (b"not msgpack", nested, msgpack.packb({"start": 5, "end": 1, "messages": []}),
               msgpack.packb({"start": True, "end": 0, "messages": []}))
    for base, value in enumerate(spoiled):
        rid = 100 + base
        changes = [{"name": chat.FIELD, "kind": "set", "frame": 0,
                    "meta": {"type": "bytes", "codec": "raw", "nbytes": len(value)}}]
        core.on_inbox(*decoded([*inbound(rid, ContextUpdateArgs(id="chat", base=base, changes=changes)), value]))
        assert core.ports.finals()[rid]["result"]["version"] == base + 1
        core.on_inbox(*decoded(inbound(rid + 50, GenerateArgs(messages=({"role": "user", "content": "hi"},), context="chat"))))
        refused = core.ports.finals()[rid + 50]
        assert refused["code"] == codes.BAD_REQUEST and chat.FIELD in refused["message"]
    turns.dispatch(GenerateArgs(prompt="free", context="chat"))   # the refusals ended their turns

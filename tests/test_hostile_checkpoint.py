"""A model directory is a stranger's until checked: each lie in its config.json or its
safetensors files is refused at load with the file, the field and the value, never a traceback,
a hang or an allocation the lie sized; and a worker that meets one refuses its start, so the
daemon stops with the reason instead of restarting the worker for ever."""
import json
import os
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from mcpd import refusal
from mcpd.config import ConfigError, ModelConfig, from_dict
from mcpd.models import UnsupportedModel, architecture, load_model
from tiny_checkpoints import edited_copy, make_checkpoint

CPU = torch.device("cpu")
NAN, INF = float("nan"), float("inf")
EMBEDDING = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    return {kind: make_checkpoint(root / kind, kind) for kind in ("llama", "gpt2")}


def refusal_of(path) -> str:
    with pytest.raises(UnsupportedModel) as refused:
        load_model(ModelConfig(path=str(path)), CPU)
    return str(refused.value)


PLAIN_ROPE = {"rope_parameters": None}   # the tiny checkpoints' rope_parameters would win over rope_scaling


@pytest.mark.parametrize("kind, changes, says", [
    ("llama", {"architectures": "LlamaForCausalLM"}, "architectures 'LlamaForCausalLM' is not a list of names"),
    ("llama", {"architectures": [5]}, "architectures [5] is not a list of names"),
    ("llama", {"architectures": {"LlamaForCausalLM": 1}}, "architectures {'LlamaForCausalLM': 1} is not a list"),
    ("llama", {"hidden_size": "64", "head_dim": None}, "hidden_size '64' is not a whole number"),
    ("llama", {"hidden_size": 64.0}, "hidden_size 64.0 is not a whole number"),
    ("llama", {"hidden_size": True}, "hidden_size True is not a whole number"),
    ("llama", {"hidden_size": -64}, "hidden_size -64 is not a whole number"),
    ("llama", {"hidden_size": 0}, "hidden_size 0 is not a whole number"),
    ("llama", {"hidden_size": 2 ** 40}, "hidden_size 1099511627776 is not a whole number from 1 to 131072"),
    ("llama", {"num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": None},
     "hidden_size 64 is not a multiple of num_attention_heads 3"),
    ("llama", {"num_key_value_heads": 3}, "4 query heads cannot share 3 KV heads evenly"),
    ("llama", {"num_key_value_heads": 0}, "num_key_value_heads 0 is not a whole number"),
    ("llama", {"head_dim": 33}, "head_dim 33 is odd"),
    ("llama", {"head_dim": 0}, "head_dim 0 is not a whole number"),
    ("llama", {"vocab_size": 2 ** 40}, "vocab_size 1099511627776 is not a whole number from 1 to 4194304"),
    ("llama", {"max_position_embeddings": 2 ** 62}, "max_position_embeddings 4611686018427387904 is not a whole"),
    ("llama", {**PLAIN_ROPE, "rope_theta": NAN}, "rope_theta nan is not a finite positive number"),
    ("llama", {**PLAIN_ROPE, "rope_theta": -1.0}, "rope_theta -1.0 is not a finite positive number"),
    ("llama", {**PLAIN_ROPE, "rope_theta": INF}, "rope_theta inf is not a finite positive number"),
    ("llama", {**PLAIN_ROPE, "rope_scaling": "linear"}, "rope_scaling 'linear' is not a JSON object"),
    ("llama", {**PLAIN_ROPE, "rope_scaling": [2.0]}, "rope_scaling [2.0] is not a JSON object"),
    ("llama", {"rope_parameters": {"rope_type": "longrope", "short_factor": 5, "long_factor": 5}},
     "rope short_factor 5 is not a list of finite positive numbers"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": "4"}}, "rope factor '4' is not a finite positive"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 0}},
     "rope original_max_position_embeddings 0 is not a whole number"),
    ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 1e308}},
     "rope factor 1e+308 makes the context inf tokens, not a whole number from 1 to 16777216"),
    ("llama", {"rms_norm_eps": -1.0}, "rms_norm_eps -1.0 is not a finite positive number"),
    ("llama", {"rms_norm_eps": NAN}, "rms_norm_eps nan is not a finite positive number"),
    ("llama", {"tie_word_embeddings": "false"}, "tie_word_embeddings 'false' is not true or false"),
    ("llama", {"attention_bias": 0}, "attention_bias 0 is not true or false"),
    ("llama", {"torch_dtype": "float64"}, "torch_dtype 'float64' is not supported"),
    ("llama", {"torch_dtype": None, "dtype": ["bfloat16"]}, "dtype ['bfloat16'] is not supported"),
    ("llama", {"quantization_config": "awq"}, "quantization_config 'awq' is not a JSON object"),
    ("llama", {"eos_token_id": {"id": 1}}, "eos_token_id {'id': 1} is not a token id or a list of them"),
    ("gpt2", {"n_head": 3}, "n_embd 64 is not a multiple of n_head 3"),
    ("gpt2", {"n_inner": 0}, "n_inner 0 is not a whole number"),
    ("gpt2", {"scale_attn_weights": "yes"}, "scale_attn_weights 'yes' is not true or false"),
])
def test_a_config_json_lie_is_refused_naming_the_file_field_and_value(checkpoints, tmp_path, kind, changes, says):
    _refused_naming(checkpoints[kind], tmp_path, changes, says)


def _refused_naming(checkpoint, tmp_path, changes, says) -> None:
    path = edited_copy(checkpoint, tmp_path / "edited", **changes)
    refused = refusal_of(path)
    assert refused.startswith(f"{path / 'config.json'}: ") and says in refused, refused


def _rope(rope_type, **values) -> dict:
    return {"rope_parameters": {"rope_type": rope_type, "rope_theta": 10000.0, **values}}


LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
SIXTEEN = [1.0] * 16   # a longrope factor per frequency of the tiny llama's heads


@pytest.mark.parametrize("changes, says", [
    (_rope("llama3", **{**LLAMA3, "low_freq_factor": 2.0, "high_freq_factor": 2.0}),
     "rope high_freq_factor 2.0 is not more than rope low_freq_factor 2.0"),
    (_rope("llama3", **{**LLAMA3, "low_freq_factor": 4.0, "high_freq_factor": 1.0}),
     "rope high_freq_factor 1.0 is not more than rope low_freq_factor 4.0"),
    (_rope("llama3", **{**LLAMA3, "factor": 1e-40}),
     "rope factor 1e-40 is less than 0.001 (it divides rope frequencies)"),
    (_rope("longrope", short_factor=[1e-300] * 16, long_factor=SIXTEEN), "rope short_factor 1e-300 is less than 0.001"),
    (_rope("yarn", factor=4.0, attention_factor=1e300), "rope attention_factor 1e+300 is more than 100"),
    (_rope("longrope", short_factor=SIXTEEN, long_factor=SIXTEEN, attention_factor=1e6),
     "rope attention_factor 1000000.0 is more than 100"),
    ({"head_dim": 2, **_rope("dynamic", factor=2.0)}, "rope type 'dynamic' with head_dim 2"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1.0}},
     "rope_theta 1.0 is not more than 1 (rope's frequencies are its inverse powers)"),
    ({**PLAIN_ROPE, "rope_theta": 1e-300}, "rope_theta 1e-300 is not more than 1"),
])
def test_rope_values_that_would_divide_by_zero_or_overflow_the_rope_table_are_refused(checkpoints, tmp_path, changes,
                                                                                      says):
    """Each makes the worker's rope table inf or NaN, or its build divide by zero (every accepted
    value keeps it finite in float32 and float16)."""
    _refused_naming(checkpoints["llama"], tmp_path, changes, says)


@pytest.mark.parametrize("kind, changes, says", [
    ("llama", {"num_key_value_heads": 2 ** 40},
     "num_key_value_heads 1099511627776 is not a whole number from 1 to 4096"),
    ("llama", {"num_attention_heads": 2 ** 40}, "num_attention_heads 1099511627776 is not a whole number from 1 to"),
    ("llama", {"hidden_size": 10 ** 30}, "hidden_size 10000000...(31 digits) is not a whole number from 1 to 131072"),
    ("llama", _rope("linear", factor=2 ** 1000),
     "rope factor 10715086...(302 digits) makes the context 13715310...(304 digits) tokens, not a whole number"),
    ("gpt2", {"n_layer": 10 ** 30}, "n_layer 10000000...(31 digits) is not a whole number from 1 to 4096"),
    ("gpt2", {"n_inner": 2 ** 40}, "n_inner 1099511627776 is not a whole number from 1 to 524288"),
    ("gpt2", {"n_positions": 2 ** 40}, "n_positions 1099511627776 is not a whole number from 1 to 16777216"),
    ("gpt2", {"layer_norm_epsilon": -1.0}, "layer_norm_epsilon -1.0 is not a finite positive number"),
])
def test_a_size_past_its_cap_is_named_as_config_json_names_it_its_value_cut(checkpoints, tmp_path, kind, changes,
                                                                          says):
    _refused_naming(checkpoints[kind], tmp_path, changes, says)


def test_a_layer_count_past_its_cap_is_refused_before_a_list_of_layers_is_made(checkpoints, tmp_path):
    """A windowed family lists each layer's type: 10^9 layers were 10^9 entries (gigabytes) before
    the cap refused them. Read in a process whose address space is capped far below that."""
    path = edited_copy(checkpoints["llama"], tmp_path / "edited", architectures=["MistralForCausalLM"],
                  sliding_window=4, num_hidden_layers=10 ** 9)
    program = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
               "from mcpd.config import ModelConfig; from mcpd.models import architecture\n"
               "architecture.of(ModelConfig(path=sys.argv[1]), 'cpu')")
    done = subprocess.run([sys.executable, "-c", program, str(path)], capture_output=True, text=True, timeout=120)
    assert (f"UnsupportedModel: {path / 'config.json'}: num_hidden_layers 1000000000 is not a whole number "
            "from 1 to 4096") in done.stderr, done.stderr


@pytest.mark.parametrize("file, eos", [("config.json", "2"), ("config.json", [1, 2.5]),
                                       ("generation_config.json", {"id": 1})])
def test_end_tokens_that_are_no_token_ids_are_refused_at_start_naming_the_file(checkpoints, tmp_path, file, eos):
    """The supervisor's check: a worker would meet them building its tokenizer (a dict: a TypeError)."""
    path = edited_copy(checkpoints["llama"], tmp_path / "edited")
    (path / "generation_config.json").write_text("{}")
    written = json.loads((path / file).read_text())
    (path / file).write_text(json.dumps({**written, "eos_token_id": eos}))
    with pytest.raises(ConfigError) as refused:
        architecture.check_configured(from_dict({"model": {"path": str(path)}}))
    assert str(refused.value) == f"model: {path / file}: eos_token_id {eos!r} is not a token id or a list of them"


def _tampered_header(path, tamper) -> None:
    """path's model.safetensors with its JSON header changed by tamper(header), the data kept."""
    file = path / "model.safetensors"
    raw = file.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + length])
    tamper(header)
    text = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length:])


def _with_tensor(path, name, tensor) -> None:
    tensors = load_file(path / "model.safetensors")
    if tensor is None:
        del tensors[name]
    else:
        tensors[name] = tensor
    save_file(tensors, path / "model.safetensors")


def _header_length(path, length) -> None:
    file = path / "model.safetensors"
    file.write_bytes(struct.pack("<Q", length) + file.read_bytes()[8:])


def _index_naming(path, shard) -> None:
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {EMBEDDING: shard}}))


UNREADABLE = "model.safetensors: not a readable safetensors file (Error while deserializing header: "


def _offsets_past_the_end(header) -> None:
    start, end = header[EMBEDDING]["data_offsets"]
    header[EMBEDDING]["data_offsets"] = [start, end + (1 << 40)]


@pytest.mark.parametrize("lie, says", [
    pytest.param(lambda path: _with_tensor(path, EMBEDDING, torch.zeros(321, 64)),
                 f"tensor '{EMBEDDING}' has shape (321, 64), which does not fit {EMBEDDING} (320, 64)", id="shape"),
    pytest.param(lambda path: _with_tensor(path, EMBEDDING, None), f"checkpoint lacks weights for {EMBEDDING}",
                 id="missing"),
    pytest.param(lambda path: _with_tensor(path, EMBEDDING, torch.zeros(320, 64, dtype=torch.int64)),
                 f"tensor '{EMBEDDING}' is torch.int64, {EMBEDDING} takes torch.float32", id="int64"),
    pytest.param(lambda path: _with_tensor(path, "model.norm.weight", torch.ones(64, dtype=torch.bool)),
                 "tensor 'model.norm.weight' is torch.bool", id="bool"),
    pytest.param(lambda path: _tampered_header(path, lambda header: header[EMBEDDING].update(dtype="F128")),
                 UNREADABLE + "invalid JSON in header: unknown variant `F128`", id="unknown-dtype"),
    pytest.param(lambda path: _tampered_header(path, _offsets_past_the_end), UNREADABLE, id="offsets-past-end"),
    pytest.param(lambda path: _tampered_header(path, lambda header: header[EMBEDDING].update(shape=[1 << 31] * 2)),
                 UNREADABLE, id="huge-shape"),
    pytest.param(lambda path: _header_length(path, 1 << 60), UNREADABLE + "header too large", id="header-2**60"),
    pytest.param(lambda path: _index_naming(path, "/dev/zero"),
                 "model.safetensors.index.json: weight_map {'model.embed_tokens.weight': '/dev/zero'} is not an "
                 "object of tensor names", id="index-path"),
    pytest.param(lambda path: _index_naming(path, "shard-2.safetensors"),
                 "shard-2.safetensors: not a readable safetensors file ([Errno 2]", id="index-missing-shard"),
])
def test_a_safetensors_lie_is_refused_naming_the_file(checkpoints, tmp_path, lie, says):
    path = edited_copy(checkpoints["llama"], tmp_path / "edited")
    lie(path)
    refused = refusal_of(path)
    assert refused.startswith(str(path)) and says in refused, refused


def test_a_fifo_in_the_weights_place_is_refused_not_waited_on(checkpoints, tmp_path):
    """Opening a FIFO waits for a writer for ever, in safetensors' own code where no test timeout
    reaches. A writer stands by, so a loader that opens it fails this test instead of hanging it,
    and is let go after."""
    path = edited_copy(checkpoints["llama"], tmp_path / "edited")
    fifo = path / "model.safetensors"
    fifo.unlink()
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: open(fifo, "wb").close(), daemon=True)
    writer.start()
    try:
        refused = refusal_of(path)
    finally:
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)   # held until the writer, however late, has opened
        writer.join()
        os.close(reader)
    assert refused == f"{fifo}: not a regular file"


@pytest.mark.slow
def test_a_worker_meeting_weights_that_lie_stops_the_daemon_with_the_reason(fresh_daemon, checkpoints, tmp_path):
    """The supervisor checks config.json, not the weights: the worker meets the lie, refuses its
    start (exit 2, the reason in the log), and is not restarted to meet it again."""
    path = edited_copy(checkpoints["llama"], tmp_path / "edited")
    _with_tensor(path, EMBEDDING, torch.zeros(321, 64))
    d = fresh_daemon(started=False, model={"path": str(path)})
    d.start(wait=False)
    assert d.process.wait(120) == refusal.CONFIG, d.log()
    assert (f"mcpd: worker 0 cannot start: model: {path}: tensor '{EMBEDDING}' has shape (321, 64), which does "
            "not fit") in d.log()


def _edited_json(path, file, edit) -> None:
    """path's `file` (JSON) as edit(its value) makes it."""
    (path / file).write_text(json.dumps(edit(json.loads((path / file).read_text()))))


def _vocab_as_list(tokenizer) -> dict:
    return {**tokenizer, "model": {**tokenizer["model"], "vocab": list(tokenizer["model"]["vocab"].items())}}


NOT_A_TOKENIZER = "tokenizer.json: not a readable tokenizer ("


@pytest.mark.parametrize("lie, says", [
    pytest.param(lambda path: (path / "tokenizer.json").write_text("not json"),
                 NOT_A_TOKENIZER + "expected ident at line 1 column 2)", id="not-json"),
    pytest.param(lambda path: (path / "tokenizer.json").write_text("[1, 2]"),
                 NOT_A_TOKENIZER + "invalid type: sequence, expected struct Tokenizer", id="a-list"),
    pytest.param(lambda path: _edited_json(path, "tokenizer.json", _vocab_as_list),
                 NOT_A_TOKENIZER + "invalid type: sequence, expected a map", id="vocab-a-list"),
    pytest.param(lambda path: _edited_json(path, "tokenizer_config.json", lambda c: {**c, "bos_token": 5}),
                 "tokenizer_config.json: bos_token 5 is not a token's text", id="bos-token"),
    pytest.param(lambda path: _edited_json(path, "tokenizer_config.json",
                                           lambda c: {**c, "eos_token": {"content": ["</s>"]}}),
                 "tokenizer_config.json: eos_token {'content': ['</s>']} is not a token's text", id="eos-token"),
    pytest.param(lambda path: _edited_json(path, "tokenizer_config.json", lambda c: {**c, "chat_template": 5}),
                 "tokenizer_config.json: chat_template 5 is not a template or a list of named ones", id="template"),
    pytest.param(lambda path: _edited_json(path, "tokenizer_config.json",
                                           lambda c: {**c, "chat_template": "{% for %}"}),
                 "tokenizer_config.json: chat template: Expected an expression", id="template-syntax"),
    pytest.param(lambda path: (path / "chat_template.jinja").write_text("{{ unclosed"),
                 "chat_template.jinja: chat template: unexpected end of template", id="jinja-file"),
    pytest.param(lambda path: (path / "tokenizer_config.json").write_text("[]"),
                 "tokenizer_config.json: not a JSON object", id="config-a-list"),
    pytest.param(lambda path: (path / "generation_config.json").write_text("{"),
                 "generation_config.json: not a readable JSON object (not JSON", id="generation-not-json"),
    pytest.param(lambda path: (path / "generation_config.json").write_text("[1]"),
                 "generation_config.json: not a JSON object", id="generation-a-list"),
])
def test_a_tokenizer_file_lie_is_refused_at_start_and_at_load_naming_the_file(checkpoints, tmp_path, lie, says):
    """The supervisor builds the tokenizer as every scheduler and worker would (the library
    raises a bare Exception for a tokenizer.json of the wrong shape); a worker that meets a lie
    the check did not see (the file changed since) refuses with the same words."""
    path = edited_copy(checkpoints["llama"], tmp_path / "edited")
    lie(path)
    with pytest.raises(ConfigError) as refused:
        architecture.check_configured(from_dict({"model": {"path": str(path)}}))
    assert str(refused.value).startswith(f"model: {path}/") and says in str(refused.value), refused.value
    assert refusal_of(path) == str(refused.value).removeprefix("model: ")


@pytest.mark.slow
def test_a_broken_tokenizer_stops_the_daemon_at_start_naming_the_file(fresh_daemon, checkpoints, tmp_path):
    """Refused by the supervisor's check (exit 2), not met by a worker restarted for ever."""
    path = edited_copy(checkpoints["llama"], tmp_path / "edited")
    (path / "tokenizer.json").write_text("[1, 2]")
    d = fresh_daemon(started=False, model={"path": str(path)})
    d.start(wait=False)
    assert d.process.wait(60) == refusal.CONFIG, d.log()
    assert f"model: {path / NOT_A_TOKENIZER}invalid type: sequence, expected struct Tokenizer" in d.log()


def _standby_pid(d) -> int:
    """The one child of the fork server (every child's parent) that the process table does not list."""
    listed = {p["pid"] for p in d.processes()}
    server = psutil.Process(d.pid_of("worker")).parent()
    [standby] = [child.pid for child in server.children() if child.pid not in listed]
    return standby


@pytest.mark.slow
def test_a_standby_meeting_a_changed_config_json_refuses_as_a_worker_start_would(fresh_daemon, checkpoints, tmp_path):
    """A standby made after config.json changed on disk cannot build the model: it stands by
    saying so (not an UnsupportedModel traceback, remade at once for ever), and promoted, its
    start is refused as any worker's: the daemon stops with the reason."""
    path = edited_copy(checkpoints["llama"], tmp_path / "edited")
    d = fresh_daemon(workers={"standby": True}, model={"path": str(path)})
    d.wait_until(lambda: "standing by for worker 0" in d.log(), 60, "a standby")
    _edited_json(path, "config.json", lambda config: {**config, "num_key_value_heads": 3})
    os.kill(_standby_pid(d), signal.SIGKILL)   # its successor reads the changed config.json
    reason = f"model: {path / 'config.json'}: 4 query heads cannot share 3 KV heads evenly"
    d.wait_until(lambda: f"standing by for worker 0, whose start will be refused: {reason}" in d.log(), 60,
                 "a standby that says why")
    os.kill(d.pid_of("worker"), signal.SIGKILL)
    assert d.process.wait(60) == refusal.CONFIG, d.log()
    assert "promoted the standby of worker 0" in d.log() and f"mcpd: worker 0 cannot start: {reason}" in d.log()
    assert "UnsupportedModel" not in d.log()

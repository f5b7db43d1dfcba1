"""Where workers go: workers.count over the GPUs (at least one each, more sharing one device's
pool), the model table's versions likewise, the CPU otherwise. The GPU count is the driver's
(/proc or /dev nodes), faked here: CI has no GPU."""
import pytest

from mcpd.config import ConfigError, from_dict
from mcpd.daemon.supervisor import process as supervisor


@pytest.mark.parametrize("gpus, count, expected", [
    (1, 1, ["cuda:0"]), (1, 2, ["cuda:0", "cuda:0"]), (2, 1, ["cuda:0", "cuda:1"]),
    (2, 3, ["cuda:0", "cuda:1", "cuda:0"]), (0, 2, ["cpu", "cpu"])])
def test_workers_spread_over_the_gpus_or_stay_on_the_cpu(monkeypatch, gpus, count, expected):
    monkeypatch.setattr(supervisor, "count_gpus", lambda: gpus)
    assert supervisor.worker_devices(from_dict({"workers": {"count": count}})) == expected


def test_device_cpu_ignores_the_gpus_and_cuda_needs_one(monkeypatch):
    monkeypatch.setattr(supervisor, "count_gpus", lambda: 2)
    assert supervisor.worker_devices(from_dict({"workers": {"count": 2, "device": "cpu"}})) == ["cpu", "cpu"]
    monkeypatch.setattr(supervisor, "count_gpus", lambda: 0)
    with pytest.raises(ConfigError, match="no NVIDIA GPU"):
        supervisor.worker_devices(from_dict({"workers": {"device": "cuda"}}))


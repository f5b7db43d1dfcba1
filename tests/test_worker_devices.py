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



@pytest.mark.parametrize("installed, value, visible", [
    (4, None, 4), (4, "", 0), (4, "-1", 0), (4, "0", 1), (4, "2,1", 2), (4, "0,2,-1,1", 2), (4, " 1 , 3 ", 2),
    (2, "0,1,2,3", 2), (2, "5", 0), (2, "1,1", 1), (2, "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6", 1),
    (1, "MIG-GPU-8932f937/1/0,MIG-GPU-8932f937/2/0", 1), (2, "GPU-a,0", 2), (2, "0,abc,1", 1), (0, "0", 0),
    (4, "+1", 0), (4, "0x1", 0), (4, "\u00b2", 0), (8, "007", 1), (2, str(2 ** 63), 0), (2, "0," + "9" * 5000, 1),
    (8, "0," * 1_000_000, 1)])
def test_cuda_visible_devices_limits_the_gpus_as_cuda_reads_it(installed, value, visible):
    assert supervisor.visible_gpus(installed, value) == visible


def test_hidden_gpus_get_no_workers_and_cuda_without_a_visible_one_is_refused_by_name(monkeypatch, tmp_path):
    for gpu in ("0000:01:00.0", "0000:41:00.0", "0000:81:00.0"):   # the driver's /proc entries, one per GPU
        (tmp_path / gpu).mkdir()
    monkeypatch.setattr(supervisor, "NVIDIA_GPUS", tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert supervisor.worker_devices(from_dict({"workers": {"count": 1}})) == ["cuda:0", "cuda:1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert supervisor.worker_devices(from_dict({"workers": {"count": 2}})) == ["cpu", "cpu"]
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES=''"):
        supervisor.worker_devices(from_dict({"workers": {"device": "cuda"}}))

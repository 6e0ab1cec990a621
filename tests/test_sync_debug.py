"""SPLITSPEC_SYNC_DEBUG's counter (splitspec/sync_debug.py) on a GPU: a synchronizing call is counted at its call site,
work the host only queues is not (runtime.batch.device_tensor's copies included), and the counts land in the file."""

import json

import pytest
import torch

from splitspec.runtime.batch import device_tensor
from splitspec.sync_debug import ENV, SyncCounter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")


def _waits(x: torch.Tensor) -> float:
    return x.sum().item()  # a copy of the sum back to the host: the host waits for the device


def _queues(x: torch.Tensor) -> torch.Tensor:
    return (x * 2).add_(1).index_select(0, device_tensor(list(range(8)), x.device))  # queued only: no wait


def test_a_host_wait_is_counted_where_it_was_called_and_queued_work_is_not(tmp_path, monkeypatch):
    path = tmp_path / "syncs.jsonl"
    monkeypatch.setenv(ENV, str(path))
    counter = SyncCounter.from_env("check")
    x = torch.ones(1024, device="cuda")
    counter.start()
    try:
        for _ in range(3):
            _waits(_queues(x))
            counter.step()
    finally:
        counter.stop()
    record = json.loads(path.read_text().splitlines()[-1])
    assert record["name"] == "check" and record["steps"] == 3
    waits = {site: count for site, count in record["sites"].items() if "_waits" in site}
    assert len(waits) == 1 and list(waits.values())[0] >= 3, record  # each .item() at least once, at its own site
    assert not any("_queues" in site for site in record["sites"]), record  # device_tensor and queued ops never wait

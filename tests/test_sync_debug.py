"""SPLITSPEC_SYNC_DEBUG's counter (splitspec/sync_debug.py) on a GPU: a synchronizing call is counted at its call site,
work the host only queues is not, and the counts land in the file."""

import json

import pytest
import torch

from splitspec.sync_debug import ENV, SyncCounter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")


def _waits(x: torch.Tensor) -> float:
    return x.sum().item()  # a copy of the sum back to the host: the host waits for the device


def test_a_host_wait_is_counted_where_it_was_called_and_queued_work_is_not(tmp_path, monkeypatch):
    path = tmp_path / "syncs.jsonl"
    monkeypatch.setenv(ENV, str(path))
    counter = SyncCounter.from_env("check")
    x = torch.ones(1024, device="cuda")
    counter.start()
    try:
        for _ in range(3):
            y = (x * 2).add_(1)  # queued only
            _waits(y)
            counter.step()
    finally:
        counter.stop()
    record = json.loads(path.read_text().splitlines()[-1])
    assert record["name"] == "check" and record["steps"] == 3
    sites = {site: count for site, count in record["sites"].items() if "_waits" in site}
    assert list(sites.values()) == [3], record
    assert record["syncs"] == 3, record  # nothing else waited

"""TieredBlockStore over CPU tensors: blocks saved to disk come back bit for bit (any cache
dtype), a host tier serves hits from memory, a damaged file is a miss, and a full slab drops
saves instead of waiting."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from pagedllm.core.prefix_tier import TierProbe, TierTransfer
from pagedllm.kv_tiers.disk import DiskTier
from pagedllm.kv_tiers.fingerprint import Fingerprint
from pagedllm.kv_tiers.host import HostSlab
from pagedllm.kv_tiers.store import TieredBlockStore

LAYERS, BLOCKS, HEADS, BS, HEAD = 3, 6, 2, 4, 8
FP = Fingerprint("12" * 16, {"format": 1})


def caches(dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(LAYERS):
        x = torch.randn((2, BLOCKS, HEADS, BS, HEAD), generator=gen)
        out.append(x.to(dtype))
    return out


def nbytes(dtype: torch.dtype) -> int:
    return LAYERS * 2 * HEADS * BS * HEAD * torch.empty((), dtype=dtype).element_size()


def store(
    root: Path | None, dtype: torch.dtype, *, slots: int = 8, keep_saved: bool = False
) -> TieredBlockStore:
    disk = None
    if root is not None:
        disk = DiskTier(
            root, FP, capacity_bytes=1 << 30, payload_nbytes=nbytes(dtype), layout={"dtype": "x"}
        )
    return TieredBlockStore(HostSlab(slots, nbytes(dtype)), disk, keep_saved=keep_saved)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_saved_blocks_come_back_from_disk_bit_for_bit(tmp_path: Path, dtype: torch.dtype) -> None:
    src = caches(dtype, 0)
    s = store(tmp_path, dtype)
    s.apply_saves(TierTransfer(1, saves=[(4, 40), (1, 10)]), src)
    assert s.drain(10)
    assert len(s.slab) == 0  # CPU: written slots are freed (no host tier)
    s.close()
    # A new process: the blocks are on disk only.
    s = store(tmp_path, dtype)
    assert s.probe([10, 99, 40]) == TierProbe(0, 1, False)  # a prefix walk: stops at 99
    assert s.probe([40, 10]) == TierProbe(0, 2, False)
    s.prefetch([40, 10])
    assert s.drain(10)
    assert s.probe([40, 10]) == TierProbe(2, 0, False)
    assert s.acquire([40, 10, 99]) == 2
    dst = caches(dtype, 1)
    s.apply_loads(TierTransfer(1, loads=[(40, 0), (10, 5)]), dst)
    for a, b in zip(src, dst, strict=True):
        assert same(a[:, 4], b[:, 0]) and same(a[:, 1], b[:, 5])
    assert s.counters.disk_hits == 2 and s.counters.host_hits == 0
    s.close()


def test_host_tier_serves_saved_blocks_from_memory(tmp_path: Path) -> None:
    src = caches(torch.float32, 0)
    s = store(None, torch.float32, keep_saved=True)  # a GPU's host tier without a disk
    s.save(src, [(2, 20)])
    assert s.probe([20]) == TierProbe(1, 0, False) and s.acquire([20]) == 1
    dst = caches(torch.float32, 1)
    s.load(dst, [(20, 3)])
    assert all(same(a[:, 2], b[:, 3]) for a, b in zip(src, dst, strict=True))
    assert s.counters.host_hits == 1 and len(s.slab) == 1  # kept for the next hit
    s.close()


def test_a_block_being_written_is_a_hit_from_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = caches(torch.float32, 0)
    s = store(tmp_path, torch.float32)
    go = threading.Event()
    write = s.disk.write
    monkeypatch.setattr(s.disk, "write", lambda key, data: go.wait(10) and write(key, data))
    s.save(src, [(1, 11)])
    assert s.probe([11]) == TierProbe(1, 0, False) and s.acquire([11]) == 1
    dst = caches(torch.float32, 1)
    s.load(dst, [(11, 0)])
    assert all(same(a[:, 1], b[:, 0]) for a, b in zip(src, dst, strict=True))
    assert not s.disk.contains(11)  # still being written
    go.set()
    assert s.drain(10) and s.disk.contains(11)
    s.close()


def test_a_damaged_file_is_a_miss_and_recomputed(tmp_path: Path) -> None:
    s = store(tmp_path, torch.float32)
    s.save(caches(torch.float32, 0), [(0, 5)])
    s.close()
    path = s.disk.path_of(5)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    s = store(tmp_path, torch.float32)
    s.prefetch([5])
    assert s.drain(10)
    assert s.probe([5]) == TierProbe(0, 0, False) and s.acquire([5]) == 0
    assert s.stats()["kv_tier_corrupt"] == 1 and not path.exists()
    s.close()


def test_full_slab_drops_saves_and_each_step_saves_once(tmp_path: Path) -> None:
    src = caches(torch.float32, 0)
    s = store(None, torch.float32, slots=2, keep_saved=True)
    s.acquire([])  # nothing
    s.save(src, [(0, 1), (1, 2)])
    assert s.acquire([1, 2]) == 2  # both pinned: nothing can be evicted
    s.apply_saves(TierTransfer(3, saves=[(2, 3)]), src)
    assert s.counters.saves_dropped == 1 and s.probe([3]) == TierProbe(0, 0, False)
    s.release([1, 2])
    s.apply_saves(TierTransfer(3, saves=[(2, 3)]), src)  # a retried step: not again
    assert s.probe([3]) == TierProbe(0, 0, False)
    s.apply_saves(TierTransfer(4, saves=[(2, 3)]), src)  # the next step evicts the LRU one
    assert s.probe([3]) == TierProbe(1, 0, False) and s.probe([1]) == TierProbe(0, 0, False)
    s.close()


def test_shutdown_saves_more_blocks_than_the_slab_holds(tmp_path: Path) -> None:
    src = caches(torch.float32, 0)
    s = store(tmp_path, torch.float32, slots=2)
    s.save_all(src, [(b, 100 + b) for b in range(BLOCKS)], timeout=10)
    s.close()
    assert all(s.disk.contains(100 + b) for b in range(BLOCKS))
    assert s.counters.saves_dropped == 0 and s.counters.stores == BLOCKS


def test_a_failed_copy_leaves_nothing_and_the_retry_saves(tmp_path: Path) -> None:
    s = store(tmp_path, torch.float32)
    broken = [c[:, :2] for c in caches(torch.float32, 0)]  # block 4 is out of range
    with pytest.raises((IndexError, RuntimeError)):
        s.apply_saves(TierTransfer(1, saves=[(4, 40)]), broken)
    assert len(s.slab) == 0 and not s._writing
    s.apply_saves(TierTransfer(1, saves=[(4, 40)]), caches(torch.float32, 0))  # the retry
    assert s.drain(10) and s.disk.contains(40)
    s.close()

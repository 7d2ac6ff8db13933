"""A weight file rewritten in place (same name, size, inode and modification time, changed
``v_proj`` weights, as a re-quantised or fine-tuned file of the same shapes is) gets a new
fingerprint: the disk tier never serves the old model's blocks, outputs equal a tier-off run."""

from __future__ import annotations

import json
import os
import shutil
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from pagedllm import Engine
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.kv_tiers import hashes
from tests.engine.test_kv_tiers import BASE, generate


def rewrite_in_place(path: Path) -> None:
    """Scale every ``v_proj`` weight by -2 in the file's own bytes, then put the times back."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        (hlen,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(hlen))
        for name, info in header.items():
            if not name.endswith("v_proj.weight"):
                continue
            assert info["dtype"] == "F32"
            start, end = info["data_offsets"]
            f.seek(8 + hlen + start)
            data = np.frombuffer(f.read(end - start), dtype=np.float32) * -2.0
            f.seek(8 + hlen + start)
            f.write(data.astype(np.float32).tobytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        st.st_ino,
        st.st_size,
        st.st_mtime_ns,
    )


def test_weights_rewritten_in_place_get_a_new_fingerprint(
    llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Remember digests at once (the 2 s settling rule would hide what this test is about: a
    # remembered digest must not be trusted after an in-place rewrite).
    monkeypatch.setattr(hashes, "SETTLE_SECONDS", 0.0)
    model, kv_dir = tmp_path / "model", tmp_path / "kv"
    shutil.copytree(llama_path, model)
    kwargs = dict(BASE, num_kv_blocks=64)
    engine = Engine(str(model), **kwargs, kv_cache_dir=str(kv_dir))
    old = generate(engine)
    engine.shutdown()  # the old model's blocks go to disk
    assert list(kv_dir.glob("*/*/*.kvb"))
    assert len(json.loads((kv_dir / hashes.CACHE_NAME).read_text())["entries"]) == 1

    rewrite_in_place(model / "model.safetensors")
    engine = Engine(str(model), **kwargs)
    off = generate(engine)
    engine.shutdown()
    assert off != old  # the rewrite changes what the model says

    engine = Engine(str(model), **kwargs, kv_cache_dir=str(kv_dir))
    on = generate(engine)
    stats = engine.get_stats()
    engine.shutdown()
    assert on == off
    assert stats["kv_tier_disk_hits"] == 0 and stats["kv_tier_reads"] == 0
    assert len([p for p in kv_dir.iterdir() if p.is_dir()]) == 2  # a new fingerprint's folder


def test_a_remembered_digest_is_not_hashed_again(
    llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hashes, "SETTLE_SECONDS", 0.0)
    kv_dir = tmp_path / "kv"
    engine = Engine(str(llama_path), **BASE, num_kv_blocks=64, kv_cache_dir=str(kv_dir))
    engine.shutdown()

    def no_hashing(*args: object, **kwargs: object) -> str:
        raise AssertionError("hashed again")

    monkeypatch.setattr(hashes, "file_digest", no_hashing)
    engine = Engine(str(llama_path), **BASE, num_kv_blocks=64, kv_cache_dir=str(kv_dir))
    assert engine.kv_tiers is not None and engine.kv_tiers.disk is not None
    engine.shutdown()


def _wait_for_disk(engine: LLMEngine) -> None:
    store = engine.kv_tiers
    assert store is not None
    deadline = time.monotonic() + 30
    while store.disk is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert store.disk is not None


def test_weights_past_the_bound_are_hashed_in_the_background(
    llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tier is off while the hash runs, then on; the engine serves throughout."""
    from pagedllm.kv_tiers import setup

    monkeypatch.setattr(setup, "SYNC_HASH_BYTES", -1)
    engine = Engine(str(llama_path), **BASE, num_kv_blocks=64, kv_cache_dir=str(tmp_path))
    _wait_for_disk(engine)
    generate(engine)
    engine.shutdown()
    # The second start knows the digest, but with the bound at -1 it still attaches the disk
    # tier from the background thread: wait for it, or the step may run before it is on.
    engine = Engine(str(llama_path), **BASE, num_kv_blocks=64, kv_cache_dir=str(tmp_path))
    _wait_for_disk(engine)
    generate(engine)
    assert engine.get_stats()["kv_tier_disk_hits"] > 0
    engine.shutdown()


def rewrite_gguf_in_place(path: Path) -> None:
    """Scale every ``attn_v`` weight of a float32 GGUF file by -2 in its own bytes (same name,
    size, inode), then put the times back."""
    from gguf import GGMLQuantizationType, GGUFReader

    st = os.stat(path)
    reader = GGUFReader(str(path))
    spans = []
    for t in reader.tensors:
        if t.name.endswith("attn_v.weight"):
            assert t.tensor_type == GGMLQuantizationType.F32
            spans.append((int(t.data_offset), int(t.n_bytes)))
    del reader  # its memory map
    assert spans
    with open(path, "r+b") as f:
        for offset, size in spans:
            f.seek(offset)
            data = np.frombuffer(f.read(size), dtype=np.float32) * -2.0
            f.seek(offset)
            f.write(data.astype(np.float32).tobytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        st.st_ino,
        st.st_size,
        st.st_mtime_ns,
    )


def test_a_gguf_file_replaced_in_place_gets_a_new_fingerprint(
    llama_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The issue's case: a GGUF served with the disk tier on, replaced by a file of the same name
    and size whose ``attn_v`` weights differ; the next start fingerprints it anew and its
    greedy outputs equal a tier-off run of the new file."""
    from tests.models.gguf_files import write_gguf

    monkeypatch.setattr(hashes, "SETTLE_SECONDS", 0.0)
    model, kv_dir = write_gguf(llama_path, tmp_path / "model.gguf"), tmp_path / "kv"
    kwargs = dict(BASE, num_kv_blocks=64, dtype="float32")

    def start(**more: object) -> Engine:
        return Engine(str(model), **kwargs, **more)

    engine = start(kv_cache_dir=str(kv_dir))
    old = generate(engine)
    fingerprint = engine.kv_tiers.disk.folder.name  # type: ignore[union-attr]
    engine.shutdown()
    assert list(kv_dir.glob("*/*/*.kvb"))

    rewrite_gguf_in_place(model)
    engine = start()
    off = generate(engine)
    engine.shutdown()
    assert off != old  # the new file's weights change what it says

    engine = start(kv_cache_dir=str(kv_dir))
    on = generate(engine)
    stats = engine.get_stats()
    assert engine.kv_tiers.disk.folder.name != fingerprint  # type: ignore[union-attr]
    engine.shutdown()
    assert on == off
    assert stats["kv_tier_disk_hits"] == 0 and stats["kv_tier_reads"] == 0

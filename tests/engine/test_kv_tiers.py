"""Lower KV tiers change speed, never tokens: greedy outputs with blocks reloaded from disk equal
those recomputed, under preemption, chunked prefill and swapping, and after a restart; damaged
files and other models' files are never read; no block leaks."""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedllm import Engine, SamplingParams
from pagedllm.engine_args import EngineArgs

PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
BASE: dict[str, Any] = dict(
    device="cpu",
    block_size=8,
    enable_prefix_caching=True,
    skip_tokenizer_init=True,
    max_model_len=128,
)


def conversation_prompts(n: int = 4, seed: int = 0) -> list[dict[str, list[int]]]:
    """Prompts that share prefixes (a system prompt, earlier turns), as a chat service sees."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 400) for _ in range(20)]
    out = []
    for i in range(n):
        turn = system + [rng.randrange(3, 400) for _ in range(20 + 5 * i)]
        out.append(turn)
        out.append(turn + [rng.randrange(3, 400) for _ in range(9)])
    return [{"prompt_token_ids": p} for p in out]


PROMPTS = conversation_prompts()


def generate(engine: Engine, prompts: list[Any] = PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(prompts, PARAMS, use_tqdm=False)]


def assert_all_free(engine: Engine) -> None:
    bm = engine.block_manager
    assert bm.get_num_free_device_blocks() == bm.num_device_blocks
    assert bm.get_num_free_host_blocks() == bm.num_host_blocks


def run_twice(path: Path, **kwargs: Any) -> tuple[list[list[int]], dict[str, float], Engine]:
    """Two passes over the prompts in one engine (the second finds its prefixes evicted)."""
    engine = Engine(str(path), **{**BASE, **kwargs})
    tokens = generate(engine) + generate(engine)
    stats = engine.get_stats()
    assert_all_free(engine)
    return tokens, stats, engine


SETTINGS = {
    "preempt-recompute": {"num_kv_blocks": 16, "preemption_mode": "recompute"},
    "chunked": {
        "num_kv_blocks": 18,
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": 32,
    },
    "swap": {
        "num_kv_blocks": 16,
        "preemption_mode": "swap",
        "enable_chunked_prefill": True,
        "max_num_batched_tokens": 64,
    },
}


@pytest.mark.parametrize("name", list(SETTINGS))
def test_reloaded_blocks_give_the_tokens_recompute_gives(
    llama_path: Path, tmp_path: Path, name: str
) -> None:
    settings = SETTINGS[name]
    off, off_stats, engine = run_twice(llama_path, **settings)
    engine.shutdown()
    on, stats, engine = run_twice(llama_path, kv_cache_dir=str(tmp_path), **settings)
    engine.shutdown()
    assert on == off
    assert stats["kv_tier_disk_hits"] > 0, stats
    assert stats["prompt_tokens_total"] < off_stats["prompt_tokens_total"]
    if "preemption_mode" in settings:
        assert stats["num_preemptions_total"] > 0, stats
    if name == "swap":
        assert stats["num_preemptions_swap"] > 0, stats
    if name == "chunked":
        assert stats["chunked_prefill_steps"] > 0, stats


@pytest.fixture(scope="module")
def reference(llama_path: Path) -> list[list[int]]:
    """Outputs with the prefix cache alone (one pass, a cache that never evicts)."""
    engine = Engine(str(llama_path), **BASE, num_kv_blocks=256)
    tokens = generate(engine)
    engine.shutdown()
    return tokens


def first_run(path: Path, kv_dir: Path) -> None:
    engine = Engine(str(path), **BASE, num_kv_blocks=64, kv_cache_dir=str(kv_dir))
    generate(engine)
    engine.shutdown()  # the device pool's cached blocks go to disk


def test_blocks_survive_a_restart(llama_path: Path, tmp_path: Path, reference: list) -> None:
    first_run(llama_path, tmp_path)
    engine = Engine(str(llama_path), **BASE, num_kv_blocks=64, kv_cache_dir=str(tmp_path))
    assert generate(engine) == reference
    stats = engine.get_stats()
    assert stats["kv_tier_disk_hits"] > 0 and stats["kv_tier_corrupt"] == 0
    total = sum(len(p["prompt_token_ids"]) for p in PROMPTS)
    assert stats["prompt_tokens_total"] < total / 3, stats  # most of every prompt was read back
    assert_all_free(engine)
    engine.shutdown()


def test_damaged_blocks_are_recomputed(llama_path: Path, tmp_path: Path, reference: list) -> None:
    first_run(llama_path, tmp_path)
    files = sorted(tmp_path.glob("*/*/*.kvb"))
    assert files
    for i, path in enumerate(files):  # one byte flipped, or cut short
        data = bytearray(path.read_bytes())
        if i % 2:
            data[-7] ^= 0x40
        else:
            data = data[: len(data) // 2]
        path.write_bytes(bytes(data))
    engine = Engine(str(llama_path), **BASE, num_kv_blocks=64, kv_cache_dir=str(tmp_path))
    assert generate(engine) == reference
    stats = engine.get_stats()
    assert stats["kv_tier_disk_hits"] == 0 and stats["kv_tier_corrupt"] > 0
    assert sum(not p.exists() for p in files) == stats["kv_tier_corrupt"]  # deleted
    assert_all_free(engine)
    engine.shutdown()


def _other_weights(llama_path: Path, folder: Path) -> Path:
    """The same model folder with one weight changed (same shapes, sizes and config)."""
    shutil.copytree(llama_path, folder)
    weights = load_file(folder / "model.safetensors")
    name = next(n for n in sorted(weights) if n.endswith("o_proj.weight"))
    weights[name] = weights[name] * 1.5
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("change", ["weights", "block_size", "dtype"])
def test_another_fingerprint_never_hits(
    llama_path: Path, tmp_path: Path, change: str, caplog: pytest.LogCaptureFixture
) -> None:
    kv_dir = tmp_path / "kv"
    first_run(llama_path, kv_dir)
    # A pool that never evicts: any read would be of the first run's blocks.
    path, kwargs = llama_path, dict(BASE, num_kv_blocks=256, kv_cache_dir=str(kv_dir))
    if change == "weights":
        path = _other_weights(llama_path, tmp_path / "other")
    elif change == "block_size":
        kwargs["block_size"] = 16
    else:
        kwargs["dtype"] = "bfloat16"
    with caplog.at_level(logging.WARNING):
        engine = Engine(str(path), **kwargs)
    assert [r for r in caplog.records if "other model" in r.getMessage()]
    generate(engine)
    stats = engine.get_stats()
    assert stats["kv_tier_disk_hits"] == 0 and stats["kv_tier_reads"] == 0
    engine.shutdown()
    assert len([p for p in kv_dir.iterdir() if p.is_dir()]) == 2  # a folder per fingerprint


def test_an_unusable_folder_warns_once_and_serves(
    llama_path: Path, tmp_path: Path, reference: list, caplog: pytest.LogCaptureFixture
) -> None:
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    with caplog.at_level(logging.WARNING):
        engine = Engine(str(llama_path), **BASE, num_kv_blocks=256, kv_cache_dir=str(not_a_folder))
        assert generate(engine) == reference
    assert len([r for r in caplog.records if "kv_cache_dir" in r.getMessage()]) == 1
    assert engine.kv_tiers is None
    engine.shutdown()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kv_cache_dir": "/tmp/x"}, "kv_cache_dir: lower KV tiers hold prefix-cache blocks"),
        ({"kv_offload_space": 2.0}, "kv_offload_space: lower KV tiers hold prefix-cache"),
        ({"kv_disk_space": 0}, "kv_disk_space: must be > 0"),
        ({"kv_offload_space": -1}, "kv_offload_space: must be >= 0"),
        ({"kv_cache_dir": "", "enable_prefix_caching": True}, "kv_cache_dir: must be a folder"),
        (
            {"kv_cache_dir": "/tmp/x", "enable_prefix_caching": True, "tensor_parallel_size": 2},
            "kv_cache_dir: lower KV tiers need one in-process worker",
        ),
    ],
)
def test_bad_tier_settings_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        EngineArgs.from_kwargs("m", **kwargs).create_config(model_max_len=64, device="cpu")


def test_loaded_blocks_hold_the_computed_values(llama_path: Path, tmp_path: Path) -> None:
    """The bytes a restart loads into the pool are the bytes the first run computed."""
    prompt = PROMPTS[-1]
    engine = Engine(str(llama_path), **BASE, num_kv_blocks=64, kv_cache_dir=str(tmp_path))
    generate(engine, [prompt])
    bm = engine.block_manager
    computed = {
        bm.device.hashes[b]: torch.stack(
            [c[:, b] for c in engine.executor.worker.cache_engine.kv_caches]
        )
        for b in range(bm.num_device_blocks)
        if bm.device.computed[b] and bm.device.hashes[b] is not None
    }
    engine.shutdown()
    engine = Engine(str(llama_path), **BASE, num_kv_blocks=64, kv_cache_dir=str(tmp_path))
    generate(engine, [prompt])
    bm = engine.block_manager
    caches = engine.executor.worker.cache_engine.kv_caches
    loaded = [b for b in range(bm.num_device_blocks) if bm.device.hashes[b] in computed]
    skippable = (len(prompt["prompt_token_ids"]) - 1) // 8  # all but the last token's block
    assert engine.get_stats()["kv_tier_disk_hits"] == skippable and len(loaded) >= skippable
    for b in loaded:
        assert torch.equal(torch.stack([c[:, b] for c in caches]), computed[bm.device.hashes[b]])
    engine.shutdown()

"""The packed-weight cache (``backends/cpu/pack_cache.py``): a second start of the same GGUF
maps the panels the first one packed, without packing or checking, and answers the same
tokens; a damaged file, a stale key and another build's ISA are not used; the flag turns it
off."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pagedllm import Engine, SamplingParams
from pagedllm.backends.cpu import dense_gemm, groupwise_linear, pack_cache
from pagedllm.kv_tiers import hashes
from tests.conftest import build_model
from tests.models.gguf_files import write_gguf

PROMPTS = [[5, 17, 99, 3, 44, 12, 7], list(range(20, 40))]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pack-cache")
    src = build_model(root / "llama", "llama")
    recipe = {"ffn_down": "Q8_0", "token_embd": "Q8_0"}  # a tied Q8_0 head over Q4_1 layers
    return write_gguf(src, root / "q4_1.gguf", recipe=recipe, default="Q4_1")


@pytest.fixture(scope="module")
def untied_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untied Q4_0 table beside its own Q8_0 head (as the 1B Llama-shaped files)."""
    root = tmp_path_factory.mktemp("pack-cache-untied")
    src = build_model(root / "llama", "llama", tie_word_embeddings=False)
    recipe = {"token_embd": "Q4_0", "output": "Q8_0"}
    return write_gguf(src, root / "untied.gguf", recipe=recipe, default="Q4_1")


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    if dense_gemm.gemm_ops() is None:
        pytest.skip("the C++ GEMM could not be built")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PAGEDLLM_PACKED_CACHE", "1")
    # The module's file is seconds old: a digest is remembered only for a file settled longer
    # than that, which made the remembered-digest check depend on how fast the tests ran.
    monkeypatch.setattr(hashes, "SETTLE_SECONDS", 0.0)
    return tmp_path / "packed"


@pytest.fixture
def packs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many layers were packed (one entry per ``pack_groupwise`` call)."""
    calls: list[int] = []
    real = groupwise_linear.pack_groupwise

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(groupwise_linear, "pack_groupwise", counting)
    return calls


def _greedy(path: Path, **kw: object) -> list[list[int]]:
    engine = Engine(str(path), device="cpu", block_size=8, num_kv_blocks=32, **kw)
    outs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    engine.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


def _files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.packed.pt"))


def test_a_second_start_maps_the_panels_and_answers_the_same(
    gguf_file: Path, folder: Path, packs: list[int]
) -> None:
    first = _greedy(gguf_file)
    packed = len(packs)
    assert packed > 0 and len(_files(folder)) == 1
    assert _greedy(gguf_file) == first
    assert len(packs) == packed  # nothing packed again
    # The file's digest was remembered by its identity (the KV tiers' fingerprint): the second
    # start did not hash the file again.
    assert (folder / "weights-sha256.json").exists()


def test_a_fused_layer_of_several_formats_maps_its_runs_panels_too(
    tmp_path: Path, folder: Path, packs: list[int]
) -> None:
    """q and k Q4_1 beside an F16 v, gate Q4_1 beside a Q8_0 up (as llama.cpp's Q*_K_M files
    keep v and down): each group-wise run's panels are cached under the run's module name and
    mapped by the next start (the dense run is built from its weight as always), answers
    equal."""
    src = build_model(tmp_path / "llama", "llama")
    recipe = {"attn_v": "F16", "ffn_up": "Q8_0"}
    path = write_gguf(src, tmp_path / "mixed.gguf", recipe=recipe, default="Q4_1")
    uncached = _greedy(path, disable_packed_cache=True)
    first = _greedy(path)
    packed = len(packs)
    assert first == uncached and len(_files(folder)) == 1
    data = torch.load(_files(folder)[0], weights_only=True)
    assert any(name.endswith("qkv_proj.parts.0") for name in data["layers"]), data["layers"]
    assert any(name.endswith("gate_up_proj.parts.1") for name in data["layers"])
    assert not any(name.endswith("qkv_proj.parts.1") for name in data["layers"])  # dense: F16
    assert _greedy(path) == uncached
    assert len(packs) == packed  # no run packed again


def test_a_cached_start_leaves_the_cached_layers_unread(
    gguf_file: Path, folder: Path, packs: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second start decodes no tensor of a layer whose panels are cached: those weights
    stay meta placeholders (no storage: nothing read them) until the panels replace them, and
    the answers equal an uncached start's."""
    from pagedllm.backends.cpu import packed_linear
    from pagedllm.models.gguf import weights as gguf_weights

    uncached = _greedy(gguf_file, disable_packed_cache=True)
    assert _greedy(gguf_file) == uncached  # the first start packs and writes the cache
    decoded: list[str] = []
    real_decode = gguf_weights.GGUFWeights._decoded
    monkeypatch.setattr(
        gguf_weights.GGUFWeights,
        "_decoded",
        lambda self, t: decoded.append(t.name) or real_decode(self, t),
    )
    placeholders: dict[str, bool] = {}
    real_pack = packed_linear.pack_linear_layers

    def pack(model, **kw):
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if name.endswith(("_proj", "qkv_proj")) and weight is not None:
                placeholders[name] = weight.is_meta
        return real_pack(model, **kw)

    monkeypatch.setattr(packed_linear, "pack_linear_layers", pack)
    packed = len(packs)
    assert _greedy(gguf_file) == uncached
    assert len(packs) == packed
    assert placeholders and all(placeholders.values()), placeholders
    assert not any(".attn_" in n or ".ffn_" in n for n in decoded), decoded


def _table_rows(gguf_file: Path) -> tuple[torch.Tensor, list[str]]:
    """Every row of the embedding table as the engine reads it (float32 model), and the GGUF
    tensors this start decoded."""
    from pagedllm.models.gguf import weights as gguf_weights

    decoded: list[str] = []
    real_decode = gguf_weights.GGUFWeights._decoded

    def decode(self: gguf_weights.GGUFWeights, t: object) -> object:
        decoded.append(t.name)  # type: ignore[attr-defined]
        return real_decode(self, t)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_weights.GGUFWeights, "_decoded", decode)
        engine = Engine(str(gguf_file), device="cpu", dtype="float32", num_kv_blocks=16)
    model = engine.executor.worker.runner.model  # type: ignore[attr-defined]
    table = model.embed_tokens
    assert table.fast_rows_packed is not None  # read back from panels, the head's or its own
    assert table.weight.numel() == 0  # the panels are the only copy
    rows = table(torch.arange(table.vocab_size)).clone()
    engine.shutdown()
    return rows, decoded


@pytest.mark.parametrize("tied", [True, False], ids=["tied-q8_0-head", "untied-q4_0-table"])
def test_the_table_comes_from_the_cache_bit_for_bit(
    gguf_file: Path, untied_file: Path, folder: Path, tied: bool
) -> None:
    """A cached start leaves the embedding table unread (the file's table is not decoded at
    all), a tied head's (Q8_0) or an untied table (Q4_0, packed for its rows alone): its rows
    come back from the cached panels, equal bit for bit to ggml's own dequantisation of the
    file's table (the ``gguf`` package), as they are on the start that decoded and packed
    it."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    path = gguf_file if tied else untied_file
    table = next(t for t in GGUFReader(path).tensors if t.name == "token_embd.weight")
    want = torch.from_numpy(dequantize(table.data, table.tensor_type).astype("float32"))
    first, decoded_first = _table_rows(path)
    assert "token_embd.weight" in decoded_first and len(_files(folder)) == 1
    second, decoded_second = _table_rows(path)
    assert "token_embd.weight" not in decoded_second
    assert not any(".attn_" in n or ".ffn_" in n for n in decoded_second), decoded_second
    assert want.shape == first.shape
    assert torch.equal(first, want) and torch.equal(second, want)


def test_a_cached_start_runs_on_the_mapped_file(gguf_file: Path, folder: Path) -> None:
    """The second start's panels are the cache file's pages, mapped (nothing copied into
    fresh memory): the file is among the process's mappings while the engine lives, and the
    answers equal the start that packed it."""
    first = _greedy(gguf_file)
    (cached,) = _files(folder)
    engine = Engine(str(gguf_file), device="cpu", block_size=8, num_kv_blocks=32)
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc/self/maps here")
    assert str(cached) in maps.read_text()
    outs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == first
    engine.shutdown()


def test_a_damaged_file_is_refused_and_rebuilt(
    gguf_file: Path, folder: Path, packs: list[int], caplog: pytest.LogCaptureFixture
) -> None:
    first = _greedy(gguf_file)
    (cached,) = _files(folder)
    data = cached.read_bytes()
    for damaged in (data[: len(data) // 2], b"not a zip" + data[9:]):
        cached.write_bytes(damaged)
        before = len(packs)
        with caplog.at_level(logging.WARNING, logger="pagedllm.backends.cpu.pack_cache"):
            assert _greedy(gguf_file) == first
        assert len(packs) > before  # packed again
        assert sum("refused" in r.message for r in caplog.records) == 1
        caplog.clear()
        assert _files(folder) == [cached] and cached.read_bytes() != damaged  # rewritten
    before = len(packs)
    assert _greedy(gguf_file) == first and len(packs) == before  # the rebuilt file serves


def test_another_build_or_a_stale_key_is_not_reused(
    gguf_file: Path, folder: Path, packs: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _greedy(gguf_file)
    packed = len(packs)
    ops = dense_gemm.gemm_ops()

    class OtherIsa:
        def __getattr__(self, name: str):
            return getattr(ops, name)

        def built_isa(self) -> str:
            return "other"

    monkeypatch.setattr(dense_gemm, "gemm_ops", lambda: OtherIsa())
    assert _greedy(gguf_file) == first
    assert len(packs) == 2 * packed and len(_files(folder)) == 2  # one file per ISA
    monkeypatch.setattr(dense_gemm, "gemm_ops", lambda: ops)
    monkeypatch.setattr(pack_cache, "LAYOUT_VERSION", pack_cache.LAYOUT_VERSION + 1)
    assert _greedy(gguf_file) == first
    assert len(packs) == 3 * packed  # a new layout version: packed again, not mapped


def test_the_flag_and_the_environment_turn_it_off(
    gguf_file: Path, folder: Path, packs: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    _greedy(gguf_file, disable_packed_cache=True)
    assert not _files(folder)
    monkeypatch.setenv("PAGEDLLM_PACKED_CACHE", "0")
    _greedy(gguf_file)
    assert not _files(folder)


def test_the_folder_is_bounded(tmp_path: Path) -> None:
    import os

    names = [tmp_path / f"{i}.packed.pt" for i in range(4)]
    for i, p in enumerate(names):
        p.write_bytes(b"x" * 100)
        os.utime(p, (i, i))  # 0 the least recently used
    pack_cache.bound_folder(tmp_path, 250, keep=names[0])
    assert sorted(tmp_path.glob("*.packed.pt")) == [names[0], names[3]]

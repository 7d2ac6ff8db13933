"""Broken and hostile GGUF files are refused in one line, cheaply, before anything is loaded.

A tiny llama GGUF is written with ggml's ``gguf`` package, then altered: through the writer
(metadata and tensors a converter could have written wrong) and by editing bytes (what a
truncated download or a hostile file holds). Each altered file goes through what an engine
start checks (``summary.describe``, which ``pagedllm inspect`` prints): it must raise
``GGUFFileError`` whose one line names the file and the key or tensor at fault, within 2 s of
CPU and 300 MB of traced memory. A hypothesis fuzz flips and cuts bytes of the same file: the
checks either refuse it with ``GGUFFileError`` or pass (a flip inside tensor data), never
another exception. Nothing here loads an engine: the checks are what stands before one.
"""

from __future__ import annotations

import math
import struct
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType, GGUFWriter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.config import env_fuzz_examples
from pagedllm.entrypoints.cli import main
from pagedllm.models.gguf.reader import GGUFFileError
from pagedllm.models.gguf.summary import describe

HIDDEN, HEADS, KV_HEADS, HEAD, FFN, BLOCKS = 64, 4, 2, 16, 128, 2
LETTERS = [chr(c) for c in range(ord("a"), ord("z") + 1)]
TOKENS = ["<s>", "</s>", *LETTERS, "ab", "cd", "ef", "abcd"]  # 32
MERGES = ["a b", "c d", "e f", "ab cd"]
VOCAB = len(TOKENS)
U32, U64, I32, F32, STR = (
    GGUFValueType.UINT32,
    GGUFValueType.UINT64,
    GGUFValueType.INT32,
    GGUFValueType.FLOAT32,
    GGUFValueType.STRING,
)


def _metadata() -> dict[str, tuple[Any, GGUFValueType]]:
    return {
        "llama.context_length": (256, U32),
        "llama.embedding_length": (HIDDEN, U32),
        "llama.block_count": (BLOCKS, U32),
        "llama.feed_forward_length": (FFN, U32),
        "llama.attention.head_count": (HEADS, U32),
        "llama.attention.head_count_kv": (KV_HEADS, U32),
        "llama.attention.layer_norm_rms_epsilon": (1e-6, F32),
        "llama.rope.freq_base": (10000.0, F32),
        "llama.rope.dimension_count": (HEAD, U32),
        "tokenizer.ggml.model": ("gpt2", STR),
        "tokenizer.ggml.bos_token_id": (0, U32),
        "tokenizer.ggml.eos_token_id": (1, U32),
        "tokenizer.chat_template": ("{% for m in messages %}{{ m['content'] }}{% endfor %}", STR),
    }


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    out = {"token_embd.weight": w(VOCAB, HIDDEN), "output_norm.weight": np.ones(HIDDEN, "f4")}
    for i in range(BLOCKS):
        b = f"blk.{i}"
        out |= {
            f"{b}.attn_norm.weight": np.ones(HIDDEN, "f4"),
            f"{b}.attn_q.weight": w(HEADS * HEAD, HIDDEN),
            f"{b}.attn_k.weight": w(KV_HEADS * HEAD, HIDDEN),
            f"{b}.attn_v.weight": w(KV_HEADS * HEAD, HIDDEN),
            f"{b}.attn_output.weight": w(HIDDEN, HEADS * HEAD),
            f"{b}.ffn_norm.weight": np.ones(HIDDEN, "f4"),
            f"{b}.ffn_gate.weight": w(FFN, HIDDEN),
            f"{b}.ffn_up.weight": w(FFN, HIDDEN),
            f"{b}.ffn_down.weight": w(HIDDEN, FFN),
        }
    return out


def write_tiny(
    path: Path,
    *,
    meta: dict[str, Any] | None = None,
    tensors: dict[str, np.ndarray | None] | None = None,
    tokens: list[str] | None = None,
    merges: list[str] | None = None,
    scores: int | None = None,
    arch: str = "llama",
) -> Path:
    """The tiny llama file, with ``meta`` keys replaced (a value, ``(value, type)``, or None
    to drop the key) and ``tensors`` replaced (None drops one)."""
    writer = GGUFWriter(str(path), arch)
    fields = _metadata()
    for key, value in (meta or {}).items():
        if value is None:
            fields.pop(key, None)
        else:
            fields[key] = value if isinstance(value, tuple) else (value, fields[key][1])
    for key, (value, vtype) in fields.items():
        writer.add_key_value(key, value, vtype)
    toks = TOKENS if tokens is None else tokens
    writer.add_token_list(toks)
    writer.add_token_types([3 if t.startswith("<") else 1 for t in toks])
    writer.add_token_merges(MERGES if merges is None else merges)
    if scores is not None:
        writer.add_token_scores([0.0] * scores)
    weights = _tensors()
    for name, value in (tensors or {}).items():
        if value is None:
            weights.pop(name)
        else:
            weights[name] = value
    for name, value in weights.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# (file name, how it is made from the good file's path and the new path, what the message names)
Case = tuple[str, Callable[[Path, Path], Path], str]


def _edit(edit: Callable[[bytearray, GGUFReader], None]) -> Callable[[Path, Path], Path]:
    def make(good: Path, out: Path) -> Path:
        data = bytearray(good.read_bytes())
        edit(data, GGUFReader(str(good)))
        out.write_bytes(bytes(data))
        return out

    return make


def _written(**kw: Any) -> Callable[[Path, Path], Path]:
    return lambda good, out: write_tiny(out, **kw)


def _put(data: bytearray, offset: int, fmt: str, value: Any) -> None:
    data[offset : offset + struct.calcsize(fmt)] = struct.pack(fmt, value)


def _field_value_offset(reader: GGUFReader, key: str) -> int:
    """Where the value of ``key`` starts (after its key string and type)."""
    field = reader.fields[key]
    return field.offset + 8 + len(key.encode()) + 4


def _tensor_field(reader: GGUFReader, name: str) -> tuple[int, int]:
    """(the byte of the tensor entry's dimension count, its number of dimensions)."""
    field = next(t.field for t in reader.tensors if t.name == name)
    at = field.offset + 8 + len(name.encode())
    return at, int(field.parts[2][0])


def _set_dim(name: str, index: int, value: int) -> Callable[[bytearray, GGUFReader], None]:
    def edit(data: bytearray, reader: GGUFReader) -> None:
        at, _ = _tensor_field(reader, name)
        _put(data, at + 4 + 8 * index, "<Q", value)

    return edit


def _after_dims(name: str, extra: int, fmt: str, value: Any) -> Any:
    """Edit the field ``extra`` bytes after the tensor's dimensions (0: type, 4: offset)."""

    def edit(data: bytearray, reader: GGUFReader) -> None:
        at, n_dims = _tensor_field(reader, name)
        _put(data, at + 4 + 8 * n_dims + extra, fmt, value)

    return edit


def _tensor_offset_of(reader: GGUFReader, name: str) -> int:
    t = next(t for t in reader.tensors if t.name == name)
    return int(t.data_offset) - int(reader.data_offset)


def _deep_nesting(depth: int) -> Callable[[bytearray, GGUFReader], None]:
    """A new first metadata entry: ``depth`` arrays nested in one another, padded to the
    alignment so that every other byte of the file still lines up."""

    def edit(data: bytearray, reader: GGUFReader) -> None:
        body = b"".join(struct.pack("<IQ", 9, 1) for _ in range(depth)) + struct.pack("<IQ", 0, 0)
        key_len = 5
        while (8 + key_len + 4 + len(body)) % 32:
            key_len += 1
        entry = struct.pack("<Q", key_len) + b"x" * key_len + struct.pack("<I", 9) + body
        kv_count = struct.unpack_from("<Q", data, 16)[0]
        _put(data, 16, "<Q", kv_count + 1)
        data[24:24] = entry

    return edit


def _truncate(where: Callable[[GGUFReader, int], int]) -> Callable[[bytearray, GGUFReader], None]:
    def edit(data: bytearray, reader: GGUFReader) -> None:
        del data[where(reader, len(data)) :]

    return edit


def _cases() -> list[Case]:
    nan, inf = float("nan"), float("inf")
    q_shape = np.zeros((HEADS * HEAD - 16, HIDDEN), "f4")
    cases: list[Case] = [
        # Truncations at several points.
        ("cut-magic.gguf", _edit(_truncate(lambda r, n: 3)), "GGUF"),
        ("cut-header.gguf", _edit(_truncate(lambda r, n: 12)), "past the end"),
        (
            "cut-in-tokens.gguf",
            _edit(_truncate(lambda r, n: r.fields["tokenizer.ggml.tokens"].offset + 60)),
            "tokenizer.ggml.tokens",
        ),
        (
            "cut-in-tensor-infos.gguf",
            _edit(_truncate(lambda r, n: r.tensors[3].field.offset + 10)),
            "GGUF.tensor_count",
        ),
        ("cut-at-data.gguf", _edit(_truncate(lambda r, n: int(r.data_offset))), "truncated"),
        ("cut-last-tensor.gguf", _edit(_truncate(lambda r, n: n - 100)), "blk.1.ffn_down.weight"),
        # Absurd counts and lengths.
        ("kv-count.gguf", _edit(lambda d, r: _put(d, 16, "<Q", 2**60)), "GGUF.kv_count"),
        ("tensor-count.gguf", _edit(lambda d, r: _put(d, 8, "<Q", 2**60)), "GGUF.tensor_count"),
        (
            "key-length.gguf",
            _edit(lambda d, r: _put(d, 24, "<Q", 2**63)),
            "metadata entry 0",
        ),
        (
            "array-length.gguf",
            _edit(
                lambda d, r: _put(
                    d, _field_value_offset(r, "tokenizer.ggml.tokens") + 4, "<Q", 2**62
                )
            ),
            "tokenizer.ggml.tokens",
        ),
        (
            "string-length.gguf",
            _edit(
                lambda d, r: _put(d, _field_value_offset(r, "tokenizer.ggml.model"), "<Q", 2**40)
            ),
            "tokenizer.ggml.model",
        ),
        (
            # A length so large that the offset after it no longer fits an index (the fast
            # scan's OverflowError, found by the fuzz test below): still one line.
            "token-string-length.gguf",
            _edit(
                lambda d, r: _put(
                    d, _field_value_offset(r, "tokenizer.ggml.tokens") + 12, "<Q", 2**63
                )
            ),
            "tokenizer.ggml.tokens",
        ),
        (
            "name-length.gguf",
            _edit(lambda d, r: _put(d, r.tensors[0].field.offset, "<Q", 2**50)),
            "string",
        ),
        ("nested-20000.gguf", _edit(_deep_nesting(20_000)), "xxxxx"),
        # Unknown types.
        (
            "value-type.gguf",
            _edit(lambda d, r: _put(d, _field_value_offset(r, "llama.block_count") - 4, "<I", 99)),
            "llama.block_count",
        ),
        (
            "array-item-type.gguf",
            _edit(lambda d, r: _put(d, _field_value_offset(r, "tokenizer.ggml.tokens"), "<I", 77)),
            "tokenizer.ggml.tokens",
        ),
        (
            "tensor-type.gguf",
            _edit(_after_dims("blk.0.attn_q.weight", 0, "<I", 200)),
            "blk.0.attn_q.weight",
        ),
        # Shapes and dimensions.
        ("dim-zero.gguf", _edit(_set_dim("blk.0.attn_k.weight", 1, 0)), "blk.0.attn_k.weight"),
        ("dim-huge.gguf", _edit(_set_dim("blk.0.attn_v.weight", 1, 2**40)), "blk.0.attn_v.weight"),
        (
            "dims-many.gguf",
            _edit(lambda d, r: _put(d, _tensor_field(r, "output_norm.weight")[0], "<I", 9)),
            "output_norm.weight",
        ),
        (
            "dims-none.gguf",
            _edit(lambda d, r: _put(d, _tensor_field(r, "output_norm.weight")[0], "<I", 0)),
            "output_norm.weight",
        ),
        # Offsets.
        (
            "offset-max.gguf",
            _edit(_after_dims("blk.1.attn_v.weight", 4, "<Q", 2**64 - 1)),
            "blk.1.attn_v.weight",
        ),
        (
            "offset-misaligned.gguf",
            _edit(
                lambda d, r: _after_dims(
                    "blk.0.ffn_up.weight", 4, "<Q", _tensor_offset_of(r, "blk.0.ffn_up.weight") + 4
                )(d, r)
            ),
            "blk.0.ffn_up.weight's data offset",
        ),
        (
            "offset-overlap.gguf",
            _edit(
                lambda d, r: _after_dims(
                    "blk.1.attn_q.weight", 4, "<Q", _tensor_offset_of(r, "blk.1.attn_k.weight")
                )(d, r)
            ),
            "overlaps",
        ),
        # Required tensors, per the architecture.
        (
            "no-attn-k.gguf",
            _written(tensors={"blk.1.attn_k.weight": None}),
            "blk.1.attn_k.weight is missing",
        ),
        ("no-ffn-gate.gguf", _written(tensors={"blk.0.ffn_gate.weight": None}), "blk.0.ffn_gate"),
        ("no-embedding.gguf", _written(tensors={"token_embd.weight": None}), "token_embd.weight"),
        ("no-output-norm.gguf", _written(tensors={"output_norm.weight": None}), "output_norm"),
        ("arch.gguf", _written(arch="bloom"), "general.architecture 'bloom'"),
        (
            "no-place.gguf",
            _written(tensors={"blk.0.attn_zz.weight": np.ones(HIDDEN, "f4")}),
            "'blk.0.attn_zz.weight' has no place in a llama",
        ),
        # Hyper-parameters.
        ("heads-0.gguf", _written(meta={"llama.attention.head_count": 0}), "head_count is 0"),
        (
            "kv-heads-3.gguf",
            _written(meta={"llama.attention.head_count_kv": 3}),
            "llama.attention.head_count_kv 3",
        ),
        ("kv-heads-0.gguf", _written(meta={"llama.attention.head_count_kv": 0}), "head_count_kv"),
        ("blocks-1e6.gguf", _written(meta={"llama.block_count": 1_000_000}), "llama.block_count"),
        ("blocks-3.gguf", _written(meta={"llama.block_count": 3}), "blk.2.attn_norm.weight"),
        ("blocks-1.gguf", _written(meta={"llama.block_count": 1}), "llama.block_count is 1"),
        ("blocks-none.gguf", _written(meta={"llama.block_count": None}), "llama.block_count"),
        ("context-0.gguf", _written(meta={"llama.context_length": 0}), "llama.context_length"),
        (
            "context-2e40.gguf",
            _written(meta={"llama.context_length": (2**40, U64)}),
            "llama.context_length",
        ),
        ("rope-nan.gguf", _written(meta={"llama.rope.freq_base": nan}), "freq_base is nan"),
        ("rope-negative.gguf", _written(meta={"llama.rope.freq_base": -1.0}), "freq_base"),
        ("rope-zero.gguf", _written(meta={"llama.rope.freq_base": 0.0}), "freq_base"),
        ("rope-inf.gguf", _written(meta={"llama.rope.freq_base": inf}), "freq_base"),
        (
            "rope-dims-odd.gguf",
            _written(meta={"llama.rope.dimension_count": 17}),
            "llama.rope.dimension_count",
        ),
        (
            "eps-nan.gguf",
            _written(meta={"llama.attention.layer_norm_rms_epsilon": nan}),
            "layer_norm_rms_epsilon is nan",
        ),
        (
            "eps-negative.gguf",
            _written(meta={"llama.attention.layer_norm_rms_epsilon": -1e-6}),
            "layer_norm_rms_epsilon",
        ),
        (
            "width.gguf",
            _written(meta={"llama.embedding_length": 48, "llama.rope.dimension_count": 12}),
            "output_norm.weight",
        ),
        ("ffn.gguf", _written(meta={"llama.feed_forward_length": 96}), "blk.0.ffn_gate.weight"),
        ("q-width.gguf", _written(tensors={"blk.1.attn_q.weight": q_shape}), "blk.1.attn_q"),
        (
            "head-rows.gguf",
            _written(tensors={"output.weight": np.zeros((VOCAB - 2, HIDDEN), "f4")}),
            "output.weight",
        ),
        # Vocabulary and tokenizer.
        ("tokens-short.gguf", _written(tokens=TOKENS[:-2]), "tokenizer.ggml.tokens"),
        ("vocab-size.gguf", _written(meta={"llama.vocab_size": (40, U32)}), "llama.vocab_size"),
        (
            "embedding-rows.gguf",
            _written(tensors={"token_embd.weight": np.zeros((VOCAB + 8, HIDDEN), "f4")}),
            "token_embd.weight",
        ),
        ("scores.gguf", _written(scores=VOCAB - 1), "tokenizer.ggml.scores"),
        (
            "merges-unknown.gguf",
            _written(tokens=[*TOKENS[:-1], "zz"]),
            "tokenizer.ggml.merges entry 3",
        ),
        ("merges-malformed.gguf", _written(merges=["abc"]), "tokenizer.ggml.merges entry 0"),
        (
            "bos-out.gguf",
            _written(meta={"tokenizer.ggml.bos_token_id": 999}),
            "tokenizer.ggml.bos_token_id",
        ),
        (
            "eos-negative.gguf",
            _written(meta={"tokenizer.ggml.eos_token_id": (-1, I32)}),
            "tokenizer.ggml.eos_token_id",
        ),
    ]
    return cases


CASES = _cases()
_MAX_CPU_S = 2.0
_MAX_TRACED = 300 << 20


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("hostile") / "good.gguf")


def test_the_tiny_file_passes_and_is_described(good: Path) -> None:
    lines = describe(good)
    assert "llama" in lines[0] and any(f"{VOCAB} tokens" in line for line in lines)


def test_at_least_forty_altered_files() -> None:
    assert len(CASES) >= 40


@pytest.mark.parametrize(("name", "make", "names"), CASES, ids=[c[0] for c in CASES])
def test_altered_file_is_refused_in_one_line_cheaply(
    good: Path, tmp_path: Path, name: str, make: Callable[[Path, Path], Path], names: str
) -> None:
    path = make(good, tmp_path / name)
    tracemalloc.start()
    cpu = time.process_time()
    try:
        with pytest.raises(GGUFFileError) as info:
            describe(path)
        cpu = time.process_time() - cpu
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert "\n" not in message and str(path) in message, message
    assert names in message, message
    for leak in ("out of bounds", "cannot reshape", "Traceback", "index 0"):
        assert leak not in message, message
    assert cpu < _MAX_CPU_S, f"{name}: {cpu:.2f} s of CPU"
    assert peak < _MAX_TRACED, f"{name}: {peak >> 20} MB traced"


def test_inspect_exits_0_or_1_with_one_line(
    good: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["inspect", str(good)]) == 0
    out = capsys.readouterr().out
    assert "tensors: 20 (20 F32)" in out and "chat template:" in out
    bad = write_tiny(tmp_path / "no-attn-k.gguf", tensors={"blk.0.attn_k.weight": None})
    assert main(["inspect", str(bad)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(str(bad)) and "blk.0.attn_k.weight is missing" in err
    assert len(err.splitlines()) == 1


def test_inspect_verifies_the_whole_file_against_a_digest(
    good: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import hashlib

    digest = hashlib.sha256(good.read_bytes()).hexdigest()
    assert main(["inspect", str(good), "--verify-sha256", digest]) == 0
    assert "(matches)" in capsys.readouterr().out
    data = bytearray(good.read_bytes())
    data[-5] ^= 0xFF  # inside the last tensor's data: every check passes, the digest does not
    flipped = tmp_path / "flipped.gguf"
    flipped.write_bytes(bytes(data))
    assert main(["inspect", str(flipped)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(flipped), "--verify-sha256", digest]) == 1
    assert "sha256 is" in capsys.readouterr().err


def test_a_huge_context_under_the_hard_bound_is_capped_with_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from pagedllm.models.gguf.checks import MAX_CONTEXT, _capped
    from pagedllm.models.gguf.reader import GGUFFile

    gguf = GGUFFile(write_tiny(tmp_path / "long.gguf"))
    with caplog.at_level("WARNING"):
        capped = _capped(gguf, MAX_CONTEXT, rotary_dim=1 << 20)
    assert 0 < capped < MAX_CONTEXT and "capped at" in caplog.text
    assert _capped(gguf, 4096, rotary_dim=128) == 4096


@pytest.fixture(scope="module")
def good_bytes(good: Path) -> tuple[bytes, int]:
    """The file, and where its tensor data starts (flips land before it half the time: the
    header is a few percent of the file, and where every check lives)."""
    return good.read_bytes(), int(GGUFReader(str(good)).data_offset)


@settings(
    max_examples=env_fuzz_examples(200),
    deadline=2000,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_fuzzed_bytes_are_refused_or_pass_never_another_error(
    good_bytes: tuple[bytes, int], tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    blob, header = bytearray(good_bytes[0]), good_bytes[1]
    where = st.one_of(st.integers(0, header - 1), st.integers(0, len(blob) - 1))
    flips = data.draw(st.lists(st.tuples(where, st.integers(1, 255)), min_size=0, max_size=4))
    for at, mask in flips:
        blob[at] ^= mask
    if data.draw(st.booleans()):
        del blob[data.draw(st.integers(0, len(blob))) :]
    path = tmp_path_factory.mktemp("fuzz") / "fuzzed.gguf"
    path.write_bytes(bytes(blob))
    cpu = time.process_time()
    try:
        describe(path)
    except GGUFFileError as exc:
        assert "\n" not in str(exc) and str(path) in str(exc)
    assert time.process_time() - cpu < _MAX_CPU_S
    assert math.isfinite(cpu)


def test_an_engine_start_runs_the_same_checks(tmp_path: Path) -> None:
    """What an engine asks of a GGUF file first (its config, its tokenizer) refuses as
    ``inspect`` does, before any weight is read."""
    from pagedllm.models.gguf.loading import gguf_config, gguf_tokenizer

    nan_rope = write_tiny(tmp_path / "rope.gguf", meta={"llama.rope.freq_base": float("nan")})
    with pytest.raises(GGUFFileError, match="llama.rope.freq_base is nan"):
        gguf_config(nan_rope)
    no_k = write_tiny(tmp_path / "no-k.gguf", tensors={"blk.0.attn_k.weight": None})
    with pytest.raises(GGUFFileError, match="blk.0.attn_k.weight is missing"):
        gguf_config(no_k)
    merges = write_tiny(tmp_path / "merges.gguf", tokens=[*TOKENS[:-1], "zz"])
    with pytest.raises(GGUFFileError, match="tokenizer.ggml.merges entry 3"):
        gguf_tokenizer(merges)

"""Our GGUF header parser (``bounded_reader.GGUFHeader``, no ``gguf`` import) reads every
metadata field and tensor as the stock ``gguf.GGUFReader`` reads it, on files of every kind the
tests write (quantised mixes, BERT, mixture-of-experts) and on the demo file where it is cached;
it refuses big-endian files and truncated arrays with one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import (
    GGML_QUANT_SIZES,
    GGMLQuantizationType,
    GGUFEndian,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
)

from pagedllm.models.gguf.bounded_reader import GGUFHeader
from pagedllm.models.gguf.ggml_types import BLOCK_SIZES, GGMLType, ValueType
from pagedllm.models.gguf.reader import GGUFFile
from pagedllm.models.safetensors_reader import CheckpointError

VOCAB = ["<s>", "</s>", "héllo", "▁world", "🚀", "", "a b"] * 50


def _write(path: Path, endian: GGUFEndian = GGUFEndian.LITTLE) -> Path:
    w = GGUFWriter(str(path), "llama", endianess=endian)
    w.add_uint32("test.u32", 7)
    w.add_int8("test.i8", -3)
    w.add_float32("test.f32", 0.25)
    w.add_float64("test.f64", -1.5)
    w.add_bool("test.bool", True)
    w.add_string("test.str", "plain ✓")
    w.add_array("test.tokens", VOCAB)
    w.add_array("test.scores", [float(i) / 3 for i in range(len(VOCAB))])
    w.add_array("test.types", [i % 5 for i in range(len(VOCAB))])
    w.add_key_value("test.i64s", [-(2**40), 2**40], GGUFValueType.ARRAY, GGUFValueType.INT64)
    w.add_array("test.flags", [True, False, True])
    w.add_array("test.empty", [])
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_array("test.nested_strings", [["a", "bc"], ["déf"]])
    w.add_uint32("general.alignment", 64)
    w.add_tensor("t", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.add_tensor("h", np.arange(96, dtype=np.float16).reshape(3, 32))
    w.add_tensor("i", np.arange(5, dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def assert_reads_as_the_stock_reader(path: Path) -> None:
    """Every field (key, offset, types, contents) and tensor (name, type, dimensions, where its
    data lies, its data's type, shape and bytes) of ``path`` as ``gguf.GGUFReader`` has it."""
    stock, ours = GGUFReader(str(path)), GGUFHeader(path)
    assert list(stock.fields) == list(ours.fields)
    for key, field in stock.fields.items():
        mine = ours.fields[key]
        assert mine.contents() == field.contents(), key
        assert (mine.offset, mine.name, mine.types) == (field.offset, field.name, field.types)
        if field.types[0] == GGUFValueType.ARRAY and len(field.types) == 2:
            assert mine.count == len(field.data), key
    assert (ours.alignment, ours.data_offset) == (int(stock.alignment), int(stock.data_offset))
    assert ours.size == path.stat().st_size
    assert len(ours.tensors) == len(stock.tensors)
    for mine, theirs in zip(ours.tensors, stock.tensors, strict=True):
        assert mine.name == theirs.name
        assert (mine.qtype, mine.qtype.name) == (theirs.tensor_type, theirs.tensor_type.name)
        assert mine.dims == tuple(int(d) for d in theirs.shape), mine.name
        assert (mine.data_offset, mine.n_bytes) == (theirs.data_offset, theirs.n_bytes)
        assert mine.entry_offset == theirs.field.offset, mine.name
        assert mine.offset == int(theirs.field.parts[5][0]), mine.name
        assert (mine.data.dtype, mine.data.shape) == (theirs.data.dtype, theirs.data.shape)
        assert mine.data.tobytes() == theirs.data.tobytes(), mine.name
        assert not mine.data.flags.writeable, mine.name


def test_every_field_and_tensor_reads_as_the_stock_reader_reads_it(tmp_path: Path) -> None:
    path = _write(tmp_path / "all.gguf")
    assert_reads_as_the_stock_reader(path)
    stock, ours = GGUFReader(str(path)), GGUFHeader(path)
    assert ours.fields["test.tokens"].contents() == VOCAB
    tokens = ours.fields["test.tokens"]  # decoded when asked, one string or a slice
    for pick in (0, 7, -1, slice(3, 9), slice(None, None, 5), slice(4, 4)):
        assert tokens.contents(pick) == stock.fields["test.tokens"].contents(pick), pick
    for key, pick in (("test.scores", 5), ("test.nested", 2), ("test.nested_strings", 2)):
        assert ours.fields[key].contents(pick) == stock.fields[key].contents(pick), key
    assert ours.fields["test.i64s"].contents() == [-(2**40), 2**40]
    assert ours.fields["test.nested_strings"].contents() == ["a", "bc", "déf"]
    assert (ours.fields["test.tokens"].count, ours.fields["test.u32"].count) == (len(VOCAB), None)
    assert ours.alignment == 64 and ours.data_offset % 64 == 0


def test_our_type_tables_are_ggmls() -> None:
    """The tables are ours (importing ``gguf`` costs a start 0.2-0.3 s); ggml's numbers."""
    assert {t.name: int(t) for t in GGMLType} == {t.name: int(t) for t in GGMLQuantizationType}
    assert {t.name: s for t, s in BLOCK_SIZES.items()} == {
        t.name: s for t, s in GGML_QUANT_SIZES.items()
    }
    assert {t.name: int(t) for t in ValueType} == {t.name: int(t) for t in GGUFValueType}


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Files the other GGUF tests write: quantised mixes, a BERT, mixtures of experts."""
    from tests.conftest import build_model
    from tests.models.gguf_bert_files import write_bert_gguf
    from tests.models.gguf_files import write_gguf
    from tests.models.moe_models import build_moe
    from tests.models.test_gguf_bert import build_bert

    root = tmp_path_factory.mktemp("reader-files")
    llama = build_model(root / "llama", "llama")
    wide = build_model(
        root / "wide", "llama", hidden_size=256, intermediate_size=512, num_attention_heads=4
    )
    moe = build_moe(root / "mixtral", "mixtral", hidden_size=256, intermediate_size=256)
    k_mix = {"attn_v": "Q6_K", "ffn_down": "Q5_K", "token_embd": "Q6_K", "attn_k": "Q3_K"}
    return {
        "f16": write_gguf(llama, root / "f16.gguf", default="F16"),
        "bf16": write_gguf(llama, root / "bf16.gguf", default="BF16"),
        "q4_1+q8_0": write_gguf(
            llama, root / "q41.gguf", recipe={"ffn_down": "Q8_0"}, default="Q4_1"
        ),
        "q4_k_m": write_gguf(wide, root / "q4km.gguf", recipe=k_mix, default="Q4_K"),
        "iq4_xs": write_gguf(
            wide, root / "iq4.gguf", recipe={"attn_v": "IQ4_NL", "ffn_up": "Q2_K"}, default="IQ4_XS"
        ),
        "bert": write_bert_gguf(build_bert(root / "bert"), root / "bert.gguf", kind="Q8_0"),
        "moe": write_gguf(
            moe,
            root / "moe.gguf",
            recipe={"ffn_down_exps": "Q6_K", "ffn_gate_inp": "F32"},
            default="Q4_K",
        ),
    }


@pytest.mark.parametrize("name", ["f16", "bf16", "q4_1+q8_0", "q4_k_m", "iq4_xs", "bert", "moe"])
def test_written_files_read_as_the_stock_reader_reads_them(
    written: dict[str, Path], name: str
) -> None:
    assert_reads_as_the_stock_reader(written[name])


def test_the_demo_file_reads_as_the_stock_reader_reads_it() -> None:
    from pagedllm.entrypoints.demo_model import _is_complete, model_path

    path = model_path()
    if not _is_complete(path):
        pytest.skip(f"the demo file is not cached at {path}")
    assert_reads_as_the_stock_reader(path)


def test_a_big_endian_file_is_refused_with_one_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "be.gguf", GGUFEndian.BIG)
    with pytest.raises(CheckpointError, match="big-endian") as info:
        GGUFFile(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)


def test_a_string_array_cut_short_is_refused_with_one_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "all.gguf")
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: data.index("héllo".encode()) + 2])  # inside the vocabulary
    with pytest.raises(CheckpointError, match="test.tokens: an array of 350 string") as info:
        GGUFFile(cut)
    assert str(cut) in str(info.value) and "\n" not in str(info.value)


def test_an_empty_file_is_refused_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match="GGUF header") as info:
        GGUFFile(path)
    assert str(path) in str(info.value) and "\n" not in str(info.value)

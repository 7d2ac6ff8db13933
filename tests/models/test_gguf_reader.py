"""Our GGUF reader (``gguf.GGUFReader`` with arrays split in one pass) reads every metadata field
as the stock reader does, in either byte order, and refuses truncated arrays with one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter

from pagedllm.models.gguf.bounded_reader import BoundedReader
from pagedllm.models.gguf.reader import GGUFFile
from pagedllm.models.safetensors_reader import CheckpointError

VOCAB = ["<s>", "</s>", "héllo", "▁world", "🚀", "", "a b"] * 50


def _write(path: Path, endian: GGUFEndian) -> Path:
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
    w.add_array("test.nested", [[1, 2], [3]])
    w.add_tensor("t", np.arange(64, dtype=np.float32).reshape(2, 32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("endian", [GGUFEndian.LITTLE, GGUFEndian.BIG], ids=["le", "be"])
def test_every_field_reads_as_the_stock_reader_reads_it(tmp_path: Path, endian) -> None:
    path = str(_write(tmp_path / "all.gguf", endian))
    stock, ours = GGUFReader(path), BoundedReader(path)
    assert list(stock.fields) == list(ours.fields)
    for key, field in stock.fields.items():
        mine = ours.fields[key]
        assert mine.contents() == field.contents(), key
        assert (mine.offset, mine.name, mine.types[0]) == (field.offset, field.name, field.types[0])
    assert ours.fields["test.tokens"].contents() == VOCAB
    tokens = ours.fields["test.tokens"]  # decoded when asked, one string or a slice
    for pick in (0, 7, -1, slice(3, 9), slice(None, None, 5), slice(4, 4)):
        assert tokens.contents(pick) == stock.fields["test.tokens"].contents(pick), pick
    assert ours.fields["test.i64s"].contents() == [-(2**40), 2**40]
    assert [(t.name, int(t.data_offset)) for t in ours.tensors] == [
        (t.name, int(t.data_offset)) for t in stock.tensors
    ]
    assert np.array_equal(ours.tensors[0].data, stock.tensors[0].data)


def test_a_string_array_cut_short_is_refused_with_one_line(tmp_path: Path) -> None:
    path = _write(tmp_path / "all.gguf", GGUFEndian.LITTLE)
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: data.index("héllo".encode()) + 2])  # inside the vocabulary
    with pytest.raises(CheckpointError, match="test.tokens: an array of 350 string") as info:
        GGUFFile(cut)
    assert str(cut) in str(info.value) and "\n" not in str(info.value)

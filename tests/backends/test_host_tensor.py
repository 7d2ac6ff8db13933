"""``kv_layout.host_tensor``: a step's Python int lists as tensors through a C array, equal to
``torch.tensor`` of the same list (the input ids, positions, slot mapping and the metadata's
int32 block)."""

from __future__ import annotations

import pytest
import torch

from pagedllm.backends.kv_layout import build_attention_metadata, host_tensor


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    "values",
    [[], [0], [-1, 5, 7], list(range(1000)), [2**31 - 1, -(2**31)]],
    ids=["empty", "one", "negative", "long", "int32-bounds"],
)
def test_equals_torch_tensor(values: list[int], dtype: torch.dtype) -> None:
    got = host_tensor(values, dtype, torch.device("cpu"))
    want = torch.tensor(values, dtype=dtype)
    assert got.dtype == dtype and got.shape == want.shape and torch.equal(got, want)


def test_int64_holds_what_int32_cannot_and_int32_refuses_it() -> None:
    big = [2**40, -(2**40)]
    assert host_tensor(big, torch.int64, torch.device("cpu")).tolist() == big
    with pytest.raises(OverflowError):
        host_tensor(big, torch.int32, torch.device("cpu"))


def test_metadata_fields_are_those_of_the_lists() -> None:
    meta = build_attention_metadata(
        num_prefills=1,
        seq_lens=[5, 9],
        query_lens=[5, 1],
        slot_mapping=[16, 17, 18, 19, 20, 40],
        block_tables=[[1], [2, 3]],
        block_size=16,
        device=torch.device("cpu"),
    )
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.slot_mapping.tolist() == [16, 17, 18, 19, 20, 40]
    assert meta.block_tables.tolist() == [[1, 0], [2, 3]]
    assert meta.seq_lens.tolist() == [5, 9] and meta.context_lens.tolist() == [0, 8]
    assert meta.query_start_loc.tolist() == [0, 5, 6]

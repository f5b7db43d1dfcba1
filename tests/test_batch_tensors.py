"""A batch's tensors from its requests' (handlers/batch_tensors.py): rows concatenated, a
variable dim padded to the longest with its lengths beside it, outputs split back per request."""
import numpy as np
import pytest

from mcpd.handlers import batch_tensors
from mcpd.handlers.tensors import TensorSpec
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError

SPECS = {"ids": TensorSpec("INT64", (-1, -1)), "features": TensorSpec("FP32", (-1, 2))}


def test_a_variable_dim_is_padded_to_the_longest_with_each_rows_length():
    first = {"ids": np.array([[1, 2, 3]]), "features": np.ones((1, 2), np.float32)}
    second = {"ids": np.array([[4, 5, 6, 7, 8], [9, 9, 9, 9, 9]]), "features": np.zeros((2, 2), np.float32)}
    batch, padded, total = batch_tensors.assemble([first, second], SPECS)
    np.testing.assert_array_equal(batch["ids"], [[1, 2, 3, 0, 0], [4, 5, 6, 7, 8], [9, 9, 9, 9, 9]])
    np.testing.assert_array_equal(batch["ids.lengths"], [3, 5, 5])
    assert batch["features"].shape == (3, 2) and "features.lengths" not in batch
    assert (padded, total) == (2, 15)
    assert [batch_tensors.length_of(r, SPECS) for r in (first, second)] == [3, 5]


def test_bytes_pad_with_empty_elements_and_a_preprocessed_input_counts_as_variable():
    requests = [{"text": np.array([[b"a"]], object)}, {"text": np.array([[b"b", b"c"]], object)}]
    batch, padded, _ = batch_tensors.assemble(requests, {})
    assert batch["text"].tolist() == [[b"a", b""], [b"b", b"c"]] and padded == 1


def test_outputs_split_back_per_request_and_a_wrong_row_count_is_internal():
    parts = batch_tensors.split({"score": np.arange(5.0)}, [2, 3])
    assert [p["score"].tolist() for p in parts] == [[0.0, 1.0], [2.0, 3.0, 4.0]]
    for outputs in ({"score": np.arange(4.0)}, [np.arange(5.0)], {"score": np.float32(1)}):
        with pytest.raises(MCPDError) as e:
            batch_tensors.split(outputs, [2, 3])
        assert e.value.code == codes.INTERNAL

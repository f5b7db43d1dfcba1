"""Named tensors from a request: every hostile header or frame is BAD_INPUT naming the input, and
nothing is allocated from a peer's numbers."""
import numpy as np
import pytest

from mcpd.handlers import tensors
from mcpd.handlers.tensors import TensorHeader, TensorSpec
from mcpd.protocol import codes
from mcpd.protocol.codes import MCPDError


@pytest.mark.parametrize("array", [
    np.arange(12, dtype=np.float32).reshape(3, 4), np.array([[1, -2]], np.int64), np.array([True, False]),
    np.array([[0.5]], np.float16), np.arange(5, dtype=np.uint8), np.array([b"ab", b"", "\u00e9".encode()], object),
])
def test_round_trip(array):
    header, frame = tensors.encode("x", array)
    back = tensors.decode(header, frame)
    assert back.dtype == array.dtype and back.shape == array.shape and (back == array).all()


def test_big_endian_arrays_are_sent_little_endian():
    header, frame = tensors.encode("x", np.array([1, 2], ">i4"))
    assert header.datatype == "INT32" and frame == np.array([1, 2], "<i4").tobytes()


@pytest.mark.parametrize("header, frame, says", [
    (TensorHeader("x", "FP32", (1 << 20, 1 << 20)), b"1234", "4398046511104 bytes"),   # a 2^40-element shape
    (TensorHeader("x", "FP32", (2, 3)), bytes(20), "its frame has 20"),
    (TensorHeader("x", "BF16", (1,)), bytes(2), "datatype 'BF16'"),
    (TensorHeader("x", "FP32", ()), b"", "a shape is"),
    (TensorHeader("x", "FP32", (-1,)), b"", "a shape is"),
    (TensorHeader("x", "FP32", (1,) * 9), bytes(4), "a shape is"),
    (TensorHeader("x", "BYTES", (1 << 20, 1 << 20)), bytes(8), "cannot fit"),
    (TensorHeader("x", "BYTES", (1,)), b"\xff\xff\xff\x00ab", "runs past the frame"),
    (TensorHeader("x", "BYTES", (1,)), b"\x01\x00\x00\x00ab", "after its 1 elements"),
    (TensorHeader("x", "BYTES", (2,)), b"\x02\x00\x00\x00ab\x00\x00", "ends inside"),
])
def test_hostile_tensors_are_bad_input(header, frame, says):
    with pytest.raises(MCPDError) as e:
        tensors.decode(header, frame)
    assert e.value.code == codes.BAD_INPUT and says in e.value.message and "'x'" in e.value.message


def test_a_spec_checks_datatype_and_fixed_dims():
    spec = TensorSpec("FP32", (-1, 4))
    spec.check("x", np.zeros((7, 4), np.float32))
    for wrong in (np.zeros((7, 4), np.float64), np.zeros((7, 5), np.float32), np.zeros((7, 4, 1), np.float32)):
        with pytest.raises(MCPDError) as e:
            spec.check("x", wrong)
        assert e.value.code == codes.BAD_INPUT


def test_a_spec_declares_its_batch_dim():
    with pytest.raises(ValueError):
        TensorSpec("FP32", (4,))
    with pytest.raises(ValueError):
        TensorSpec("FLOAT", (-1,))

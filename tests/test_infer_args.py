"""The infer op's arguments as the front-end checks them (protocol/ops.py, infer_args.py):
typed once, every malformed or hostile value refused with its code before any frame is read."""
import pytest

from mcpd.handlers.tensor_header import TensorHeader
from mcpd.protocol import codes, infer_args, ops
from mcpd.protocol.args import ContextAppend, InferArgs
from mcpd.protocol.codes import MCPDError
from mcpd.protocol.limits import LimitsConfig

LIMITS = LimitsConfig()
FEATURES = {"name": "features", "datatype": "FP32", "shape": [2, 256]}


def refused(args: dict) -> MCPDError:
    with pytest.raises(MCPDError) as e:
        ops.validate_args("infer", args, LIMITS)
    return e.value


def test_args_become_typed_with_their_defaults():
    args = ops.validate_args("infer", {"model": "risk", "inputs": [FEATURES], "outputs": ["score"],
                                       "context": "u1", "context_append": {"window": {"input": "features", "window": 8}}},
                             LIMITS)
    assert args == InferArgs(inputs=(TensorHeader("features", "FP32", (2, 256)),), outputs=("score",), model="risk",
                             context="u1", context_append={"window": ContextAppend("features", 8)})
    assert args.cache is True and args.version is None and args.rows == 2


@pytest.mark.parametrize("inputs, code, words", [
    ([{**FEATURES, "datatype": "BF16"}], codes.BAD_INPUT, "datatype 'BF16'"),
    ([{**FEATURES, "datatype": "float"}], codes.BAD_INPUT, "datatype 'float'"),
    ([{**FEATURES, "shape": [1 << 40, 1]}], codes.BAD_INPUT, "integers 0..2147483647"),
    ([{**FEATURES, "shape": [1 << 20, 1 << 20]}], codes.BAD_INPUT, "more than 16777216 elements"),
    ([{**FEATURES, "shape": [1 << 24, 2]}], codes.BAD_INPUT, "more than 16777216 elements"),
    ([{**FEATURES, "shape": [-1, 256]}], codes.BAD_INPUT, "integers 0.."),
    ([{**FEATURES, "shape": []}], codes.BAD_INPUT, "a shape is 1..8"),
    ([{**FEATURES, "shape": [1] * 9}], codes.BAD_INPUT, "a shape is 1..8"),
    ([{**FEATURES, "shape": [1.0, 2]}], codes.BAD_INPUT, "integers"),
    ([{**FEATURES, "shape": [True, 2]}], codes.BAD_INPUT, "integers"),
    ([{**FEATURES, "shape": "2x256"}], codes.BAD_REQUEST, '"shape" a list'),
    ([FEATURES, FEATURES], codes.BAD_REQUEST, "unique"),
    ([{**FEATURES, "name": ""}], codes.BAD_REQUEST, "unique strings of 1..64"),
    ([{**FEATURES, "name": "x" * 65}], codes.BAD_REQUEST, "unique strings of 1..64"),
    ([{**FEATURES, "extra": 1}], codes.BAD_REQUEST, 'exactly "name", "datatype" and "shape"'),
    (["features"], codes.BAD_REQUEST, "each input must be a map"),
    ([{**FEATURES, "name": f"in{i}"} for i in range(16)], codes.BAD_REQUEST, "at most 15"),
])
def test_hostile_inputs_are_refused_naming_what_is_wrong(inputs, code, words):
    error = refused({"model": "risk", "inputs": inputs})
    assert error.code == code and words in error.message, error.message


@pytest.mark.parametrize("args, words", [
    ({}, "at least one input"),
    ({"inputs": []}, "at least one input"),
    ({"inputs": [FEATURES], "context_inputs": {"profile": "profile"}}, "need 'context'"),
    ({"inputs": [FEATURES], "outputs": []}, "1..64 unique names"),
    ({"inputs": [FEATURES], "outputs": ["a", "a"]}, "1..64 unique names"),
    ({"inputs": [FEATURES], "context": "c", "context_append": {"f": {"input": "features", "window": 0}}}, "window"),
    ({"inputs": [FEATURES], "context": "c", "context_append": {"f": {"input": "features"}}}, "window"),
    ({"inputs": [FEATURES], "context": "c", "context_append": {"f": {"input": "other", "window": 2}}}, "not sent"),
    ({"inputs": [FEATURES], "context": "c", "context_inputs": {"features": "f"}}, "both sent and read"),
    ({"inputs": [FEATURES], "cache": 1}, "'cache' has the wrong type"),
    ({"inputs": [FEATURES], "hints": {"go_fast": True}}, "prefer_speed"),
    ({"inputs": [FEATURES], "stream": True}, "unknown argument"),
])
def test_bad_arguments_are_refused(args, words):
    error = refused(args)
    assert error.code in (codes.BAD_REQUEST, codes.BAD_INPUT) and words in error.message, error.message


def test_each_sent_input_needs_its_frame():
    args = ops.validate_args("infer", {"inputs": [FEATURES]}, LIMITS)
    infer_args.check_frames(args, 1)
    for frames in (0, 2):
        with pytest.raises(MCPDError) as e:
            infer_args.check_frames(args, frames)
        assert e.value.code == codes.BAD_INPUT and f"with {frames} payload frame(s)" in e.value.message

"""The Open Inference Protocol (KServe v2) codec (socket-free): bodies written by the real
`tritonclient` package into the infer op's args and frames (the frames compared with
handlers/tensors.py's own encoding), the op's replies into responses that tritonclient reads back,
and every hostile body refused with a 400 naming what is wrong, before anything is allocated."""
import gc
import json

import numpy as np
import pytest
from tritonclient.http import InferenceServerClient, InferInput, InferRequestedOutput

from mcpd.handlers import tensors
from mcpd.http import kserve
from mcpd.http.errors import HttpError
from mcpd.protocol import codes

FEATURES = np.arange(12, dtype=np.float32).reshape(2, 6) / 7


def triton_body(inputs: dict[str, np.ndarray], binary: bool = True, outputs=None, **kwargs) -> tuple[bytes, str | None]:
    """The body and Inference-Header-Content-Length tritonclient sends for these inputs."""
    described = []
    for name, array in inputs.items():
        item = InferInput(name, list(array.shape), tensors.datatype_of(array))
        item.set_data_from_numpy(array, binary_data=binary)
        described.append(item)
    body, json_size = InferenceServerClient.generate_request_body(described, outputs=outputs, **kwargs)
    return body, None if json_size is None else str(json_size)


def expected_frames(inputs: dict[str, np.ndarray]) -> tuple[list[dict], list[bytes]]:
    headers, frames = [], []
    for name, array in inputs.items():
        header, frame = tensors.encode(name, array)
        headers.append(header.describe())
        frames.append(frame)
    return headers, frames


def json_body(inputs: list[dict], **extra) -> bytes:
    return json.dumps({"inputs": inputs, **extra}).encode()


def refused(body: bytes, header_length: str | None = None) -> HttpError:
    with pytest.raises(HttpError) as caught:
        kserve.infer_request(body, header_length, "m", None)
    assert caught.value.status == 400
    return caught.value


MIXED = {"features": FEATURES, "ids": np.array([[1, -2, 3]], np.int64), "mask": np.array([True, False]),
         "half": np.array([0.5, -1.25], np.float16), "small": np.array([-128, 127], np.int8),
         "bytes": np.array([b"ab", b"", "d\u00e9".encode()], object).reshape(3, 1)}


# -- requests --------------------------------------------------------------------------------------

@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_bodies_become_the_infer_ops_args_and_frames(binary):
    body, header_length = triton_body(MIXED, binary=binary)
    request = kserve.infer_request(body, header_length, "risk", "v2")
    headers, frames = expected_frames(MIXED)
    assert request.args == {"model": "risk", "version": "v2", "inputs": headers}
    assert request.payload == frames
    assert request.binary_output   # tritonclient asks for binary outputs when it names none


def test_nested_json_data_is_taken_in_row_major_order():
    nested = kserve.infer_request(json_body([{"name": "x", "datatype": "FP32", "shape": [2, 6],
                                              "data": FEATURES.tolist()}]), None, "m", None)
    assert nested.payload == [FEATURES.tobytes()]


def test_the_garbage_collector_is_back_on_after_a_body_is_taken_or_refused():
    """Decoding holds the cyclic GC off (kserve._no_gc_passes); it must not stay off for the process."""
    assert gc.isenabled()
    kserve.infer_request(json_body([{"name": "x", "datatype": "FP32", "shape": [2, 6], "data": FEATURES.tolist()}]),
                         None, "m", None)
    assert gc.isenabled()
    refused(json_body([{"name": "x", "datatype": "FP32", "shape": [2, 6], "data": [[1.0], 2.0]}]))
    assert gc.isenabled()


def test_request_parameters_become_mcpd_args_and_outputs_say_how_they_come_back():
    outputs = [InferRequestedOutput("score", binary_data=False), InferRequestedOutput("label")]
    body, header_length = triton_body({"x": FEATURES}, outputs=outputs, request_id="r-1",
                                      parameters={"routing_key": "user-7", "prefer_speed": True, "cache": False,
                                                  "context": "u7", "context_inputs": {"profile": "vector"}})
    request = kserve.infer_request(body, header_length, "m", None)
    assert request.args["outputs"] == ["score", "label"]
    assert (request.args["routing_key"], request.args["hints"], request.args["cache"]) == ("user-7",
                                                                                          {"prefer_speed": True}, False)
    assert (request.args["context"], request.args["context_inputs"]) == ("u7", {"profile": "vector"})
    assert "version" not in request.args and request.id == "r-1"
    assert not request.wants_binary("score") and request.wants_binary("label")
    assert not request.wants_binary("unnamed")   # binary_data_output is not set when outputs are named


def test_no_inputs_sent_when_context_inputs_stand_for_every_one():
    request = kserve.infer_request(json.dumps({"inputs": [], "parameters": {
        "context": "u7", "context_inputs": {"features": "profile"}}}).encode(), None, "m", None)
    assert (request.args["inputs"], request.payload) == ([], [])
    assert request.args["context_inputs"] == {"features": "profile"}


def test_null_parameters_and_id_are_absent_ones():
    body = json_body([{"name": "x", "datatype": "INT32", "shape": [1], "data": [5], "parameters": None}],
                     outputs=[{"name": "y", "parameters": None}], parameters=None, id=None)
    request = kserve.infer_request(body, None, "m", None)
    assert request.args == {"model": "m", "inputs": [{"name": "x", "datatype": "INT32", "shape": [1]}],
                            "outputs": ["y"]}
    assert request.id is None and not request.wants_binary("y")


# -- responses -------------------------------------------------------------------------------------

def daemon_reply(outputs: dict[str, np.ndarray], **extra) -> tuple[dict, list[bytes]]:
    headers, frames = expected_frames(outputs)
    return {"model": "risk", "version": "v1", "outputs": headers, "cached": False, **extra}, frames


@pytest.mark.parametrize("binary", [True, False])
def test_the_reply_reads_back_in_tritonclient_as_the_daemons_arrays(binary):
    result, frames = daemon_reply(MIXED, context_version=4)
    request = kserve.InferRequest({}, [], "r-9", binary_output=binary)
    body, headers = kserve.infer_response(result, frames, request)
    assert (kserve.HEADER_LENGTH in headers) == binary
    parsed = InferenceServerClient.parse_response_body(body, header_length=headers.get(kserve.HEADER_LENGTH))
    for name, array in MIXED.items():
        got = parsed.as_numpy(name)
        if name == "bytes" and not binary:   # JSON carries BYTES as strings
            got = np.vectorize(str.encode, otypes=[object])(got)
        assert got.shape == array.shape and (got == array).all() and got.dtype.kind == array.dtype.kind, name
    response = parsed.get_response()
    assert (response["model_name"], response["model_version"], response["id"]) == ("risk", "v1", "r-9")
    assert response["parameters"] == {"cached": False, "context_version": 4}


def test_bytes_that_are_not_utf8_come_back_binary_even_when_json_is_asked():
    raw = np.array([b"\xff\xfe", b"ok"], object)
    result, frames = daemon_reply({"blob": raw, "score": np.array([1.5, 2.5], np.float32)})
    body, headers = kserve.infer_response(result, frames, kserve.InferRequest({}, []))
    parsed = InferenceServerClient.parse_response_body(body, header_length=headers[kserve.HEADER_LENGTH])
    assert list(parsed.as_numpy("blob")) == [b"\xff\xfe", b"ok"]
    assert parsed.get_output("score")["data"] == [1.5, 2.5]


def test_a_reply_whose_frames_do_not_match_its_outputs_is_an_internal_error():
    result, frames = daemon_reply({"score": np.array([1.5], np.float32)})
    with pytest.raises(HttpError) as caught:
        kserve.infer_response(result, frames + [b"x"], kserve.InferRequest({}, []))
    assert (caught.value.status, caught.value.code) == (500, codes.INTERNAL)


def test_the_error_body_is_oips_with_mcpds_code():
    assert json.loads(kserve.error_body("input 'x': bad", codes.BAD_INPUT)) == {"error": "input 'x': bad",
                                                                               "code": "BAD_INPUT"}


# -- hostile bodies ----------------------------------------------------------------------------------

def binary_body(inputs: list[dict], data: bytes) -> tuple[bytes, str]:
    head = json_body(inputs)
    return head + data, str(len(head))


@pytest.mark.parametrize("body, header_length, code, says", [
    (b"{not json", None, codes.BAD_REQUEST, "not valid JSON"),
    (b"[]", None, codes.BAD_REQUEST, "JSON object"),
    (json_body([]), None, codes.BAD_REQUEST, "non-empty"),
    (json_body([], parameters={"context_inputs": {}}), None, codes.BAD_REQUEST, "non-empty"),
    (json.dumps({"parameters": {"context_inputs": {"x": "f"}}}).encode(), None, codes.BAD_REQUEST, "non-empty"),
    (b'{"inputs": "x"}', None, codes.BAD_REQUEST, "'inputs' must be an array"),
    (json_body([{"name": "x", "datatype": "BF16", "shape": [1], "data": [1.0]}]), None, codes.BAD_INPUT, "BF16"),
    (json_body([{"name": "x", "datatype": "FP32", "shape": [1, -1], "data": [1.0]}]), None, codes.BAD_INPUT,
     "a shape is 1..8 integers"),
    (json_body([{"name": "x", "datatype": "FP32", "shape": [], "data": [1.0]}]), None, codes.BAD_INPUT,
     "a shape is 1..8 integers"),
    (json_body([{"name": "x", "datatype": "FP32", "shape": "2", "data": [1.0]}]), None, codes.BAD_INPUT,
     "a shape is 1..8 integers"),
    (json_body([{"name": "x" * 65, "datatype": "FP32", "shape": [1], "data": [1.0]}]), None, codes.BAD_REQUEST,
     "1..64 characters"),
    (json_body([{"name": "x", "datatype": "FP32", "shape": [2, 3], "data": [1.0] * 5}]), None, codes.BAD_INPUT,
     "5 elements; its shape has 6"),
    (json_body([{"name": "x", "datatype": "INT32", "shape": [2], "data": [1, True]}]), None, codes.BAD_INPUT,
     "integers"),
    (json_body([{"name": "x", "datatype": "FP32", "shape": [1], "data": ["1"]}]), None, codes.BAD_INPUT, "numbers"),
    (json_body([{"name": "x", "datatype": "INT8", "shape": [1], "data": [128]}]), None, codes.BAD_INPUT,
     "does not fit INT8"),
    (json_body([{"name": "x", "datatype": "INT64", "shape": [1], "data": [1 << 63]}]), None, codes.BAD_INPUT,
     "does not fit INT64"),
    (json_body([{"name": "x", "datatype": "BYTES", "shape": [1], "data": ["\ud800"]}]), None, codes.BAD_REQUEST,
     "not valid JSON"),   # a lone surrogate: no UTF-8 string
    (json_body([{"name": "x", "datatype": "FP32", "shape": [1]}]), None, codes.BAD_INPUT, "either 'data'"),
    (json_body([{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0],
                 "parameters": {"binary_data_size": 4}}]), None, codes.BAD_INPUT, "not both"),
    (json_body([{"name": "x", "datatype": "FP32", "shape": [1], "data": [1.0]}],
               outputs=[{"name": "y", "parameters": {"classification": 3}}]), None, codes.BAD_REQUEST,
     "classification"),
    (b"{}", "12", codes.BAD_REQUEST, "the body has 2 bytes"),
    (b"{}", "-1", codes.BAD_REQUEST, "ASCII digits"),
    (b"{}", "\u0662", codes.BAD_REQUEST, "ASCII digits"),
    (*binary_body([{"name": "x", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 9}}],
                  b"\0" * 8), codes.BAD_INPUT, "runs past"),
    (*binary_body([{"name": "x", "datatype": "FP32", "shape": [3], "parameters": {"binary_data_size": 8}}],
                  b"\0" * 8), codes.BAD_INPUT, "is 12 bytes; binary_data_size is 8"),
    (*binary_body([{"name": "x", "datatype": "FP32", "shape": [2], "parameters": {"binary_data_size": 8}}],
                  b"\0" * 9), codes.BAD_REQUEST, "1 bytes of binary data after"),
    (*binary_body([{"name": "x", "datatype": "BYTES", "shape": [3], "parameters": {"binary_data_size": 8}}],
                  b"\0" * 8), codes.BAD_INPUT, "cannot fit in 8 bytes"),
    (*binary_body([{"name": "x", "datatype": "FP32", "shape": [1], "parameters": {"binary_data_size": True}}],
                  b"\0" * 4), codes.BAD_INPUT, "binary_data_size True"),
])
def test_a_hostile_body_is_a_400_naming_what_is_wrong(body, header_length, code, says):
    error = refused(body, header_length)
    assert error.code == code and says in error.message, error.message
    if code == codes.BAD_INPUT:
        assert error.message.startswith("input 'x'")


@pytest.mark.parametrize("shape", [[1 << 40], [(1 << 31) - 1] * 8, [1 << 30] * 100_000, [1 << 20, 0, 1 << 40]])
def test_a_huge_shape_is_refused_before_anything_is_allocated(shape):
    """A 2^40 dim, 2^248 elements, and a rank whose element count would have millions of digits:
    the header's checks, then the byte count against the body (pytest's timeout bounds the rest)."""
    data = b"\0" * 4
    for body, header_length in [binary_body([{"name": "x", "datatype": "FP32", "shape": shape,
                                             "parameters": {"binary_data_size": 4}}], data),
                                (json_body([{"name": "x", "datatype": "FP32", "shape": shape, "data": [1.0]}]), None)]:
        error = refused(body, header_length)
        assert error.code == codes.BAD_INPUT and error.message.startswith("input 'x'")


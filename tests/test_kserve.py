"""The Open Inference Protocol (KServe v2) on a real daemon's HTTP listener (127.0.0.1), driven by
Triton's own `tritonclient.http` (JSON and binary data) and raw HTTP for what the client hides: a
risk model of two handler versions (RiskScorer, and RiskRules as v2), whose answers over HTTP
must be the ZeroMQ `infer`'s."""
import http.client
import json
import os
import socket
import time

import numpy as np
import pytest
from tritonclient.http import InferenceServerClient, InferInput, InferRequestedOutput
from tritonclient.utils import InferenceServerException

from mcpd.client import Client
from mcpd.security.api_keys import API_DIR
from mcpd.testing import free_port
from test_metrics import scrape, total

pytestmark = pytest.mark.slow
SCORER = "mcpd.handlers.examples.risk_scorer:RiskScorer"
RULES = "mcpd.handlers.examples.risk_scorer:RiskRules"
FEATURES = np.random.default_rng(7).normal(size=(4, 256)).astype(np.float32)


@pytest.fixture(scope="module")
def served(module_daemon):
    daemon = module_daemon(**{"pool": {"shared": False},
                              "models.chat": {}, "models.chat.versions.v1": {},   # the embedded language model
                              "models.risk": {"default": "v1"},
                              "models.risk.versions.v1": {"handler": SCORER},
                              "models.risk.versions.v1.settings": {"seed": 3},
                              "models.risk.versions.v2": {"handler": RULES},
                              "models.risk.versions.v2.settings": {"seed": 3},
                              "models.risk.versions.v2.cache": {"max_bytes": 1 << 20},
                              # a request of fewer than 8 rows waits in its worker's batcher for 10 s
                              "models.risk.versions.slow": {"handler": RULES},
                              "models.risk.versions.slow.batching": {"max_batch_size": 8,
                                                                     "max_queue_delay_ms": 10_000.0},
                              "http": {"listen": f"127.0.0.1:{free_port()}", "max_body_bytes": 1 << 16},
                              "metrics": {"listen": f"127.0.0.1:{free_port()}"}})
    daemon.listen = daemon.control("config")["config"]["http"]["listen"]
    return daemon


@pytest.fixture(scope="module")
def triton(served):
    client = InferenceServerClient(served.listen, network_timeout=60)
    yield client
    client.close()


def features_input(array: np.ndarray, binary: bool, name: str = "features", datatype: str = "FP32") -> InferInput:
    item = InferInput(name, list(array.shape), datatype)
    item.set_data_from_numpy(array, binary_data=binary)
    return item


def raw(daemon, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, headers, JSON body) of one request on a fresh connection."""
    host, port = daemon.listen.split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request(method, path, body=body, headers=headers or {})
    response = connection.getresponse()
    payload = response.read()
    connection.close()
    return response.status, dict(response.headers), json.loads(payload) if payload else {}


# -- health and metadata -----------------------------------------------------------------------------

def test_the_server_is_live_ready_and_says_what_it_speaks(triton):
    assert triton.is_server_live() and triton.is_server_ready()
    metadata = triton.get_server_metadata()
    assert metadata["name"] == "mcpd" and "binary_tensor_data" in metadata["extensions"]


def test_model_metadata_is_each_versions_handler_signature(triton):
    metadata = triton.get_model_metadata("risk")
    assert (metadata["name"], metadata["platform"], metadata["versions"]) == ("risk", "mcpd", ["v1", "v2", "slow"])
    assert metadata["inputs"] == [{"name": "features", "datatype": "FP32", "shape": [-1, 256]}]
    assert metadata["outputs"] == [{"name": "score", "datatype": "FP32", "shape": [-1]}]
    assert triton.get_model_metadata("risk", "v2")["inputs"] == metadata["inputs"]
    assert triton.is_model_ready("risk") and triton.is_model_ready("risk", "v2")


def test_an_unknown_model_or_version_is_404_in_oips_error_body(served, triton):
    assert not triton.is_model_ready("nope") and not triton.is_model_ready("risk", "v9")
    for path in ("/v2/models/nope", "/v2/models/risk/versions/v9", "/v2/models/risk/versions/v9/ready"):
        status, _, body = raw(served, "GET", path)
        assert status == 404 and body["code"] == "UNKNOWN_MODEL" and isinstance(body["error"], str), path
    with pytest.raises(InferenceServerException) as caught:
        triton.infer("nope", [features_input(FEATURES, True)])
    assert caught.value.status() == "404" and "nope" in caught.value.message()


def test_an_unknown_path_under_v2_answers_in_oips_body_and_v1_keeps_openais(served):
    status, _, body = raw(served, "GET", "/v2/repository/index")
    assert status == 404 and body["code"] == "NOT_FOUND" and isinstance(body["error"], str)
    status, _, body = raw(served, "GET", "/v1/nothing")
    assert status == 404 and body["error"]["code"] == "NOT_FOUND"


# -- infer ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("binary, compression", [(True, None), (False, None), (True, "gzip")])
def test_infer_answers_what_the_zeromq_infer_answers(served, triton, binary, compression):
    outputs = [InferRequestedOutput("score", binary_data=binary)]
    answer = triton.infer("risk", [features_input(FEATURES, binary)], outputs=outputs, request_id="r1",
                          request_compression_algorithm=compression)
    with served.client() as client:
        native = client.infer("risk", {"features": FEATURES})
    assert answer.get_response()["model_version"] == native.version == "v1"
    assert answer.get_response()["id"] == "r1"
    assert ("data" in answer.get_output("score")) != binary
    np.testing.assert_array_equal(answer.as_numpy("score"), native.outputs["score"])


def test_a_named_version_answers_and_the_response_names_it(served, triton):
    answer = triton.infer("risk", [features_input(FEATURES, True)], model_version="v2")
    with served.client() as client:
        native = client.infer("risk", {"features": FEATURES}, version="v2")
        scorer = client.infer("risk", {"features": FEATURES}, version="v1")
    assert answer.get_response()["model_version"] == "v2"
    np.testing.assert_array_equal(answer.as_numpy("score"), native.outputs["score"])
    assert not np.array_equal(native.outputs["score"], scorer.outputs["score"])   # the versions differ


def test_a_routing_key_parameter_picks_the_version_the_zeromq_one_does(served, triton):
    served.control("models.split", {"model": "risk", "weights": {"v1": 1, "v2": 1}})
    try:
        keys = [f"user-{i}" for i in range(12)]
        over_http = {key: triton.infer("risk", [features_input(FEATURES[:1], True)],
                                       parameters={"routing_key": key}).get_response()["model_version"]
                     for key in keys}
        with served.client() as client:
            native = {key: client.infer("risk", {"features": FEATURES[:1]}, routing_key=key).version for key in keys}
    finally:
        served.control("models.rollback", {"model": "risk"})
    assert over_http == native and set(native.values()) == {"v1", "v2"}


def test_the_response_says_when_the_result_cache_answered_and_a_parameter_bypasses_it(triton):
    x = np.random.default_rng(11).normal(size=(2, 256)).astype(np.float32)

    def cached(**parameters) -> bool:
        answer = triton.infer("risk", [features_input(x, True)], model_version="v2", parameters=parameters or None)
        return answer.get_response()["parameters"]["cached"]

    assert [cached(cache=False), cached(), cached(), cached(cache=False)] == [False, False, True, False]


def test_a_language_model_has_no_tensors_and_refuses_infer(served, triton):
    metadata = triton.get_model_metadata("chat")
    assert (metadata["inputs"], metadata["outputs"]) == ([], [])
    with pytest.raises(InferenceServerException) as caught:
        triton.infer("chat", [features_input(FEATURES, True)])
    assert caught.value.status() == "400" and "language model" in caught.value.message()


def test_a_bad_input_is_a_400_naming_it_and_the_model_goes_on(served, triton):
    wrong = [features_input(FEATURES.astype(np.float64), True, datatype="FP64"),   # the daemon's check
             features_input(FEATURES, True, name="feature"),                         # a name the model lacks
             features_input(FEATURES[:, :100], False)]                                # a shape it does not take
    for inputs in wrong:
        with pytest.raises(InferenceServerException) as caught:
            triton.infer("risk", [inputs])
        assert caught.value.status() == "400" and inputs.name() in caught.value.message(), caught.value.message()
    head = json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 256],
                                   "parameters": {"binary_data_size": 1024}}]}).encode()
    status, _, body = raw(served, "POST", "/v2/models/risk/infer", head + b"\0" * 1000,
                          {"Inference-Header-Content-Length": str(len(head))})   # the codec's check
    assert status == 400 and body["code"] == "BAD_INPUT" and "'features'" in body["error"]
    assert triton.infer("risk", [features_input(FEATURES, True)]).as_numpy("score").shape == (4,)


def test_a_client_that_disconnects_cancels_its_infer(served):
    head = json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 256],
                                   "parameters": {"binary_data_size": 1024}}]}).encode()
    host, port = served.listen.split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v2/models/risk/versions/slow/infer HTTP/1.1\r\nHost: x\r\n"
                     b"Inference-Header-Content-Length: %d\r\nContent-Length: %d\r\n\r\n%s"
                     % (len(head), len(head) + 1024, head + FEATURES[:1].tobytes()))
        served.wait_until(lambda: slow_version(served)["running"] == 1, 60, "the infer waiting in its batcher")
    served.wait_until(lambda: total(scrape(served), "mcpd_requests_total", op="infer", code="CANCELLED") == 1, 60,
                      "the abandoned infer cancelled")
    assert slow_version(served)["running"] == 0


def slow_version(daemon) -> dict:
    return daemon.status()["models"]["models"]["risk"]["versions"]["slow"]


def test_admission_reads_the_same_headers_as_the_openai_routes(triton):
    with pytest.raises(InferenceServerException) as caught:
        triton.infer("risk", [features_input(FEATURES, True)], headers={"mcpd-priority": "no-such-class"})
    assert caught.value.status() == "400" and "no-such-class" in caught.value.message()
    with pytest.raises(InferenceServerException) as caught:
        triton.infer("risk", [features_input(FEATURES, True)], headers={"mcpd-timeout-ms": "soon"})
    assert caught.value.status() == "400" and "mcpd-timeout-ms" in caught.value.message()


def test_a_profile_kept_in_a_context_scores_over_http_as_sending_it(served, triton):
    """Context fields as inputs over the OIP: no input sent, parameters.context_inputs name them."""
    profile = FEATURES[0]
    with Client(served.endpoint, tenant="bank") as client:
        user = client.context("user-1")
        user["profile"] = profile
        user.sync()
    body = json.dumps({"inputs": [], "parameters": {"context": "user-1",
                                                    "context_inputs": {"features": "profile"}}}).encode()
    status, _, read = raw(served, "POST", "/v2/models/risk/versions/v1/infer", body, {"mcpd-tenant": "bank"})
    assert status == 200, read
    sent = triton.infer("risk", [features_input(profile[np.newaxis], False)], model_version="v1",
                        headers={"mcpd-tenant": "bank"})
    [score] = [output for output in read["outputs"] if output["name"] == "score"]
    np.testing.assert_array_equal(np.array(score["data"], np.float32), sent.as_numpy("score").ravel())
    assert read["parameters"]["context_version"] == user.version
    status, _, other = raw(served, "POST", "/v2/models/risk/versions/v1/infer", body, {"mcpd-tenant": "mallory"})
    assert status == 404, other   # another tenant's context is not there for it


def test_an_infer_the_daemon_cannot_be_sent_is_400_and_not_counted_in_flight(served, triton):
    """A tenant of bytes that are not UTF-8 is refused as the request is encoded for the daemon:
    the listener's count of requests in flight (`mcpctl status`) must not keep it."""
    body = json.dumps({"inputs": [{"name": "features", "datatype": "FP32", "shape": [1, 256],
                                   "data": FEATURES[0].tolist()}]}).encode()
    for _ in range(3):
        status, _, answer = raw(served, "POST", "/v2/models/risk/infer", body, {"mcpd-tenant": b"\xff"})
        assert (status, answer["code"]) == (400, "BAD_REQUEST"), answer
    assert triton.infer("risk", [features_input(FEATURES, True)]).as_numpy("score").shape == (4,)
    served.wait_until(lambda: served.status()["http"]["inflight"] == 0, 10, "no HTTP request in flight")


def test_a_body_over_the_listeners_limit_is_413_in_oips_body(served):
    status, _, body = raw(served, "POST", "/v2/models/risk/infer", b"{" + b" " * (1 << 16) + b"}",
                          {"Content-Type": "application/json"})
    assert status == 413 and body["code"] == "TOO_LARGE" and "max_body_bytes" in body["error"]


# -- API keys ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def guarded(module_daemon):
    daemon = module_daemon(**{"pool": {"shared": False}, "security": {"curve": "on"},   # http.auth: auto, so on
                              "models.risk": {}, "models.risk.versions.v1": {"handler": SCORER},
                              "http": {"listen": f"127.0.0.1:{free_port()}"},
                              "metrics": {"listen": f"127.0.0.1:{free_port()}"}})
    daemon.listen = daemon.control("config")["config"]["http"]["listen"]
    return daemon


def test_api_keys_guard_every_route_but_liveness_and_name_the_tenant(guarded):
    client = InferenceServerClient(guarded.listen, network_timeout=60)
    try:
        assert client.is_server_live()
        for path in ("/v2", "/v2/health/ready", "/v2/models/risk", "/v2/models/risk/ready"):
            status, _, body = raw(guarded, "GET", path)
            assert status == 401 and body["code"] == "UNAUTHORIZED", path
        with pytest.raises(InferenceServerException) as caught:
            client.infer("risk", [features_input(FEATURES, True)], headers={"Authorization": "Bearer wrong"})
        assert caught.value.status() == "401"
        auth = {"Authorization": f"Bearer {guarded.control('keys.api.add', {'name': 'carol'})['api_key']}"}
        assert client.is_model_ready("risk", headers=auth)
        answer = client.infer("risk", [features_input(FEATURES, True)], headers={**auth, "mcpd-tenant": "mallory"})
        assert answer.as_numpy("score").shape == (4,)
    finally:
        client.close()
    guarded.wait_until(lambda: total(scrape(guarded), "mcpd_requests_total", op="infer", tenant="carol",
                                     code="OK") == 1, 30, "carol's infer counted")
    assert total(scrape(guarded), "mcpd_requests_total", tenant="mallory") == 0   # a header cannot claim another


def test_an_api_key_revoked_in_the_tick_of_the_listeners_read_is_refused(guarded):
    """A change in the same timestamp tick as the listener's last read of the key directory leaves
    the directory's mtime as that read saw it (set back so here, a minute ahead: no read takes it
    for settled, however slow the machine): the revoked key is refused all the same."""
    keys = guarded.root / "state/keys" / API_DIR
    auth = {"Authorization": f"Bearer {guarded.control('keys.api.add', {'name': 'erin'})['api_key']}"}
    unsettled = time.time_ns() + 60 * 10**9
    try:
        os.utime(keys, ns=(unsettled, unsettled))
        assert raw(guarded, "GET", "/v2/models/risk/ready", headers=auth)[0] == 200   # read at that mtime
        assert guarded.control("keys.api.revoke", {"name": "erin"})["revoked"]
        os.utime(keys, ns=(unsettled, unsettled))   # revoked in the read's tick
        guarded.wait_until(lambda: raw(guarded, "GET", "/v2/models/risk/ready", headers=auth)[0] == 401, 30,
                           "the revoked key refused")
    finally:
        os.utime(keys)

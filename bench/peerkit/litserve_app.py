"""LitServe serving a mcpd Handler (peerkit/handler_runner.py), run in LitServe's own venv by
bench/handlers.py: `python -m peerkit.litserve_app --port P --handler pkg.mod:Class --settings JSON
--max-batch-size N --batch-timeout S`. Requests and replies are the Open Inference Protocol's JSON
(peerkit/v2_json.py) at /v2/models/<model>/infer; LitServe's own batching gathers them."""
from __future__ import annotations

import argparse
import json

import litserve as ls

from peerkit import v2_json
from peerkit.handler_runner import HandlerRunner


class HandlerAPI(ls.LitAPI):
    def __init__(self, model: str, reference: str, settings: dict, **batching):
        super().__init__(api_path=f"/v2/models/{model}/infer", **batching)
        self.model_name, self.reference, self.settings = model, reference, settings

    def setup(self, device):
        self.runner = HandlerRunner(self.reference, self.settings)

    def decode_request(self, request):
        return v2_json.inputs_of(request)

    def batch(self, inputs):
        return inputs   # a list of requests: the runner concatenates them as mcpd does

    def predict(self, requests):
        return self.runner.run(requests if isinstance(requests, list) else [requests])

    def unbatch(self, outputs):
        return outputs

    def encode_response(self, outputs):
        if isinstance(outputs, list):   # unbatched path: one request's list of one
            outputs = outputs[0]
        return v2_json.response_body(self.model_name, outputs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--handler", required=True)
    parser.add_argument("--settings", default="{}")
    parser.add_argument("--max-batch-size", type=int, default=1)
    parser.add_argument("--batch-timeout", type=float, default=0.0)
    args = parser.parse_args()
    api = HandlerAPI(args.model, args.handler, json.loads(args.settings),
                     max_batch_size=args.max_batch_size, batch_timeout=args.batch_timeout)
    server = ls.LitServer(api, accelerator="cpu", workers_per_device=1, fast_queue=True, timeout=60)
    server.run(host="127.0.0.1", port=args.port, num_api_servers=1, generate_client_file=False, log_level="warning")


if __name__ == "__main__":
    main()

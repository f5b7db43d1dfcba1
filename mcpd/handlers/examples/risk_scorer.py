"""A bank's risk score over a transaction's features: `RiskScorer`, a small MLP in torch, and
`RiskRules`, a rule table over the same features in numpy, the cheap fallback a model names as
its `fast` version (the degradation ladder's rung). Weights come from `seed` in settings, so a
test can build the same model in-process and compare scores.

    [models.risk.versions.v1]
    handler = "mcpd.handlers.examples.risk_scorer:RiskScorer"
    settings = { hidden = 64, seed = 0 }
"""
from __future__ import annotations

import numpy as np

from mcpd.handlers.handler import Handler
from mcpd.handlers.tensors import TensorSpec

FEATURES = 256


class RiskScorer(Handler):
    inputs = {"features": TensorSpec("FP32", (-1, FEATURES))}
    outputs = {"score": TensorSpec("FP32", (-1,))}

    def setup(self, device: str, settings: dict) -> None:
        import torch

        generator = torch.Generator().manual_seed(int(settings.get("seed", 0)))
        hidden = int(settings.get("hidden", 64))
        self.model = torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), torch.nn.ReLU(),
                                         torch.nn.Linear(hidden, 1))
        with torch.no_grad():
            for parameter in self.model.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
        self.model.to(device).eval()
        self.device = device

    def predict(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        with torch.inference_mode():   # predict runs on the worker's predict thread: grad mode is per thread
            features = torch.from_numpy(np.ascontiguousarray(batch["features"])).to(self.device)
            scores = torch.sigmoid(self.model(features)).squeeze(1)
        return {"score": scores.cpu().numpy()}


class RiskRules(Handler):
    """Each rule adds its weight when its feature passes its threshold; the score is the sum
    through a logistic, as RiskScorer's is."""
    inputs = RiskScorer.inputs
    outputs = RiskScorer.outputs

    def setup(self, device: str, settings: dict) -> None:
        rng = np.random.default_rng(int(settings.get("seed", 0)))
        rules = int(settings.get("rules", 32))
        self.feature = rng.integers(0, FEATURES, rules)
        self.threshold = rng.normal(0, 1, rules).astype(np.float32)
        self.weight = rng.normal(0, 1, rules).astype(np.float32)

    def predict(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        passed = batch["features"][:, self.feature] > self.threshold
        total = passed.astype(np.float32) @ self.weight
        return {"score": (1 / (1 + np.exp(-total))).astype(np.float32)}

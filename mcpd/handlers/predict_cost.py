"""What a handler's predict costs on this machine, learned from the predicts its worker ran: a
fixed part per call and a part per element of the padded batch (rows x its longest length),
fitted by least squares. Each new predict weighs a little more than the ones before it, so the
fit follows the machine's load. The batcher reads it to decide whether a batch should wait for
more requests and whether two length bins should share a predict."""
from __future__ import annotations

MEMORY = 256   # about how many recent predicts the fit weighs
# The least spread of the batches' sizes (relative variance) that lets the fit split the fixed
# part from the part per element: predicts all of one size tell them apart not at all
LEAST_SPREAD = 1e-3


class PredictCost:
    def __init__(self, memory: int = MEMORY):
        self.keep = 1.0 - 1.0 / memory
        self.count = self.x = self.y = self.xx = self.xy = 0.0   # decayed sums of elements and seconds
        self.known = False
        self.fixed_s = 0.0
        self.per_element_s = 0.0

    def observe(self, elements: int, seconds: float) -> None:
        keep = self.keep
        self.count = self.count * keep + 1.0
        self.x = self.x * keep + elements
        self.y = self.y * keep + seconds
        self.xx = self.xx * keep + elements * elements
        self.xy = self.xy * keep + elements * seconds
        spread = self.count * self.xx - self.x * self.x
        if spread <= LEAST_SPREAD * self.count * self.xx:
            return
        slope = max(0.0, (self.count * self.xy - self.x * self.y) / spread)
        self.per_element_s = slope
        self.fixed_s = max(0.0, (self.y - slope * self.x) / self.count)
        self.known = True

    def padding_pays(self, padded_elements: int) -> bool:
        """Whether padding that many elements costs less than a predict of their own saves."""
        return self.known and self.per_element_s * padded_elements < self.fixed_s

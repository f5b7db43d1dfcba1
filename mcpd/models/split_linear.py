"""A linear layer whose output rows come in parts, each a linear layer of its own (each weight
then in its own quantized form: a GGUF's fused q/k/v whose pieces mix types). The skeleton puts
it in place of the fused nn.Linear (loader.skeleton); the kernels multiply its parts as one
matrix (kernels/row_parts.py). Parameters: gguf_file.part_name's (each with its form's pieces
beside it), and the whole's bias."""
from __future__ import annotations

from torch import nn
from torch.nn.utils import skip_init

from mcpd.gguf_file import part_name
from mcpd.kernels.forms import Form
from mcpd.kernels.row_parts import RowParts


class SplitLinear(nn.Module):
    def __init__(self, fused: nn.Linear, rows: tuple[int, ...]) -> None:
        """fused: the layer it replaces (its bias is kept); rows: each part's rows, in order."""
        super().__init__()
        self.rows = rows
        device = fused.weight.device
        self.parts = nn.ModuleList(skip_init(nn.Linear, fused.in_features, n, bias=False, device=device) for n in rows)
        self.bias = fused.bias

    def part_at(self, row: int) -> tuple[int, int]:
        """(the part holding output row `row`, that part's first row)."""
        start = 0
        for index, rows in enumerate(self.rows):
            if row < start + rows:
                return index, start
            start += rows
        raise IndexError(f"row {row} is past the layer's {start} rows")

    def form(self, forms: dict[str, Form], name: str) -> RowParts:
        """The parts' forms (forms: by parameter name; name: the whole's weight) joined for the kernels."""
        return RowParts(tuple(forms[part_name(name, i)] for i in range(len(self.rows))), self.rows)


def split(model: nn.Module, name: str, rows: tuple[int, ...]) -> SplitLinear:
    """Put a SplitLinear of these parts' rows in place of model's linear layer `name`."""
    parent, _, child = name.rpartition(".")
    layer = SplitLinear(model.get_submodule(name), rows)
    setattr(model.get_submodule(parent), child, layer)
    return layer


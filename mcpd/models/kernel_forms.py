"""A model's parameters in the form its kernels read them, and a model running on forms held
elsewhere (the shared device pool: engine/resident_weights.py).

A form is what kernels.prepare() returns for a weight matrix the kernels multiply (a plain
tensor for the torch kernels, a Packed for the native ones, whatever a later format is: a
dataclass of tensors and sizes), or the parameter itself for every other parameter (norms,
biases, an untied embedding table). What the kernels read is then only the forms: a model
keeps no second copy of a packed matrix, and a successor that finds the forms in the pool
runs on them without preparing anything.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch

Form = object   # a torch.Tensor, or a dataclass whose tensor fields hold the data (kernels.Packed)


def tensors_of(form: Form) -> dict[str, torch.Tensor]:
    """The tensors holding a form's data, by field name ("" for a plain tensor)."""
    if isinstance(form, torch.Tensor):
        return {"": form}
    return {f.name: getattr(form, f.name) for f in dataclasses.fields(form)
            if isinstance(getattr(form, f.name), torch.Tensor)}


def rebuilt(form: Form, tensors: dict[str, torch.Tensor]) -> Form:
    """form with its tensors replaced by tensors (tensors_of's names, the same shapes)."""
    if isinstance(form, torch.Tensor):
        return tensors[""]
    return dataclasses.replace(form, **tensors)


class KernelForms:
    """kernel_forms() and use_forms() for a model (an nn.Module) with `kernels` chosen and
    prepared(name, param): whether the kernels read that parameter prepared."""

    def prepared(self, name: str, param: torch.Tensor) -> bool:
        return False

    def kernel_forms(self, meta: bool = False) -> Iterator[tuple[str, Form]]:
        """(name, form) of each parameter, one at a time: a caller that moves each form elsewhere
        holds one prepared copy at most. meta: the forms' shapes and dtypes only, computed on
        the meta device (a layout, known before any weight is read)."""
        for name, param in self.named_parameters():
            tensor = torch.empty_like(param, device="meta") if meta else param
            yield name, (self.kernels.prepare(tensor) if self.prepared(name, param) else tensor)

    def use_forms(self, forms: dict[str, Form]) -> None:
        """Run on forms (kernel_forms' names and shapes, held anywhere): a parameter read in
        another form is emptied, every other one points at its form, so the weights are in memory
        once."""
        for name, param in self.named_parameters():
            form = forms[name]
            if form is not param:
                param.data = form if isinstance(form, torch.Tensor) else param.data.new_empty(0)

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
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from mcpd.quant import int4_layout, int8
from mcpd.quant.int4 import Int4Weight
from mcpd.quant.int4_layout import HIGHS_SUFFIX, MINS_SUFFIX, SCALES_SUFFIX, SUPERS_SUFFIX
from mcpd.quant.int8 import Int8Weight

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
        the meta device (a layout, known before any weight is read). An int8 matrix is prepared
        with its scales (int8.py: the parameter "<name>_scale" beside it), a 4-bit one with its
        scales, mins, supers and highs (int4.py). Their own forms are the same tensors where the matrix's form
        holds them (the torch kernels': laid_out places them once), else empty (the native
        kernels copy them into panels): held twice, a Q8_0 file's scales would add a tenth to its size."""
        params, memo, in_matrices = dict(self.named_parameters()), {}, set()

        def held(name: str) -> torch.Tensor:   # not empty_like: loader.on_device says why
            if name not in memo:
                param = params[name]
                memo[name] = torch.empty(param.shape, dtype=param.dtype, device="meta") if meta else param
            return memo[name]

        for name, param in params.items():
            if name.endswith((int8.SCALE_SUFFIX, *int4_layout.SUFFIXES)):   # after their matrix's
                yield name, held(name) if id(held(name)) in in_matrices else held(name).new_empty(0)
            elif not self.prepared(name, param):
                yield name, held(name)
            else:
                form = self.kernels.prepare(_matrix(params, name, held))
                in_matrices.update(id(t) for t in tensors_of(form).values())
                yield name, form

    def use_forms(self, forms: dict[str, Form]) -> None:
        """Run on forms (kernel_forms' names and shapes, held anywhere): a parameter read in
        another form is emptied, every other one points at its form, so the weights are in memory
        once. self.forms: the forms it runs on."""
        self.forms = forms
        for name, param in self.named_parameters():
            form = forms[name]
            if isinstance(form, torch.Tensor):
                if form is not param:
                    param.data = form
            elif not any(tensor is param for tensor in tensors_of(form).values()):
                param.data = param.data.new_empty(0)   # read in another form only (an Int8Weight keeps it)


def _matrix(params: dict[str, torch.Tensor], name: str, held) -> torch.Tensor | Int8Weight | Int4Weight:
    """Matrix parameter `name` as prepare() takes it, each tensor held(its name): the tensor, or
    with its int8 scales, or with its 4-bit scales, mins, supers and highs."""
    if name + int8.SCALE_SUFFIX in params:
        return Int8Weight(held(name), held(name + int8.SCALE_SUFFIX))
    if name + SCALES_SUFFIX in params:
        mins, supers, highs = (held(name + suffix) if name + suffix in params else None
                               for suffix in (MINS_SUFFIX, SUPERS_SUFFIX, HIGHS_SUFFIX))
        return Int4Weight(held(name), held(name + SCALES_SUFFIX), mins, supers, highs)
    return held(name)


Place = tuple[int, tuple[int, ...], torch.dtype]   # a tensor's byte offset in a buffer, shape, dtype


@dataclass
class FormLayout:
    """Where each form's tensors lie in one byte buffer (a pool region, a huge-page arena)."""
    places: dict[str, tuple[Form, dict[str, Place]]]   # name -> (a form of this shape, field -> place)
    end: int                                           # the bytes the buffer must hold

    def signature(self) -> tuple:
        """What the layout holds, names, kinds, shapes and dtypes: part of a region's key."""
        return tuple((name, type(form).__name__, tuple((f, s, str(d)) for f, (_, s, d) in fields.items()))
                     for name, (form, fields) in self.places.items())

    def copy_in(self, forms: Iterable[tuple[str, Form]], memory: torch.Tensor) -> None:
        """Copy each form's tensors into its place in memory (uint8), one form at a time."""
        for name, form in forms:
            places = self.places[name][1]
            for field, tensor in tensors_of(form).items():
                _view(memory, *places[field]).copy_(tensor.detach())

    def views(self, memory: torch.Tensor) -> dict[str, Form]:
        """The forms over their places in memory (uint8; slices of it, so they stay inside it)."""
        return {name: rebuilt(form, {field: _view(memory, *place) for field, place in fields.items()})
                for name, (form, fields) in self.places.items()}


def laid_out(forms: Iterable[tuple[str, Form]], start: int, align: int) -> FormLayout:
    """Each form's tensors one after another from byte start, each at a multiple of align; a
    tensor two forms hold (a matrix's scales, KernelForms) once. forms may be meta forms: a
    layout needs shapes and dtypes only."""
    places, at, placed = {}, start, {}   # placed: id of a tensor laid out -> its place (the forms keep it alive)
    for name, form in forms:
        fields = {}
        for field, tensor in tensors_of(form).items():
            if id(tensor) not in placed:
                at = -(-at // align) * align
                placed[id(tensor)] = (at, tuple(tensor.shape), tensor.dtype)
                at += tensor.numel() * tensor.element_size()
            fields[field] = placed[id(tensor)]
        places[name] = (form, fields)
    return FormLayout(places, at)


def _view(memory: torch.Tensor, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    nbytes = math.prod(shape) * dtype.itemsize
    return memory[offset:offset + nbytes].view(dtype).view(shape)

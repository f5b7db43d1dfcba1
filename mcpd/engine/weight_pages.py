"""The weights a CPU step streams, on 2 MiB pages (memory/huge_pages.py says why: 15-20% of
the products' time on 4 KiB pages goes to the TLB).

Where the forms the kernels read (kernels/forms.py) already lie on 2 MiB pages, nothing
moves. Otherwise they are copied, in one layout, into a private huge-page arena and the model
runs on that: a privately loaded model's weights are then still in memory once (the loaded
copies are freed), but a model running on the shared device pool keeps its pool copy too, for
its successor after a crash: the pool lives in /dev/shm, whose pages are 4 KiB unless the
operator mounts it with `huge=within_size` (or `advise`) and shmem_enabled allows it, and then
nothing is copied. engine.huge_pages = false keeps the weights where they are loaded.
"""
from __future__ import annotations

from mcpd.memory import huge_pages
from mcpd.kernels.forms import laid_out, tensors_of

ALIGN = 64   # a cache line: every panel row starts on one


def onto_huge_pages(model, wanted: bool, shared: bool) -> str:
    """Move model's forms onto 2 MiB pages if wanted and they are not; returns what happened,
    for the worker's log. shared: the forms are a view of the shared pool (kept there)."""
    if not wanted:
        return "weights where they were loaded (engine.huge_pages = false)"
    forms = model.forms
    tensors = [tensor for form in forms.values() for tensor in tensors_of(form).values()]
    biggest = max(tensors, key=lambda t: t.numel() * t.element_size())
    if biggest.device.type != "cpu":
        return "weights on the device"
    if huge_pages.huge_fraction(biggest) >= 0.5:
        return "weights on 2 MiB pages where they were loaded"
    layout = laid_out(forms.items(), 0, ALIGN)
    memory = huge_pages.arena(layout.end)
    if huge_pages.huge_fraction(memory) < 0.5:
        return ("weights on 4 KiB pages: this host gave no 2 MiB pages "
                "(/sys/kernel/mm/transparent_hugepage/enabled is never, or memory is fragmented)")
    layout.copy_in(forms.items(), memory)
    model.use_forms(layout.views(memory))
    second = ", beside the pool's copy kept for a successor" if shared else ""
    return f"weights copied onto 2 MiB pages ({layout.end / 2**20:.0f} MiB{second})"

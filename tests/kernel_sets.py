"""The native kernel sets this CPU runs, as engine.kernels names them (native-avx512, native-avx2):
parity tests run through each, so CI exercises every set its machine can, and their ids say which."""
from mcpd.kernels import native

NATIVE_SETS = [f"native-{isa}" for isa in native.ISAS if native.runs_here(isa)]

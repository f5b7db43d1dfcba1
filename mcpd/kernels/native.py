"""Build, cache and load the native CPU kernels (kernels.c), and call them on torch tensors.

The C file is compiled at first use with the machine's C compiler (`cc`, or $CC) for this CPU
(-march=native), about a second, into a per-user cache directory (_cache_dir), and loaded with
ctypes: once per instruction set (ISAS), so a CPU with AVX-512 can run the AVX2 build too, and
tests and benchmarks reach every set the CPU runs. The cached library is named by a hash of
everything that shaped it (source, flags, compiler version, the CPU's feature flags), so an
edit, a new compiler or a different CPU builds afresh. Where no
compiler works, load() says why and the engine runs the torch kernels instead (tested the same).

A shared library is code this process will run: the cache directory must be ours and private
(0700), and the library ours and writable by nobody else, or it is not loaded.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from mcpd.cpu import features

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-lm"]
# Each set, in auto's order of preference: the flags it adds, and the CPU flags it needs. avx2
# leaves out every AVX-512 extension (-mno-avx512f takes them all), so kernels.c takes its AVX2
# tiles. amx is avx512 with its bfloat16 products on AMX tiles, taken only when named
# (engine.kernels = native-amx): it runs a bfloat16 model's prompts 3-4x and its batches 2-3x as
# fast as avx512, but one stream's decode about a tenth slower (bench/engine.py), and auto must
# not trade that away for a chat's users. Every CPU with AMX has AVX-512, so auto never reaches it.
ISAS = {"avx512": ([], ("avx512f",)), "avx2": (["-mno-avx512f"], ("avx2", "fma")),
        "amx": (["-DMCPD_AMX", "-mamx-tile", "-mamx-bf16"], ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16"))}
BUILD_TIMEOUT_S = 120
SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA = 158, 0x1023, 18   # x86-64 Linux's numbers

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "mcpd_linear": [ctypes.c_int, _P, _I, _I, _P, _P, _I, _P, ctypes.c_int],
    "mcpd_embedding": [ctypes.c_int, _P, _I, _P, _I, _P],
    "mcpd_rows": [_P, _I, _I, _P, _I, _P],
    "mcpd_add_rms_norm": [ctypes.c_int, _P, _P, _P, _F, _I, _I, _P],
    "mcpd_rope_store": [ctypes.c_int, _P, _I, _I, _I, _I, _P, _P, _P, _I, _I, _P, _P],
    "mcpd_silu_mul": [ctypes.c_int, _P, _I, _I, _P],
    "mcpd_decode_attention": [ctypes.c_int, _P, _I, _I, _I, _I, _I, _P, _I, _I, _I, _P, _I, _P, _F, _P],
    "mcpd_prefill_attention": [ctypes.c_int, _P, _I, _I, _P, _P, _P, _I, _I, _I, _P, _I, _I, _I, _P, _I, _F, _P],
    "mcpd_stack_scratch_bytes": [ctypes.c_int, _P, _I],
    "mcpd_decoder_stack": [ctypes.c_int, _P, _P, _I, _I, _P, _P, _P, _P, _P, _P, _I, _I, _P, _P, _P, _P],
    "mcpd_argmax": [_P, _I, _I, _P],
    "mcpd_greedy_steps": [ctypes.c_int, _P, _P, _I, _P, _I, _I, _I, _P, _I, _P, _P, _P, _P, _P],
    "mcpd_max_threads": [],
    "mcpd_team_tids": [_P, ctypes.c_int],
    "mcpd_has_avx512_bf16": [],
}

_RESTYPES = {"mcpd_rows": ctypes.c_int, "mcpd_max_threads": ctypes.c_int, "mcpd_team_tids": ctypes.c_int,
             "mcpd_has_avx512_bf16": ctypes.c_int, "mcpd_stack_scratch_bytes": _I, "mcpd_greedy_steps": _I}


class Matrix(ctypes.Structure):
    """kernels.c's mcpd_matrix: a packed weight matrix's panels, and its scales and mins where
    its kind (PLAIN, INT8: in groups of `group` columns, Q4_0, Q4_1, Q4_K: with supers, Q6_K:
    with supers and highs) has them."""
    PLAIN, INT8, Q4_0, Q4_1, Q4_K, Q6_K = range(6)


# next: the rows after this part's (a matrix in parts of different kinds: row_parts.py), rows: this part's.
Matrix._fields_ = [("panels", _P), ("scales", _P), ("mins", _P), ("kind", _I), ("group", _I), ("supers", _P),
                   ("highs", _P), ("next", ctypes.POINTER(Matrix)), ("rows", _I)]


def address(tensor) -> int | None:
    """A torch tensor's data address for a pointer argument, NULL for None."""
    return None if tensor is None else tensor.data_ptr()


class NativeUnavailable(RuntimeError):
    """The kernels could not be built or loaded here; the message says why."""


_loaded: dict[str, ctypes.CDLL] = {}


def runs_here(isa: str) -> bool:
    """Whether this CPU has what the kernels built for isa (a key of ISAS) execute, and for amx
    whether Linux gives this process the tiles."""
    return all(features.has(flag) for flag in ISAS[isa][1]) and (isa != "amx" or tiles_granted())


def tiles_granted() -> bool:
    """Asks Linux for AMX's tile state, which it hands a process only on request (arch_prctl
    ARCH_REQ_XCOMP_PERM for XTILEDATA); whether it was granted. Asking again is harmless."""
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0


def best_isa() -> str | None:
    """The fastest set this CPU runs (ISAS in order of preference), or None."""
    return next((isa for isa in ISAS if runs_here(isa)), None)


def load(isa: str) -> ctypes.CDLL:
    """The kernels library built for isa, built on first use; raises NativeUnavailable,
    also where this CPU cannot run that set."""
    if not runs_here(isa):
        raise NativeUnavailable(f"the {isa} kernels want {' + '.join(ISAS[isa][1])}; this CPU lacks them")
    if isa not in _loaded:
        flags = FLAGS + ISAS[isa][0]
        path = _cache_dir() / f"kernels-{_build_key(flags)}.so"
        if not path.exists():
            _build(path, flags)
        _check_private(path, is_dir=False)
        library = ctypes.CDLL(str(path))
        for name, argtypes in _SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes = argtypes
            function.restype = _RESTYPES.get(name)
        _loaded[isa] = library
    return _loaded[isa]


def _compiler() -> str:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise NativeUnavailable(f"no C compiler ({os.environ.get('CC', 'cc')}) on PATH")
    return compiler


def _build_key(flags: list[str]) -> str:
    compiler = _compiler()
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"{compiler} --version failed: {e}") from None
    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in (" ".join(flags).encode(), version, features.flags_line()):
        digest.update(b"\0" + part)
    return digest.hexdigest()[:20]


def _cache_dir() -> Path:
    """systemd's CacheDirectory= ($CACHE_DIRECTORY: the unit sets /var/cache/mcpd, its home being
    read-only there), else $XDG_CACHE_HOME/mcpd, else ~/.cache/mcpd; then kernels/ in it."""
    systemd = os.environ.get("CACHE_DIRECTORY", "").split(":")[0]
    root = Path(systemd) if systemd else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mcpd"
    path = root / "kernels"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(path, is_dir=True)
    return path


def _check_private(path: Path, is_dir: bool) -> None:
    info = os.lstat(path)
    kind_ok = stat.S_ISDIR(info.st_mode) if is_dir else stat.S_ISREG(info.st_mode)
    open_to_others = info.st_mode & (0o077 if is_dir else 0o022)
    if not kind_ok or info.st_uid != os.geteuid() or open_to_others:
        raise NativeUnavailable(f"{path}: not a private {'directory' if is_dir else 'file'} of this user "
                                f"(mode {stat.filemode(info.st_mode)}, uid {info.st_uid}): not loaded")


def _build(path: Path, flags: list[str]) -> None:
    """Compile into a temporary file beside path, then rename: concurrent builders (workers
    starting together) each get a whole library, and the last rename wins harmlessly."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        result = subprocess.run([_compiler(), str(SOURCE), "-o", temporary, *flags],
                                capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        if result.returncode != 0:
            raise NativeUnavailable(f"building {SOURCE.name} failed: {result.stderr.strip()[-2000:]}")
        os.chmod(temporary, 0o700)
        os.replace(temporary, path)
    except subprocess.TimeoutExpired:
        raise NativeUnavailable(f"building {SOURCE.name} took over {BUILD_TIMEOUT_S} s") from None
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)

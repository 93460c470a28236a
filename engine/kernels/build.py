"""Builds and loads Ferry's C++ CPU kernels with torch's extension tooling, once per machine.

Compiled at first use, not at install (`pip install` stays a plain Python install; building there would pull a
CUDA torch through build isolation), and cached under `$TORCH_EXTENSIONS_DIR/ferry` (by default
`~/.cache/torch_extensions/ferry`).

- **Named by content.** A library's folder is named by a hash of everything the binary depends on: the sources'
  text, the flags, the compiler and torch's version, never a path. A checkout at another path finds the build of
  the same source; an edited source or another torch never reuses a stale one.
- **By the CPU.** The instruction set comes from torch's own CPU capability (what its kernels dispatch to on this
  machine, lowered to AVX2 by `FERRY_CPU_ISA=avx2`: engine/cpu_isa.py), not `-march=native`: a build for AVX-512
  has another name than one for AVX2, so it is never loaded where it would not run.
- **Interruptible.** A build runs in a temporary folder of its own, from copies of the sources, and its library is
  moved into place by one rename: a build stopped halfway (Ctrl-C, SIGTERM, a killed container) leaves nothing that
  a later start takes for a finished build or waits on. Processes starting at once take turns through an advisory
  lock (`flock`) that the kernel releases when its holder dies, however it dies; a process waits for another's
  build at most `wait_s` and then goes without the kernel (its caller falls back to torch, with a warning).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from engine.cpu_isa import bf16_dot_products, cpu_capability, cpu_flags, forced_isa

logger = logging.getLogger(__name__)

BUILD_WAIT_S = 600.0
"""How long a start waits for another process's build of the same library (a first build on two cores takes
about a minute)."""
_FLAGS = ["-O3", "-std=c++20", "-fopenmp", "-ffp-contract=fast", "-fno-trapping-math"]
"""`-fopenmp` makes `at::parallel_for` parallel (it is OpenMP in the header) and enables `omp simd`; the OpenMP
runtime it links is the one torch ships (same soname, already loaded). FMA contraction is off by default in ISO
C++ mode. `-fno-trapping-math` lets a loop with a floating-point select (a clamp) vectorise (no kernel reads the
floating-point exception flags); it changes no result."""
_ISA_FLAGS = {
    "AVX2": ["-mavx2", "-mfma", "-mf16c"],
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"],
}
"""By `cpu_capability()` (torch's own, or AVX2 where `FERRY_CPU_ISA=avx2` forces it); any other capability builds
for the architecture's baseline. An AVX-512 CPU with bfloat16 dot products adds `-mavx512bf16`
(`bf16_dot_products`), and the int8 dot products the CPU has are added by `_vnni_flags`."""


class KernelUnavailable(RuntimeError):
    """A kernel could not be built or loaded here (no compiler, no ninja, a failed build, another's build too slow)."""


def build_flags() -> list[str]:
    return [
        *_FLAGS,
        *_ISA_FLAGS.get(cpu_capability(), []),
        *(["-mavx512bf16"] if bf16_dot_products() else []),
        *_vnni_flags(),
    ]


def int8_dot_products() -> bool:
    """Whether the CPU kernels are built with int8 dot products (`_vnni_flags`): their int8 weight-only kernel then
    takes its codes in groups of 4 k (engine/kernels/quant_linear.py)."""
    return bool(_vnni_flags())


def _vnni_flags() -> list[str]:
    """The int8 dot products (`vpdpbusd`) of the int8 and W8A8 kernels (cpu_quant_linear.cpp), where the CPU has
    them: the 512-bit ones of AVX512-VNNI in an AVX-512 build, the 256-bit ones of AVX-VNNI in an AVX2 build. An AVX2
    build that `FERRY_CPU_ISA=avx2` forces takes neither, as the AVX2-only CPUs it stands for (AVX-VNNI came after
    AVX2 by years): their W8A8 kernel multiplies with AVX2's `vpmaddubsw`, their int8 one in float32."""
    flags = cpu_flags()
    if cpu_capability() == "AVX512" and "avx512_vnni" in flags:
        return ["-mavx512vnni"]
    if cpu_capability() == "AVX2" and forced_isa() is None and "avx_vnni" in flags:
        return ["-mavxvnni"]
    return []


def cache_root() -> Path:
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    return Path(base) / "ferry"


def library_name(prefix: str, sources: Sequence[Path], flags: Sequence[str]) -> str:
    """A name unique to everything the binary depends on: the sources' (and headers') text, flags, compiler, torch."""
    parts = [*(source.read_text() for source in sources), *flags, os.environ.get("CXX", "c++"), torch.__version__]
    return f"{prefix}_{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:16]}"


def load_library(
    prefix: str, sources: Sequence[Path], what: str, *, headers: Sequence[Path] = (), wait_s: float = BUILD_WAIT_S
) -> Path:
    """Load the library built from `sources` into this process (its `TORCH_LIBRARY` ops join `torch.ops`), building
    it first unless a build of the very same inputs is cached; returns its path. `headers`: files the sources
    include (beside them), part of the name and of the build folder, not compiled themselves. `what` names it in
    log lines. Raises `KernelUnavailable`."""
    flags = build_flags()
    name = library_name(prefix, [*sources, *headers], flags)
    root = cache_root()
    library = root / name / f"{name}.so"
    if not library.exists():
        try:
            root.mkdir(parents=True, exist_ok=True)
            with _turn(root / f"{name}.lock", wait_s, what):
                if not library.exists():  # another process may have built it while this one waited
                    _build(name, sources, headers, flags, root, library, what)
                    return library  # the build loaded it
        except KernelUnavailable:
            raise
        except Exception as error:  # the tooling raises RuntimeError, OSError, CalledProcessError, ...
            raise KernelUnavailable(f"{type(error).__name__}: {_gist(str(error))}") from error
    logger.info("loading the %s %s", what, name)
    try:
        torch.ops.load_library(str(library))
    except OSError as error:
        raise KernelUnavailable(f"{library} does not load: {error}") from error
    return library


@contextlib.contextmanager
def _turn(lock_path: Path, wait_s: float, what: str) -> Iterator[None]:
    """Hold the build lock of one library; released by the OS if this process dies holding it."""
    with open(lock_path, "a") as lock:
        deadline = time.monotonic() + wait_s
        told = False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise KernelUnavailable(
                        f"another process has been building the {what} for over {wait_s:.0f} s"
                    ) from None
                if not told:
                    logger.info("waiting for another process to finish building the %s", what)
                    told = True
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(
    name: str, sources: Sequence[Path], headers: Sequence[Path], flags: list[str], root: Path, library: Path, what: str
) -> None:
    """Build the library in a folder of its own, load it (torch's tooling does both) and move it into place."""
    from torch.utils import cpp_extension

    # Folders of builds that were stopped halfway: nobody builds this library but the lock's holder.
    for stale in root.glob(f".{name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    logger.info("building the %s for this machine (once; about a minute on two cores)", what)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        for header in headers:
            shutil.copy(header, work / header.name)
        copies = [str(shutil.copy(source, work / source.name)) for source in sources]
        cpp_extension.load(
            name=name,
            sources=copies,
            build_directory=str(work),
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
        library.parent.mkdir(exist_ok=True)
        os.replace(work / f"{name}.so", library)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    logger.info("built the %s in %.0f s", what, time.monotonic() - started)


def _gist(message: str) -> str:
    """The compiler's errors, else the last lines: a build failure's message starts with whole command lines."""
    lines = [line.strip() for line in message.strip().splitlines()]
    errors = [line for line in lines if "error" in line.lower()]
    return " | ".join(errors[:3] or lines[-3:])

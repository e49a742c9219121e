"""Which threads of a process compute in parallel: in an instance process, the engine's thread alone.

torch runs its CPU ops on OpenMP, and on Linux that is libgomp. libgomp keeps a pool of worker threads for
every thread that has once started a parallel region, for the life of that thread. While it manages no more
threads than the process may use CPUs, a worker spins between two regions; past that, it sleeps and is
woken by the kernel for each one. A decode step is hundreds of short regions (a linear, a norm, a kernel
per layer), so those wake-ups decide its time: on 2 cores, SmolLM2's decode step at batch 1 went from
about 40 ms to about 58 ms once one side thread had copied a large tensor in parallel (the KV import's
copy, or the engine built on a loader thread), and stayed there.

So an instance builds and steps its engine on one thread (`EngineLoop`), which computes on the engine's
`num_threads`, and the other threads there that may touch torch compute alone (`compute_alone()`): the
KV copy thread and the event loop's default executor (`EngineLoop.start_engine`), and the event loop's own
thread (`mooncake serve`). Their work is small copies and checks, where parallelism buys little. Where the
process's OpenMP is not libgomp, or there is none, nothing changes. MKL's own per-thread count is set too:
torch sets it on each thread from its process-wide count, and its matmuls would start a pool otherwise.

How long a worker spins is libgomp's `GOMP_SPINCOUNT` (or `OMP_WAIT_POLICY`), read once at start. Its
default (about 300,000 turns) suits an instance alone on its cores. Where prefill and decode share the same
cores (`mooncake dev` on one box), a worker that spins while its partner waits for a core steals that core
from the other instance: `mooncake dev` sets a short spin for its instances (`DEV_SPIN_COUNT`)."""

import ctypes
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import torch

log = logging.getLogger(__name__)

_setters = None  # this thread's OpenMP and MKL thread counts, as torch loaded them


def compute_alone() -> None:
    """torch's ops on the calling thread run on it alone from now on: OpenMP's thread count and MKL's
    (its matmuls) are per-thread settings, where torch's `set_num_threads` would change every thread's
    default too."""
    setters = _per_thread_setters()
    if not setters:
        return
    torch.get_num_threads()  # NOTE: first torch's own per-thread setup, which would undo ours
    for setter in setters:
        setter(1)


def side_executor(name: str, max_workers: int = 1) -> ThreadPoolExecutor:
    """An executor whose threads compute alone."""
    return ThreadPoolExecutor(max_workers, thread_name_prefix=name, initializer=compute_alone)


def _per_thread_setters() -> list:
    global _setters
    if _setters is None:
        _setters = []
        # NOTE: the libraries torch already loaded, never a second copy (RTLD_NOLOAD): libgomp by its soname,
        # MKL linked into libtorch_cpu, by its C name (the lower-case ones are Fortran's, by pointer)
        libraries = [("libgomp.so.1", "omp_set_num_threads"),
                     (os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"),
                      "MKL_Set_Num_Threads_Local")]
        for name, symbol in libraries:
            try:
                setter = getattr(ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY), symbol)
            except (OSError, AttributeError) as exc:
                log.info("no %s here (%s): side threads keep that thread count", symbol, exc)
                continue
            setter.argtypes = [ctypes.c_int]
            _setters.append(setter)
        if not any(s.__name__ == "omp_set_num_threads" for s in _setters):
            _setters = []  # NOTE: MKL alone would not stop OpenMP's pools
    return _setters

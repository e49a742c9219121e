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
process's OpenMP is not libgomp, or there is none, nothing changes.

How long a worker spins is libgomp's `GOMP_SPINCOUNT` (or `OMP_WAIT_POLICY`), read once at start. Its
default (about 300,000 turns) suits an instance alone on its cores. Where prefill and decode share the same
cores (`mooncake dev` on one box), a worker that spins while its partner waits for a core steals that core
from the other instance: `mooncake dev` sets a short spin for its instances (`DEV_SPIN_COUNT`)."""

import ctypes
import logging
from concurrent.futures import ThreadPoolExecutor

import torch

log = logging.getLogger(__name__)

_omp_set_num_threads = None  # libgomp's, as torch loaded it; False where there is none


def compute_alone() -> None:
    """torch's ops on the calling thread run on it alone from now on (OpenMP's thread count is a
    per-thread setting; torch's `set_num_threads` would change every thread's default too)."""
    setter = _setter()
    if not setter:
        return
    torch.get_num_threads()  # NOTE: first torch's own per-thread setup, which would undo ours
    setter(1)


def side_executor(name: str, max_workers: int = 1) -> ThreadPoolExecutor:
    """An executor whose threads compute alone."""
    return ThreadPoolExecutor(max_workers, thread_name_prefix=name, initializer=compute_alone)


def _setter():
    global _omp_set_num_threads
    if _omp_set_num_threads is None:
        try:
            # NOTE: by its soname, dlopen returns the libgomp torch already loaded, not a second runtime
            _omp_set_num_threads = ctypes.CDLL("libgomp.so.1").omp_set_num_threads
            _omp_set_num_threads.argtypes = [ctypes.c_int]
        except (OSError, AttributeError) as exc:
            log.info("no libgomp here (%s): side threads keep torch's thread count", exc)
            _omp_set_num_threads = False
    return _omp_set_num_threads

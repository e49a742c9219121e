#!/usr/bin/env python3
"""Transfer benchmark: moving KV block payloads between two processes on this host, beside the limits.

Rows: memcpy in one process (the physical limit), raw ZeroMQ request/reply with zero-copy frames (the
baseline for our tcp transport), each of our transports (send = put into the peer, fetch = get from it),
and our store's put and get from a client process through a `mooncake serve --role cache` node. Payloads
of 1, 4 and 16 MiB and one block of the default model. Prints a table, writes JSON."""

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import zmq
import zmq.asyncio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mooncake.config import CacheClientConfig  # noqa: E402
from mooncake.registry import load_backend  # noqa: E402
from mooncake.runtime import tune_allocator  # noqa: E402

MiB = 1 << 20
# SmolLM2-135M: 30 layers x (K, V) x 64 tokens x 3 KV heads x 64 dims x 4 bytes (float32)
MODEL_BLOCK = 30 * 2 * 64 * 3 * 64 * 4


class Sink:
    """The peer's BlockService in this benchmark: keeps the last bytes per key, as the decode inbox does.
    Like the inbox it says `keeps_blocks`, so each transport hands it bytes it may hold: a tcp receiver
    its ZeroMQ frames as they are; shm and mooncake a copy out of their reused buffers, hashed as it is
    copied."""

    keeps_blocks = True

    def __init__(self):
        self.blocks = {}

    def put_block(self, key, data):
        self.blocks[key] = data

    def get_block(self, key):
        return self.blocks.get(key)


# -- peer process ----------------------------------------------------------------------------------

async def serve_transport(name: str, sizes: list[int]) -> None:
    transport = load_backend("transports", name)()
    sink = Sink()
    for size in sizes:  # blocks the client will fetch
        sink.blocks[size] = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8).tobytes()
    print(await transport.start(sink), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the client closes it
    await transport.stop()


def serve_raw_zmq() -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(f"tcp://127.0.0.1:{port}", flush=True)
    while True:
        identity, *frames = sock.recv_multipart(copy=False)
        sock.send_multipart([identity, b"ok"])


def serve_mooncake_store(role: str, master: str, metadata: str, sizes: list[int], budget: int) -> None:
    """A Mooncake Store process from the same wheel: `storage` contributes 2 GiB of DRAM to the pool;
    `client` measures put and get of every size and prints them as one JSON line."""
    from backends.transports.mooncake_te import load_wheel_module
    store = load_wheel_module("store").MooncakeDistributedStore()
    segment = 2 << 30 if role == "storage" else 0
    if store.setup("127.0.0.1", metadata, segment, 256 << 20, "tcp", "", master) != 0:
        raise SystemExit(f"Mooncake Store {role}: setup failed")
    if role == "storage":
        print("ready", flush=True)
        sys.stdin.read()
        return
    results = {}
    for size in sizes:
        payload = np.random.default_rng(4).integers(0, 255, size, dtype=np.uint8).tobytes()
        n = iterations(size, budget)
        t0 = time.perf_counter()
        for i in range(n):
            if store.put(f"bench-{size}-{i}", payload) != 0:
                raise SystemExit(f"Mooncake Store put of {size} bytes failed")
        put = rate(size, time.perf_counter() - t0, n)
        t0 = time.perf_counter()
        for i in range(n):
            if len(store.get(f"bench-{size}-{i}")) != size:
                raise SystemExit(f"Mooncake Store get of {size} bytes failed")
        results[size] = {"put": put, "get": rate(size, time.perf_counter() - t0, n)}
    print(json.dumps(results), flush=True)


def bench_mooncake_store(sizes: list[int], budget: int) -> dict | None:
    """Master, storage process and client process of Mooncake Store on loopback; None if not installed."""
    from mooncake.env import mooncake_te_dir
    binary = mooncake_te_dir() / "mooncake" / "mooncake_master"
    if not binary.exists():
        print(f"Mooncake Store: {binary} not found (make mooncake-te); skipped", file=sys.stderr)
        return None
    rpc, http = free_port(), free_port()
    master = subprocess.Popen([str(binary), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
                               "--enable_http_metadata_server=true", f"--http_metadata_server_port={http}",
                               "--http_metadata_server_host=127.0.0.1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    args = [f"127.0.0.1:{rpc}", f"http://127.0.0.1:{http}/metadata", str(budget)]
    storage = client = None
    try:
        time.sleep(1.0)
        storage, ready = spawn("--serve", "mc-store-storage", "--mc", *args)
        if ready != "ready":
            return None
        client, line = spawn("--serve", "mc-store-client", "--mc", *args)
        client.wait(timeout=600)
        return {int(k): v for k, v in json.loads(line).items()} if line.startswith("{") else None
    finally:
        for proc in (client, storage):
            if proc is not None:
                end(proc)
        master.terminate()
        master.wait(timeout=10)


def spawn(*args) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=ROOT)
    return proc, proc.stdout.readline().strip()


def end(proc: subprocess.Popen) -> None:
    try:
        proc.stdin.close()
        proc.wait(timeout=5)
    except (subprocess.TimeoutExpired, BrokenPipeError):
        proc.kill()
        proc.wait()


# -- measurements ------------------------------------------------------------------------------------

def rate(size: int, seconds: float, count: int) -> float:
    return size * count / seconds / 1e9


def iterations(size: int, budget_bytes: int) -> int:
    return max(3, min(200, budget_bytes // size))


def bench_memcpy(size: int, budget: int) -> float:
    """One copy of data not already in cache: the physical limit of moving a block between processes.
    Cycles through a working set of 512 MiB (larger than the last-level cache) so no copy hits cache."""
    count = max(2, (512 * MiB) // size)
    src = np.random.default_rng(0).integers(0, 255, size * count, dtype=np.uint8)
    dst = np.empty_like(src)
    n = iterations(size, budget)
    np.copyto(dst, src)
    t0 = time.perf_counter()
    for i in range(n):
        j = (i % count) * size
        np.copyto(dst[j:j + size], src[j:j + size])
    return rate(size, time.perf_counter() - t0, n)


def bench_raw_zmq(address: str, size: int, budget: int, in_flight: int = 1) -> float:
    """Request/reply with zero-copy frames and no checks, at most `in_flight` requests outstanding."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    payload = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8).tobytes()
    n = iterations(size, budget)
    sock.send_multipart([b"h", payload], copy=False)
    sock.recv()
    t0 = time.perf_counter()
    sent = received = 0
    while received < n:
        while sent < n and sent - received < in_flight:
            sock.send_multipart([b"h", payload], copy=False)
            sent += 1
        sock.recv()
        received += 1
    elapsed = time.perf_counter() - t0
    sock.close(linger=0)
    return rate(size, elapsed, n)


async def bench_transport(name: str, address: str, size: int, budget: int, window: int) -> dict[str, float]:
    """send and fetch rates, one transfer at a time and with `window` in flight (a stream of blocks, as
    prefill pushes KV chunk after chunk: one side stages the next while the other verifies this one)."""
    client = load_backend("transports", name)()
    await client.start()
    payload = np.random.default_rng(2).integers(0, 255, size, dtype=np.uint8).tobytes()
    n = iterations(size, budget)
    ops = {"send": lambda: client.send(address, [(size, payload)], timeout_s=30),
           "fetch": lambda: client.fetch(address, [size], timeout_s=30)}
    rates = {}
    try:
        for op_name, op in ops.items():
            assert (await op()).ok  # warm-up
            for label, in_flight in ((op_name, 1), (f"{op_name}_x{window}", window)):
                rates[label] = rate(size, await timed(op, n, in_flight), n)
    finally:
        await client.stop()
    return rates


async def timed(op, n: int, in_flight: int) -> float:
    """Seconds to run `op` n times, at most `in_flight` at once; every result must be ok."""
    slots = asyncio.Semaphore(in_flight)

    async def one():
        async with slots:
            result = await op()
            assert result.ok, result

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return time.perf_counter() - t0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def bench_store(config_path: Path, control: str, sizes: list[int], budget: int) -> dict:
    from mooncake.store.client import CacheClient
    proc = subprocess.Popen([sys.executable, "-m", "mooncake", "serve", "--role", "cache", "--config",
                             str(config_path)], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = CacheClient(CacheClientConfig(nodes=(control,), timeout_s=30))
        # ZeroMQ queues the hello until the node is listening, so this also waits for it to start.
        await client.start()
        # Warm-up, as for the transports: the first put and get map the node's DRAM file (page tables
        # filled up front), a one-time cost per client and node.
        assert (await client.put_blocks([(0, b"warm-up")]))[0] is None
        assert (await client.get_blocks([0]))[0] == b"warm-up"
        results, key = {}, 1
        for size in sizes:
            payload = np.random.default_rng(3).integers(0, 255, size, dtype=np.uint8).tobytes()
            n = iterations(size, budget)
            t0 = time.perf_counter()
            for _ in range(n):  # every put is a new key: a repeated key would be a no-op
                key += 1
                assert (await client.put_blocks([(key, payload)]))[key] is None
            put = rate(size, time.perf_counter() - t0, n)
            t0 = time.perf_counter()
            for _ in range(n):
                assert (await client.get_blocks([key]))[key] is not None
            get = rate(size, time.perf_counter() - t0, n)
            results[size] = {"put": put, "get": get}
        await client.stop()
        return results
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)


def measure(args, sizes: list[int], budget: int) -> dict[int, dict[str, float]]:
    """One pass over every row: GB/s by payload size and row name."""
    table = {size: {} for size in sizes}
    for size in sizes:
        table[size]["memcpy"] = bench_memcpy(size, budget)
    proc, address = spawn("--serve", "raw-zmq")
    for size in sizes:
        table[size]["raw_zmq"] = bench_raw_zmq(address, size, budget)
        table[size][f"raw_zmq_x{args.window}"] = bench_raw_zmq(address, size, budget, args.window)
    proc.kill()
    proc.wait()
    names = [n for n in args.transports.split(",") if n]
    for name in list(names):
        proc, address = spawn("--serve", name)
        if not address:
            print(f"transport {name}: peer did not start (is it installed?); skipped", file=sys.stderr)
            names.remove(name)
            end(proc)
            continue
        for size in sizes:
            for label, value in asyncio.run(bench_transport(name, address, size, budget, args.window)).items():
                table[size][f"{name}_{label}"] = value
        end(proc)

    control = f"tcp://127.0.0.1:{free_port()}"
    config = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-cache-{os.getpid()}.toml"
    config.write_text(f'[store]\ndram_bytes = {4 << 30}\n[cache]\ncontrol_address = "{control}"\n'
                      f'events_address = "tcp://127.0.0.1:{free_port()}"\ntransport = "shm"\n')
    try:
        for size, row in asyncio.run(bench_store(config, control, sizes, budget)).items():
            table[size]["store_put"], table[size]["store_get"] = row["put"], row["get"]
    finally:
        config.unlink(missing_ok=True)

    mc = bench_mooncake_store(sizes, budget)
    for size, row in (mc or {}).items():
        table[size]["mc_store_put"], table[size]["mc_store_get"] = row["put"], row["get"]

    return table


def main() -> None:
    tune_allocator()  # every role process runs with it (mooncake/runtime.py), and so do these
    try:  # every role runs on uvloop (mooncake/runtime.py): measure on it too
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transports", default="tcp,shm,mooncake")
    parser.add_argument("--budget-mib", type=int, default=512, help="bytes moved per measurement, about")
    parser.add_argument("--window", type=int, default=4, help="transfers in flight for the streaming rows")
    parser.add_argument("--repeat", type=int, default=1, help="passes over every row; each cell is their median")
    parser.add_argument("--out", default="bench-results/transfer.json")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--mc", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [1 * MiB, MODEL_BLOCK, 4 * MiB, 16 * MiB]
    if args.serve == "raw-zmq":
        return serve_raw_zmq()
    if args.serve and args.serve.startswith("mc-store-"):
        master, metadata, budget = args.mc
        return serve_mooncake_store(args.serve.removeprefix("mc-store-"), master, metadata, sizes, int(budget))
    if args.serve:
        return asyncio.run(serve_transport(args.serve, sizes))

    budget = args.budget_mib * MiB
    runs = [measure(args, sizes, budget) for _ in range(args.repeat)]
    # The median of each cell over the runs: this host is shared and a single pass is noisy.
    table = {size: {c: float(np.median([r[size][c] for r in runs if c in r[size]])) for c in runs[0][size]}
             for size in sizes}
    columns = list(table[sizes[0]])
    widths = [max(15, len(c) + 2) for c in columns]
    print(f"\nGB/s between two processes on this host ({os.cpu_count()} cores), median of {args.repeat} pass(es)")
    print(f"{'payload':>10}" + "".join(f"{c:>{w}}" for c, w in zip(columns, widths)))
    for size in sizes:
        label = f"{size / MiB:.2f} MiB"
        print(f"{label:>10}" + "".join(f"{table[size][c]:>{w}.2f}" for c, w in zip(columns, widths)))
    print("\nratios (goal): shm/memcpy (>= 0.6), tcp/raw zmq (>= 0.9), our store over shm/memcpy (for reference), "
          "ours/Mooncake Store")
    for size in sizes:
        row = table[size]
        parts = []
        w = args.window
        if "shm_send" in row:
            parts.append(f"shm send/memcpy {row['shm_send'] / row['memcpy']:.2f}x "
                         f"(x{w}: {row[f'shm_send_x{w}'] / row['memcpy']:.2f}x), "
                         f"fetch/memcpy {row['shm_fetch'] / row['memcpy']:.2f}x "
                         f"(x{w}: {row[f'shm_fetch_x{w}'] / row['memcpy']:.2f}x)")
        if "tcp_send" in row:
            parts.append(f"tcp send/raw zmq {row['tcp_send'] / row['raw_zmq']:.2f}x "
                         f"(x{w}: {row[f'tcp_send_x{w}'] / row[f'raw_zmq_x{w}']:.2f}x), "
                         f"fetch/raw zmq {row['tcp_fetch'] / row['raw_zmq']:.2f}x "
                         f"(x{w}: {row[f'tcp_fetch_x{w}'] / row[f'raw_zmq_x{w}']:.2f}x)")
        if "store_put" in row:  # a same-host cache node: one copy each way (write windows, reads from DRAM)
            parts.append(f"store put/memcpy {row['store_put'] / row['memcpy']:.2f}x, "
                         f"get/memcpy {row['store_get'] / row['memcpy']:.2f}x")
        if "mc_store_put" in row:
            parts.append(f"store put/Mooncake Store {row['store_put'] / row['mc_store_put']:.2f}x (>= 5), "
                         f"get {row['store_get'] / row['mc_store_get']:.2f}x (>= 3)")
        print(f"{size / MiB:>7.2f} MiB: " + "; ".join(parts))
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({str(k): v for k, v in table.items()}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

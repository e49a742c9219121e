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

MiB = 1 << 20
# SmolLM2-135M: 30 layers x (K, V) x 64 tokens x 3 KV heads x 64 dims x 4 bytes (float32)
MODEL_BLOCK = 30 * 2 * 64 * 3 * 64 * 4


class Sink:
    """The peer's BlockService in this benchmark: keeps the last bytes per key. A tcp receiver already
    owns its ZeroMQ frames and keeps them as they are; shm and mooncake hand out views of a staging
    buffer that is reused, so those are copied, as any receiver would have to."""

    def __init__(self, copy: bool):
        self.copy = copy
        self.blocks = {}

    def put_block(self, key, data):
        self.blocks[key] = bytes(data) if self.copy else data

    def get_block(self, key):
        return self.blocks.get(key)


# -- peer process ----------------------------------------------------------------------------------

async def serve_transport(name: str, sizes: list[int]) -> None:
    transport = load_backend("transports", name)()
    sink = Sink(copy=name != "tcp")
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
    src = np.random.default_rng(0).integers(0, 255, size, dtype=np.uint8)
    dst = np.empty_like(src)
    n = iterations(size, budget)
    np.copyto(dst, src)
    t0 = time.perf_counter()
    for _ in range(n):
        np.copyto(dst, src)
    return rate(size, time.perf_counter() - t0, n)


def bench_raw_zmq(address: str, size: int, budget: int) -> float:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(address)
    payload = np.random.default_rng(1).integers(0, 255, size, dtype=np.uint8).tobytes()
    n = iterations(size, budget)
    sock.send_multipart([b"h", payload], copy=False)
    sock.recv()
    t0 = time.perf_counter()
    for _ in range(n):
        sock.send_multipart([b"h", payload], copy=False)
        sock.recv()
    elapsed = time.perf_counter() - t0
    sock.close(linger=0)
    return rate(size, elapsed, n)


async def bench_transport(name: str, address: str, size: int, budget: int) -> tuple[float, float]:
    client = load_backend("transports", name)()
    await client.start()
    payload = np.random.default_rng(2).integers(0, 255, size, dtype=np.uint8).tobytes()
    n = iterations(size, budget)
    try:
        await client.send(address, [(size, payload)], timeout_s=30)
        t0 = time.perf_counter()
        for _ in range(n):
            result = await client.send(address, [(size, payload)], timeout_s=30)
            assert result.ok, result
        send = rate(size, time.perf_counter() - t0, n)
        await client.fetch(address, [size], timeout_s=30)
        t0 = time.perf_counter()
        for _ in range(n):
            result = await client.fetch(address, [size], timeout_s=30)
            assert result.ok, result
        fetch = rate(size, time.perf_counter() - t0, n)
    finally:
        await client.stop()
    return send, fetch


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
        for _ in range(100):  # wait for the node to answer
            try:
                await client.start()
                break
            except Exception:  # noqa: BLE001  not up yet
                await client.stop()
                client = CacheClient(CacheClientConfig(nodes=(control,), timeout_s=0.3))
        client.config = CacheClientConfig(nodes=(control,), timeout_s=30)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transports", default="tcp,shm,mooncake")
    parser.add_argument("--budget-mib", type=int, default=512, help="bytes moved per measurement, about")
    parser.add_argument("--out", default="bench-results/transfer.json")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [1 * MiB, MODEL_BLOCK, 4 * MiB, 16 * MiB]
    if args.serve == "raw-zmq":
        return serve_raw_zmq()
    if args.serve:
        return asyncio.run(serve_transport(args.serve, sizes))

    budget = args.budget_mib * MiB
    table = {size: {} for size in sizes}
    for size in sizes:
        table[size]["memcpy"] = bench_memcpy(size, budget)
    proc, address = spawn("--serve", "raw-zmq")
    for size in sizes:
        table[size]["raw_zmq"] = bench_raw_zmq(address, size, budget)
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
            send, fetch = asyncio.run(bench_transport(name, address, size, budget))
            table[size][f"{name}_send"], table[size][f"{name}_fetch"] = send, fetch
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

    columns = list(table[sizes[0]])
    print(f"\nGB/s between two processes on this host ({os.cpu_count()} cores)")
    print(f"{'payload':>10}" + "".join(f"{c:>14}" for c in columns))
    for size in sizes:
        label = f"{size / MiB:.2f} MiB"
        print(f"{label:>10}" + "".join(f"{table[size][c]:>14.2f}" for c in columns))
    print("\nratios (goal): shm/memcpy (>= 0.6), tcp/raw zmq (>= 0.9)")
    for size in sizes:
        row = table[size]
        parts = []
        if "shm_send" in row:
            parts.append(f"shm send/memcpy {row['shm_send'] / row['memcpy']:.2f}x, "
                         f"fetch/memcpy {row['shm_fetch'] / row['memcpy']:.2f}x")
        if "tcp_send" in row:
            parts.append(f"tcp send/raw zmq {row['tcp_send'] / row['raw_zmq']:.2f}x, "
                         f"fetch/raw zmq {row['tcp_fetch'] / row['raw_zmq']:.2f}x")
        print(f"{size / MiB:>7.2f} MiB: " + "; ".join(parts))
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({str(k): v for k, v in table.items()}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()

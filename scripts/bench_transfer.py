#!/usr/bin/env python3
"""Transfer benchmark: moving KV block payloads between two processes on this host, beside the limits.

Rows: memcpy in one process (the physical limit), raw ZeroMQ request/reply with zero-copy frames (the
baseline for our tcp transport), each of our transports (send = put into the peer, fetch = get from it),
and our store's put and get from a client process through a `mooncake serve --role cache` node. Payloads
of 1, 4 and 16 MiB and one block of the default model. Prints a table, writes JSON.

`--netns`: the same rows for raw ZeroMQ, tcp and mooncake between two hosts made of network namespaces
(mooncake/netns.py; root), each with authentication off and on (CURVE with a cluster key pair, as the
roles run it), and what authentication costs: the data path's price of "only the cluster talks".

`--netns --baseline REF`: this tree's --netns rows beside those of git revision REF (checked out in a
temporary worktree), in rounds that alternate which goes first; prints each cell's median ratio this/REF
and writes both tables and the ratios (what a change to the data path costs, on the same box, same run)."""

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import zmq
import zmq.asyncio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mooncake import security  # noqa: E402
from mooncake.config import CacheClientConfig, load_config  # noqa: E402
from mooncake.dev import free_port  # noqa: E402
from mooncake.hashing import checksum  # noqa: E402
from mooncake.kv_payload import KVPayload, bound_digest  # noqa: E402
from mooncake.transfer.contract import BlockLocation, BlockService  # noqa: E402
from mooncake.registry import load_backend  # noqa: E402
from mooncake.runtime import tune_allocator  # noqa: E402
from scripts.kv_schemes import KEYED, XXH3, xxh3_check, xxh3_payload  # noqa: E402
from scripts.transfer_report import report, report_netns, write_json  # noqa: E402

MiB = 1 << 20
# SmolLM2-135M: 30 layers x (K, V) x 64 tokens x 3 KV heads x 64 dims x 4 bytes (float32)
MODEL_BLOCK = 30 * 2 * 64 * 3 * 64 * 4


class Sink(BlockService):
    """The peer's BlockService in this benchmark: keeps the last bytes per key, as the decode inbox does.
    Like the inbox it says `keeps_blocks`, so each transport hands it bytes it may hold: a tcp receiver
    its ZeroMQ frames as they are; shm and mooncake a copy out of their reused buffers, hashed as it is
    copied (unless the block carries its own check). A fetch is served as a cache node serves it: with
    the checksum a block was put with; one put without hashes each fetch (a plain get_block would)."""

    keeps_blocks = True
    locates_blocks = True

    def __init__(self):
        self.blocks, self.sums = {}, {}

    def put_block(self, key, data, checksum=None):
        if key & KEYED:  # the kv rows: the consumer's check, as decode's import makes it
            KVPayload.from_bytes(data).verify(namespace=b"m")
        elif key & XXH3:
            xxh3_check(data)
        self.blocks[key], self.sums[key] = data, checksum

    def get_block(self, key):
        return self.blocks.get(key)

    def locate_block(self, key):
        data = self.blocks.get(key)
        if data is None:
            return None
        known = self.sums.get(key)
        return BlockLocation(data, known if known is not None else checksum(data))


# -- peer process ----------------------------------------------------------------------------------

async def serve_transport(name: str, sizes: list[int], host: str = "127.0.0.1") -> None:
    transport = load_backend("transports", name)(host=host)
    sink = Sink()
    for size in sizes:  # blocks the client will fetch: hashed each time, and one that carries its own check
        sink.blocks[size] = np.random.default_rng(size).integers(0, 255, size, dtype=np.uint8).tobytes()
        sink.put_block(size + 1, sink.blocks[size], bound_digest(sink.blocks[size]))
    print(await transport.start(sink), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the client closes it
    await transport.stop()


def serve_raw_zmq(host: str = "127.0.0.1") -> None:
    ctx = zmq.Context()
    sock = security.server(ctx.socket(zmq.ROUTER), security.DATA_MAX_BYTES)  # CURVE iff keys are set
    port = sock.bind_to_random_port(f"tcp://{host}")
    print(f"tcp://{host}:{port}", flush=True)
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


def spawn(*args, netns: str | None = None) -> tuple[subprocess.Popen, str]:
    """This script as a peer process (in network namespace `netns`, if given); its first line of output."""
    prefix = ["ip", "netns", "exec", netns] if netns else []
    proc = subprocess.Popen([*prefix, sys.executable, __file__, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
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
    sock = security.client(ctx.socket(zmq.DEALER), security.DATA_MAX_BYTES, server="prefill")  # CURVE iff keys
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


async def bench_transport(name: str, address: str, size: int, budget: int, window: int,
                          host: str = "127.0.0.1") -> dict[str, float]:
    """send and fetch rates, one transfer at a time and with `window` in flight (a stream of blocks, as
    prefill pushes KV chunk after chunk: one side stages the next while the other verifies this one).
    `_own` rows: blocks that carry their own check (KV payloads: `self_checked`), which no transport
    hashes; the others are hashed by sender and receiver, as any frame without a check of its own. `kv`
    rows: a KV payload made (its MAC computed) for each send and checked by the receiver as decode checks
    one; `kv_xxh3` the same with the unkeyed xxh3 checks payloads had before (the baseline, same run)."""
    client = load_backend("transports", name)(host=host)
    await client.start()
    payload = np.random.default_rng(2).integers(0, 255, size, dtype=np.uint8).tobytes()
    n = iterations(size, budget)
    ops = {"send": lambda: client.send(address, [(size, payload)], timeout_s=30),
           "send_own": lambda: client.send(address, [(size, payload)], timeout_s=30, self_checked=True),
           "send_kv": lambda: client.send(address, [(KEYED | size, KVPayload.of(1, b"m", "uint8", (size,), None,
                                                                                payload).to_bytes())],
                                          timeout_s=30, self_checked=True),
           "send_kv_xxh3": lambda: client.send(address, [(XXH3 | size, xxh3_payload(payload))], timeout_s=30,
                                               self_checked=True),
           "fetch": lambda: client.fetch(address, [size], timeout_s=30),
           "fetch_own": lambda: client.fetch(address, [size + 1], timeout_s=30)}
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
            results[size] = {}
            for suffix, own in (("", False), ("_own", True)):  # _own: KV payloads, put self_checked
                t0 = time.perf_counter()
                for _ in range(n):  # every put is a new key: a repeated key would be a no-op
                    key += 1
                    assert (await client.put_blocks([(key, payload)], self_checked=own))[key] is None
                results[size][f"put{suffix}"] = rate(size, time.perf_counter() - t0, n)
                t0 = time.perf_counter()
                for _ in range(n):
                    assert (await client.get_blocks([key]))[key] is not None
                results[size][f"get{suffix}"] = rate(size, time.perf_counter() - t0, n)
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
            table[size].update({f"store_{op}": value for op, value in row.items()})
    finally:
        config.unlink(missing_ok=True)

    mc = bench_mooncake_store(sizes, budget)
    for size, row in (mc or {}).items():
        table[size]["mc_store_put"], table[size]["mc_store_get"] = row["put"], row["get"]

    return table


# -- between network namespaces, authentication off and on ---------------------------------------------

def use_keys(keys_dir: str | None) -> None:
    """This process's sockets use CURVE with the cluster key pair in `keys_dir` (None: no keys)."""
    security.reset()
    if keys_dir:
        security.configure(load_config(None, {"security.keys_dir": keys_dir}))


def measure_netns(args, sizes: list[int], budget: int, server_netns: str, server_host: str,
                  client_host: str) -> dict[int, dict[str, float]]:
    """One pass, run in the client's namespace: raw ZeroMQ and each transport to a peer process in the
    server's namespace, with authentication off and then on."""
    table = {size: {} for size in sizes}
    names = [n for n in args.transports.split(",") if n in ("tcp", "mooncake")]
    for auth in ("off", "on"):
        use_keys(args.keys if auth == "on" else None)
        keys = ["--keys", args.keys] if auth == "on" else []
        proc, address = spawn("--serve", "raw-zmq", "--host", server_host, *keys, netns=server_netns)
        for size in sizes:
            table[size][f"raw_zmq_auth_{auth}"] = bench_raw_zmq(address, size, budget)
            table[size][f"raw_zmq_x{args.window}_auth_{auth}"] = bench_raw_zmq(address, size, budget, args.window)
        proc.kill()
        proc.wait()
        for name in names:
            proc, address = spawn("--serve", name, "--host", server_host, *keys, netns=server_netns)
            if not address:
                print(f"transport {name}: peer did not start (is it installed?); skipped", file=sys.stderr)
                end(proc)
                continue
            for size in sizes:
                rates = asyncio.run(bench_transport(name, address, size, budget, args.window, client_host))
                for label, value in rates.items():
                    table[size][f"{name}_{label}_auth_{auth}"] = value
            end(proc)
    use_keys(None)
    return table


def run_netns(args) -> None:
    """Build two namespace hosts, and run this script's client side in host 1 against peers in host 0."""
    import tempfile

    from mooncake.netns import NetnsLab, netns_unavailable
    if (why := netns_unavailable()) is not None:
        raise SystemExit(f"--netns: {why}")
    with tempfile.TemporaryDirectory(prefix="bench-keys-") as tmp, NetnsLab(2) as lab:
        keys = security.generate_keys(Path(tmp) / "keys")
        server, client = lab.hosts
        argv = [sys.executable, __file__, "--netns-client", server.netns, server.address, client.address,
                "--keys", str(keys), "--transports", args.transports, "--budget-mib", str(args.budget_mib),
                "--window", str(args.window), "--repeat", str(args.repeat), "--out", args.out]
        proc = lab.popen(client, argv, cwd=ROOT)
        if proc.wait(timeout=3600) != 0:
            raise SystemExit(f"the client in {client.netns} failed with status {proc.returncode}")


def run_baseline(args) -> None:
    """--baseline REF: --netns rows of this tree and of REF, rounds alternating; ratios this/REF."""
    import tempfile
    rows: dict[str, list[dict]] = {"this": [], "baseline": []}
    with tempfile.TemporaryDirectory(prefix="bench-baseline-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(tree), args.baseline],
                       check=True)
        try:
            for i in range(args.rounds):
                order = [("this", ROOT), ("baseline", tree)][::1 if i % 2 == 0 else -1]
                for label, root in order:
                    out = Path(tmp) / f"{label}-{i}.json"
                    print(f"round {i + 1}/{args.rounds}: {label} ({root})", flush=True)
                    subprocess.run([sys.executable, str(root / "scripts" / "bench_transfer.py"), "--netns",
                                    "--transports", args.transports, "--budget-mib", str(args.budget_mib),
                                    "--window", str(args.window), "--out", str(out)], cwd=root, check=True,
                                   stdout=subprocess.DEVNULL)
                    rows[label].append(json.loads(out.read_text()))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    sizes = list(rows["this"][0])
    cells = [c for c in rows["this"][0][sizes[0]] if c in rows["baseline"][0][sizes[0]] and c.startswith("tcp_")]
    ratios = {size: {c: float(np.median([t[size][c] / b[size][c] for t, b in zip(rows["this"], rows["baseline"])]))
                     for c in cells} for size in sizes}
    print(f"\nthis tree over {args.baseline} (median of {args.rounds} rounds; > 1: faster)")
    print(f"{'cell':<28}" + "".join(f"{int(s) / MiB:>10.2f} MiB" for s in sizes))
    for c in cells:
        print(f"{c:<28}" + "".join(f"{ratios[s][c]:>14.3f}" for s in sizes))
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"baseline": args.baseline, "rounds": args.rounds, "ratios": ratios,
                               "this": rows["this"], "baseline_rows": rows["baseline"]}, indent=2))
    print(f"\nwrote {out}")


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
    parser.add_argument("--out", help="JSON file (default: bench-results/transfer.json, with --netns "
                        "bench-results/transfer-netns.json)")
    parser.add_argument("--netns", action="store_true", help="between two network-namespace hosts (root), "
                        "raw ZeroMQ, tcp and mooncake, authentication off and on")
    parser.add_argument("--baseline", metavar="REF", help="with --netns: beside git revision REF, ratios this/REF")
    parser.add_argument("--rounds", type=int, default=3, help="with --baseline: rounds, each running both trees")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--keys", help=argparse.SUPPRESS)
    parser.add_argument("--netns-client", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--mc", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out = args.out or f"bench-results/transfer{'-netns' if args.netns or args.netns_client else ''}.json"
    sizes = [1 * MiB, MODEL_BLOCK, 4 * MiB, 16 * MiB]
    if args.netns and args.baseline:
        args.out = args.out if args.out != "bench-results/transfer-netns.json" else "bench-results/transfer-seal.json"
        return run_baseline(args)
    if args.netns:
        return run_netns(args)
    if args.serve:
        use_keys(args.keys)
    if args.serve == "raw-zmq":
        return serve_raw_zmq(args.host)
    if args.serve and args.serve.startswith("mc-store-"):
        master, metadata, budget = args.mc
        return serve_mooncake_store(args.serve.removeprefix("mc-store-"), master, metadata, sizes, int(budget))
    if args.serve:
        return asyncio.run(serve_transport(args.serve, sizes, args.host))

    budget = args.budget_mib * MiB
    if args.netns_client:
        runs = [measure_netns(args, sizes, budget, *args.netns_client) for _ in range(args.repeat)]
    else:
        runs = [measure(args, sizes, budget) for _ in range(args.repeat)]
    # The median of each cell over the runs: this host is shared and a single pass is noisy.
    table = {size: {c: float(np.median([r[size][c] for r in runs if c in r[size]])) for c in runs[0][size]}
             for size in sizes}
    if args.netns_client:
        report_netns(table, sizes, args)
        return write_json(table, args.out)
    report(table, sizes, args)
    write_json(table, args.out)


if __name__ == "__main__":
    main()

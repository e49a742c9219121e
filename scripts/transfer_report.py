"""bench_transfer.py's reports: its tables printed beside their goals, and written as JSON."""

import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def report(table: dict[int, dict[str, float]], sizes: list[int], args) -> None:
    """The table between two processes on this host, and each row over its limit or baseline."""
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
        own = [f"{name} {op} {row[f'{name}_{op}_own'] / row[f'{name}_{op}']:.2f}x"
               for name in [n for n in args.transports.split(",") if n] + ["store"]
               for op in (("put", "get") if name == "store" else ("send", "fetch")) if f"{name}_{op}_own" in row]
        if own:
            parts.append("own check/hashed in transit: " + ", ".join(own))
        if "mc_store_put" in row:
            parts.append(f"store put/Mooncake Store {row['store_put'] / row['mc_store_put']:.2f}x (>= 5), "
                         f"get {row['store_get'] / row['mc_store_get']:.2f}x (>= 3)")
        print(f"{size / MiB:>7.2f} MiB: " + "; ".join(parts))


def report_netns(table: dict[int, dict[str, float]], sizes: list[int], args) -> None:
    w = args.window
    columns = list(table[sizes[0]])
    print(f"\nGB/s between two network-namespace hosts (veth + bridge), median of {args.repeat} pass(es). "
          f"Authentication on: raw ZeroMQ with CURVE (encrypted); our transports as the roles run them, every "
          f"message sealed with the cluster's MAC (mooncake/security.py)")
    rows = list(dict.fromkeys(c.rsplit("_auth_", 1)[0] for c in columns))
    print(f"{'row':>22}" + "".join(f"{size / MiB:>12.2f} MiB" for size in sizes))
    for row in rows:
        for auth in ("off", "on"):
            cells = [table[size].get(f"{row}_auth_{auth}") for size in sizes]
            print(f"{row + ' ' + auth:>22}" + "".join(f"{c:>16.2f}" if c is not None else f"{'-':>16}" for c in cells))
    print("\nratios: ours (auth off, on) / raw ZeroMQ without auth between the same hosts (goal >= 0.9); "
          "auth on / off, what authentication costs (CURVE for raw ZeroMQ, the MAC for ours)")
    for size in sizes:
        row, parts = table[size], []

        def ratio(a: str, b: str) -> str:
            return f"{row[a] / row[b]:.2f}x" if a in row and b in row else "-"
        for name in ("tcp", "mooncake"):
            for auth in ("off", "on"):
                parts.append(f"{name} send {auth}/raw {ratio(f'{name}_send_auth_{auth}', 'raw_zmq_auth_off')} "
                             f"(x{w} {ratio(f'{name}_send_x{w}_auth_{auth}', f'raw_zmq_x{w}_auth_off')})")
        for name in ("tcp", "mooncake"):
            for auth in ("off", "on"):
                one = ratio(f"{name}_send_kv_auth_{auth}", f"{name}_send_kv_xxh3_auth_{auth}")
                many = ratio(f"{name}_send_kv_x{w}_auth_{auth}", f"{name}_send_kv_xxh3_x{w}_auth_{auth}")
                parts.append(f"{name} kv keyed/xxh3 {auth} {one} (x{w} {many})")
        for name in ("raw_zmq", "tcp_send", "tcp_fetch", "mooncake_send", "mooncake_fetch"):
            many = f"raw_zmq_x{w}" if name == "raw_zmq" else f"{name}_x{w}"
            parts.append(f"{name} on/off {ratio(f'{name}_auth_on', f'{name}_auth_off')} "
                         f"(x{w} {ratio(f'{many}_auth_on', f'{many}_auth_off')})")
        print(f"{size / MiB:>7.2f} MiB: " + "; ".join(parts))


def write_json(table: dict, path: str) -> None:
    out = ROOT / path
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({str(k): v for k, v in table.items()}, indent=2))
    print(f"\nwrote {out}")

#!/usr/bin/env python3
"""Chaos: replay trace requests against a dev cluster while killing, stopping and restarting its roles,
then check that every request ended, that nothing stayed held anywhere, and that no stream lost or
repeated a token.

The cluster (tiny model, every role its own process; by default 2 prefill, 3 decode, 2 cache nodes and 2
API processes on one port) serves greedy streams built from the trace's hash ids (shared ids, shared
prefixes; see replay_trace.py). Every `--interval` seconds one random process of the `--roles` is hit
(default prefill, decode, cache; `all` adds the conductor and the API processes): `kill` (SIGKILL,
restarted a few seconds later), `stop` (SIGSTOP, SIGCONT a few seconds later: a hang) or `term` (SIGTERM,
a clean leave, restarted later). At least one prefill instance, one decode instance and one API process
are left alone each time. Submissions stop after `--duration` seconds; the faults are healed, the
in-flight requests drain, and then:

- accepted / completed: streams the API accepted / that ended with a finish reason;
- truncated: accepted streams that ended cleanly with neither a finish reason nor an error event (a
  silent truncation, which a client cannot tell from a finished answer); a connection that broke (its API
  process died: the only loss that allows) counts under errors as stream_broke instead;
- broken / broken_without_an_api_death: accepted streams whose connection was cut (no `data: [DONE]`),
  and how many of those did not end within a few seconds of a kill or term of an API process;
- migrated: moves of requests to other instances, from every API process's one line per request (`legs=`;
  the conductor's mooncake_migrations_total starts again from zero each time it restarts);
- errors: by kind (HTTP status of refusals, or the error event's kind);
- hung: accepted streams without a terminal state past conductor.request_deadline_s (plus a grace);
- leaked_blocks: KV blocks still held by requests or waiting in a decode inbox, requests the conductor
  still counts in flight, and cache-node read leases, summed over every role after the drain;
- duplicated_tokens / lost_tokens: each stream's tokens against a greedy reference computed by a local
  engine on the same weights (a stream that ended in an error is checked up to where it ended);
  `diverged_streams` counts streams that differ otherwise (numerics: not a loss nor a duplicate).

Every load loop is bounded and the script stops by itself. Prints a summary and writes JSON."""

import argparse
import difflib
import re
import http.client
import json
import random
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import signal  # noqa: E402

import zmq  # noqa: E402

from mooncake import messages as m  # noqa: E402
from mooncake import security  # noqa: E402
from mooncake.config import load_config  # noqa: E402
from mooncake.dev import DevCluster  # noqa: E402
from mooncake.sim.trace import TraceRequest, load_trace, trace_prompt  # noqa: E402

FAULTS = ("kill", "stop", "term")
ROLES = ("prefill", "decode", "cache", "conductor", "api")
GRACE_S = 15.0  # past a request's deadline before it counts as hung; also the drain's settle time
BREAK_AFTER_S = 5.0  # a stream cut this long after an API process was killed or stopped is its loss (STOP_S is 3)


def synthetic_trace(rng: random.Random, n: int = 4096) -> list[TraceRequest]:
    """Requests shaped like a conversation trace without one: a shared first block, then turns of a few
    dozen conversations that grow their own prefixes."""
    requests = []
    for i in range(n):
        conversation = rng.randrange(48)
        turns = rng.randint(1, 10)
        hash_ids = (0,) + tuple(1000 * (conversation + 1) + t for t in range(turns))
        requests.append(TraceRequest(i, 512 * len(hash_ids), rng.randint(8, 512), hash_ids))
    return requests


class Client:
    """One greedy stream; records its tokens and how it ended."""

    def __init__(self, url: str, prompt: list[int], max_tokens: int, read_timeout_s: float):
        self.prompt, self.max_tokens = prompt, max_tokens
        self.token_ids: list[int] = []
        self.status = None  # HTTP status
        self.finish_reason = None
        self.error = None  # the error event's message, or why the stream broke
        self.is_terminal = False
        self.is_broken = False  # the connection broke: the client saw it (not a silent truncation)
        self.saw_done = False  # `data: [DONE]`: the server ended the stream (a cut connection never sends it)
        self.started_s = time.monotonic()
        self.ended_s = None
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        self._req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                           headers={"Content-Type": "application/json"})
        self._read_timeout_s = read_timeout_s
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            with urllib.request.urlopen(self._req, timeout=self._read_timeout_s) as r:
                self.status = r.status
                for line in r:
                    if line.startswith(b"data: [DONE]"):
                        self.saw_done = True
                    if not line.startswith(b"data: {"):
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        self.error, self.is_terminal = event["error"]["message"], True
                        continue
                    choice = event["choices"][0]
                    self.token_ids += choice.get("token_ids", [])
                    if choice.get("finish_reason"):
                        self.finish_reason, self.is_terminal = choice["finish_reason"], True
            if not self.saw_done and not self.is_terminal:
                # NOTE: urllib ends a chunked body cut at a chunk boundary as if it were whole (httpx and curl
                # report it): the missing [DONE] tells a cut connection from a clean end
                self.error, self.is_broken = "stream broke: the connection closed before data: [DONE]", True
        except urllib.error.HTTPError as exc:
            self.status, self.is_terminal = exc.code, True
            self.error = exc.read().decode(errors="replace")[:300]
        except (OSError, http.client.HTTPException) as exc:  # refused, reset, cut short, or no data in time
            self.error, self.is_broken = self.error or f"stream broke: {exc!r}", True
        finally:
            self.ended_s = time.monotonic()


def error_kind(c: Client) -> str:
    if c.status and c.status != 200:
        why = ("unreachable" if "unreachable" in (c.error or "") else
               "no_live_instance" if "no live" in (c.error or "") else "")
        return f"http_{c.status}" + (f"_{why}" if why else "")
    if not c.is_terminal:
        return "stream_broke"
    text = c.error or ""
    for kind, marker in (("could_not_move", "could not move"), ("migration_limit", "migration_limit"),
                         ("deadline", "request_deadline_s"), ("prefill_timeout", "prefill_timeout_s"),
                         ("shutting_down", "shutting down")):
        if marker in text:
            return kind
    return "other"


class Chaos:
    """Hits one random process every interval; heals (restarts, continues) what it hit after a while."""

    def __init__(self, cluster: DevCluster, rng: random.Random, faults: tuple[str, ...], roles: tuple[str, ...]):
        self.cluster, self.rng, self.faults, self.roles = cluster, rng, faults, roles
        self.pending: list[tuple[float, str, str]] = []  # (when, process name, "restart" | "cont")
        self.last_hit: dict[str, int] = {}  # role -> the fault number that last hit it
        self.log: list[dict] = []

    def _down(self) -> set[str]:
        return {name for _, name, _ in self.pending}

    def hit(self, now: float) -> None:
        down = self._down()
        candidates = {}
        for role in self.roles:
            names = [p.name for p in self.cluster.processes if p.role == role and p.name not in down]
            keep = 1 if role in ("prefill", "decode", "api") else 0  # leave one prefill, decode and API alone
            if len(names) > keep:
                candidates[role] = names
        if not candidates:
            return
        # NOTE: the roles take turns (the one hit longest ago first), so a short run hits every one of them
        role = min(candidates, key=lambda r: (self.last_hit.get(r, -1), self.rng.random()))
        self.last_hit[role] = len(self.log)
        name, fault = self.rng.choice(candidates[role]), self.rng.choice(self.faults)
        heal_s = now + self.rng.uniform(1.0, 4.0)
        sig = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}[fault]
        self.cluster.kill(name, sig)
        self.pending.append((heal_s, name, "cont" if fault == "stop" else "restart"))
        self.log.append({"at_s": round(now, 2), "process": name, "fault": fault})
        print(f"  {now:7.1f}s  {fault:<4} {name}", flush=True)

    def heal(self, now: float, everything: bool = False) -> None:
        due = [p for p in self.pending if everything or p[0] <= now]
        self.pending = [p for p in self.pending if p not in due]
        for _, name, action in due:
            proc = self.cluster.process(name)
            if action == "cont":
                self.cluster.kill(name, signal.SIGCONT)
            elif proc.popen.poll() is None:  # SIGTERM: still stopping
                proc.popen.wait(30)
                self.cluster.spawn(proc)
            else:
                self.cluster.spawn(proc)
        # A process that exited on its own (it should not) is started again, as `mooncake dev` does.
        for proc in self.cluster.restart_exited(leave=frozenset(n for _, n, _ in self.pending)):
            print(f"  {proc.name} exited by itself; restarted (pid {proc.pid})", flush=True)
            self.log.append({"at_s": round(now, 2), "process": proc.name, "fault": "exited by itself"})


def read_metrics(url: str, wait_s: float = 30.0) -> dict[str, float]:
    """The cluster's /metrics; an API process that is still finding its (restarted) conductor answers 503
    with Retry-After: ask again, for up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
            break
        except urllib.error.HTTPError as exc:
            if exc.code != 503 or time.monotonic() > deadline:
                raise
            time.sleep(0.5)
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


def cache_leases(cluster: DevCluster) -> dict[str, int]:
    keys = security.load_keys(cluster.config.security.keys_dir)
    out = {}
    for address in cluster.config.cache_client.nodes:
        sock = security.client(zmq.Context.instance().socket(zmq.DEALER), keys=keys, server="cache")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        try:
            sock.send(m.encode(m.Stats()))
            out[address] = m.decode(sock.recv()).stats["leased_blocks"] if sock.poll(5000) else -1
        finally:
            sock.close(linger=0)
    return out


def held(cluster: DevCluster) -> dict[str, float]:
    """What is still held, by series and cache node (zeros left out)."""
    values = read_metrics(cluster.url)
    out = {k: v for k, v in values.items() if v and k.startswith((
        "mooncake_requests_in_flight", "mooncake_instance_kv_blocks_used", "mooncake_instance_kv_inbox_blocks"))}
    out |= {f"cache_leased_blocks{{node={a}}}": n for a, n in cache_leases(cluster).items() if n}
    return out


def reference(clients: list[Client], model: str, block: int, batch: int = 16) -> list[list[int]]:
    """Greedy tokens of each client's prompt from a local engine on the same weights, `batch` at a time
    (as the cluster batches them: a stream that differs only by batching numerics counts as diverged)."""
    from mooncake.config import EngineConfig
    from mooncake.engine import LLMEngine
    from mooncake.sampling import SamplingParams
    engine = LLMEngine(EngineConfig(model=model, block_size=block, kv_cache_bytes=256 << 20, num_threads=2))
    refs = []
    for i in range(0, len(clients), batch):
        group = clients[i:i + batch]
        ids = [engine.add_request(c.prompt, SamplingParams(max_tokens=c.max_tokens, temperature=0.0,
                                                           ignore_eos=True)) for c in group]
        while engine.has_unfinished():
            engine.step()
        refs += [engine.pop_completion(r).token_ids for r in ids]
    return refs


def compare(stream: list[int], ref: list[int], complete: bool) -> tuple[int, int, bool]:
    """(duplicated, lost, diverged) of a stream against its reference; an incomplete stream is checked
    against the reference's prefix of its length."""
    if not complete:
        ref = ref[:len(stream)]
    if stream == ref:
        return 0, 0, False
    ops = difflib.SequenceMatcher(a=ref, b=stream, autojunk=False).get_opcodes()
    duplicated = sum(j2 - j1 for op, _, _, j1, j2 in ops if op == "insert")
    lost = sum(i2 - i1 for op, i1, i2, _, _ in ops if op == "delete")
    diverged = any(op == "replace" for op, *_ in ops)
    return duplicated, lost, diverged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load and faults")
    parser.add_argument("--json", type=Path, default=Path("bench-results/chaos.json"))
    parser.add_argument("--trace", type=Path, default=ROOT.parent / "shared/traces/conversation_trace.jsonl",
                        help="a Mooncake trace (default: the shared one beside the checkout; synthetic if absent)")
    parser.add_argument("--prefill", type=int, default=2)
    parser.add_argument("--decode", type=int, default=3)
    parser.add_argument("--cache", type=int, default=2)
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--transport", default="tcp")
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second submitted")
    parser.add_argument("--max-in-flight", type=int, default=8)
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between faults")
    parser.add_argument("--faults", default=",".join(FAULTS), help="of: " + ", ".join(FAULTS))
    parser.add_argument("--roles", default="prefill,decode,cache", help=f"the roles hit, of: {', '.join(ROLES)}; "
                        "or all")
    parser.add_argument("--api", type=int, default=2, help="API processes (on one port)")
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--max-input", type=int, default=384)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    roles = ROLES if args.roles == "all" else tuple(args.roles.split(","))
    if unknown := set(roles) - set(ROLES):
        parser.error(f"--roles: unknown {', '.join(sorted(unknown))}; choose of {', '.join(ROLES)} or all")
    rng = random.Random(args.seed)
    deadline_s = 120.0
    cfg = load_config(None, {
        "engine.model": args.model, "engine.block_size": args.block_tokens, "engine.prefill_chunk": 64,
        "engine.kv_cache_bytes": 32 << 20, "engine.num_threads": 1, "store.dram_bytes": 128 << 20,
        "cache.read_lease_s": 1.0, "api.port": 0, "api.model_name": "tiny", "instance.transport": args.transport,
        "conductor.admission": "accept-all", "conductor.heartbeat_interval_s": 0.2,
        "conductor.heartbeat_timeout_s": 1.5, "conductor.token_timeout_s": 10.0,
        "conductor.prefill_timeout_s": 60.0, "conductor.request_deadline_s": deadline_s,
        "conductor.migration_limit": 3, "cache_client.timeout_s": 2.0, "api.conductor_wait_s": 5.0,
        # NOTE: a leg the conductor placed just before it was killed may have pushed KV into a decode inbox
        # that no surviving process knows of; the inbox's own deadline frees it, within the drain's settle time.
        "instance.kv_inbox_ttl_s": 10.0})
    trace = load_trace(args.trace) if args.trace.exists() else synthetic_trace(rng)
    if not args.trace.exists():
        print(f"no trace at {args.trace}: replaying synthetic requests (shared prefixes, mixed lengths)")
    workdir = Path(tempfile.mkdtemp(prefix="chaos-"))
    print(f"chaos: {args.prefill}P {args.decode}D {args.cache} cache nodes {args.api} API processes, {args.model} "
          f"over {args.transport}; {args.rate:g} req/s for {args.duration:g} s, a fault every {args.interval:g} s "
          f"to {', '.join(roles)}; logs in {workdir}", flush=True)
    clients: list[Client] = []
    with DevCluster(cfg, args.prefill, args.decode, args.cache, workdir, log_to_files=True,
                    num_api=args.api) as cluster:
        chaos = Chaos(cluster, rng, tuple(args.faults.split(",")), roles)
        start = time.monotonic()
        next_fault, i = start + args.interval, 0
        while (now := time.monotonic()) - start < args.duration:
            if now >= next_fault:
                chaos.hit(now - start)
                next_fault += args.interval
            chaos.heal(now - start)
            if sum(c.ended_s is None for c in clients) < args.max_in_flight:
                t = trace[i % len(trace)]
                i += 1
                prompt = trace_prompt(t.hash_ids, args.block_tokens, args.max_input)
                clients.append(Client(cluster.url, prompt, max(2, min(t.output_length, args.max_output)),
                                      read_timeout_s=deadline_s + GRACE_S))
            time.sleep(1.0 / args.rate)
        print(f"  {time.monotonic() - start:7.1f}s  load stopped; healing every fault and draining", flush=True)
        chaos.heal(0, everything=True)
        cluster.wait_ready(180)
        for c in clients:
            c.thread.join(max(0.0, c.started_s + deadline_s + GRACE_S - time.monotonic()))
        hung = [c for c in clients if c.status == 200 and not c.is_terminal and c.ended_s is None]
        settle = time.monotonic() + GRACE_S
        while (leftover := held(cluster)) and time.monotonic() < settle:
            time.sleep(0.5)
        values = read_metrics(cluster.url)
        migrated = sum(int(legs) - 1 for log in workdir.glob("api-*.log")
                       for legs in re.findall(r" outcome=\S+ .* legs=(\d+) ", log.read_text(errors="replace"))
                       if int(legs) > 1)
    accepted = [c for c in clients if c.status == 200]
    completed = [c for c in accepted if c.finish_reason and not c.error]
    truncated = [c for c in accepted if c.ended_s is not None and not c.is_terminal and not c.is_broken]
    broken = [c for c in accepted if c.is_broken and not c.is_terminal]
    api_deaths = [f["at_s"] for f in chaos.log if f["process"].startswith("api-") and f["fault"] in ("kill", "term")]
    unexplained = [c for c in broken if not any(0 <= c.ended_s - start - t <= BREAK_AFTER_S for t in api_deaths)]
    print(f"computing {len(accepted)} greedy references ...", flush=True)
    refs = reference(accepted, args.model, args.block_tokens)
    duplicated = lost = diverged = 0
    for c, ref in zip(accepted, refs):
        d, l_, v = compare(c.token_ids, ref, c in completed)
        duplicated, lost, diverged = duplicated + d, lost + l_, diverged + v
    errors = Counter(error_kind(c) for c in clients if c not in completed)
    result = {
        "accepted": len(accepted), "completed": len(completed), "submitted": len(clients), "migrated": migrated,
        "truncated": len(truncated),
        "truncated_streams": [{"started_s": round(c.started_s - start, 2), "ended_s": round(c.ended_s - start, 2),
                               "tokens": len(c.token_ids), "max_tokens": c.max_tokens} for c in truncated],
        "broken": len(broken), "broken_without_an_api_death": len(unexplained),
        "broken_streams": [{"started_s": round(c.started_s - start, 2), "ended_s": round(c.ended_s - start, 2),
                            "tokens": len(c.token_ids), "error": c.error} for c in broken],
        "errors": dict(errors), "hung": len(hung), "leaked_blocks": int(sum(leftover.values())),
        "leaked": leftover, "duplicated_tokens": duplicated, "lost_tokens": lost, "diverged_streams": diverged,
        "completed_share": len(completed) / max(1, len(accepted)), "faults": len(chaos.log),
        "fault_log": chaos.log, "migrations_by_outcome": {k.split('"')[1]: v for k, v in values.items()
                                                          if k.startswith("mooncake_migrations_total")},
        "args": {k: str(v) for k, v in vars(args).items()}}
    print(f"submitted {result['submitted']}, accepted {result['accepted']}, completed {result['completed']} "
          f"({result['completed_share']:.1%}), migrated {migrated}, faults {result['faults']}")
    print(f"errors {dict(errors) or 0}; hung {result['hung']}; truncated {result['truncated']}; "
          f"leaked_blocks {result['leaked_blocks']} {leftover or ''}")
    print(f"duplicated_tokens {duplicated}, lost_tokens {lost}, diverged_streams {diverged}")
    print(f"broken connections {len(broken)}, of which {len(unexplained)} not within {BREAK_AFTER_S:g} s of an API "
          f"process's kill or term")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

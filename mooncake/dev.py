"""`mooncake dev`: a whole cluster on this box, one process per role (cache nodes, conductor, API processes,
prefill and decode instances), on free loopback ports; N API processes share the one HTTP port. Writes one
config per process, starts them in dependency order, waits until the conductor reports every instance, and
stops them all (SIGTERM, then SIGKILL after a deadline) on Ctrl-C, SIGTERM or `stop()`. Tests start
clusters the same way."""

import dataclasses
import json
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from mooncake.config import MooncakeConfig, dump_config
from mooncake.errors import MooncakeError
from mooncake.security import generate_keys

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 15.0
RESTART_BACKOFF_S = 5.0  # a process that exits is started again at most this often
# NOTE: libgomp's spin between two parallel regions, for instances that share this box's cores: long enough
# to span the gaps within a decode step, short enough that a worker waiting for its partner soon gives the
# core back to the other instance (mooncake/instance/compute_threads.py). SmolLM2 1P1D on 2 cores, streamed
# tok/s at concurrency 1 / 4 / 16, two runs each: 1,000 turns 19.2-20.1 / 41.2-44.6 / 77.5-86.8; 10,000
# turns 22.6-23.4 / 42.0-44.3 / 61.4-64.3; no spin 12.0-15.1 / 41.8-41.9 / 81.2-86.5. A user's
# GOMP_SPINCOUNT or OMP_WAIT_POLICY wins.
DEV_SPIN_COUNT = "1000"


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the launcher dies, however it dies (Linux), so a
    crashed launcher or test run leaves no cluster behind."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _environment(role: str) -> dict[str, str]:
    """A role's environment: this one, with a short OpenMP spin for an instance (DEV_SPIN_COUNT)."""
    env = dict(os.environ)
    if role in ("prefill", "decode") and not {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & env.keys():
        env["GOMP_SPINCOUNT"] = DEV_SPIN_COUNT
    return env


# NOTE: below Linux's ephemeral range (32768-60999): a port chosen here stays free until its role binds
# it, while the other roles bind port 0 for their own endpoints (which could take it otherwise).
DEV_PORTS = range(20000, 32000)


def free_port() -> int:
    """A free loopback port that no endpoint binding port 0 will be given meanwhile."""
    for _ in range(200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", random.choice(DEV_PORTS)))
            except OSError:
                continue
            return s.getsockname()[1]
    raise MooncakeError(f"no free port in {DEV_PORTS.start}-{DEV_PORTS.stop - 1} on 127.0.0.1")


def check_port_free(host: str, port: int) -> None:
    """Raise a clear error when something already listens on host:port (another mooncake, say), instead
    of starting a cluster whose API cannot bind while a stranger answers its requests."""
    try:
        with socket.create_connection((host, port), timeout=1.0):
            pass
    except OSError:
        return
    raise MooncakeError(f"port {port} on {host} is already in use by another program; stop it, or pick "
                        f"another port with --port (make run PORT=...)")


@dataclass
class Process:
    name: str  # "conductor", "api-0", "prefill-0", "decode-1", "cache-0"
    role: str
    config_path: Path
    log_path: Path | None
    popen: subprocess.Popen | None = None
    is_exit_reported: bool = False
    started_s: float = 0.0  # time.monotonic() of its last start
    num_restarts: int = 0

    @property
    def pid(self) -> int:
        return self.popen.pid


class DevCluster:
    def __init__(self, config: MooncakeConfig, num_prefill: int = 1, num_decode: int = 1, num_cache: int = 1,
                 workdir: Path | None = None, log_to_files: bool = False, num_api: int = 1, num_standby: int = 0):
        colocated = config.conductor.mode == "colocated"
        if num_decode < 1 or num_cache < 0 or (num_prefill < 1 and not colocated):
            raise MooncakeError("a cluster needs at least one prefill and one decode instance"
                                if not colocated else "a colocated cluster needs at least one instance")
        if num_api < 1:
            raise MooncakeError("a cluster needs at least one API process (--api)")
        if num_standby and not config.conductor.etcd_endpoints:
            raise MooncakeError("a standby conductor needs etcd: set conductor.etcd_endpoints")
        if colocated and num_prefill:
            raise MooncakeError("a colocated cluster has no prefill instances: its instances prefill themselves")
        if config.api.port:
            check_port_free(config.api.host, config.api.port)
        self.is_own_workdir = workdir is None  # a temp directory of ours: removed on stop
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="mooncake-dev-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_to_files = log_to_files
        ports = iter(free_port() for _ in range(1 + num_standby + 2 * num_cache))
        conductors = [f"tcp://127.0.0.1:{next(ports)}" for _ in range(1 + num_standby)]
        conductor_address = ",".join(conductors)  # NOTE: instances and API processes reach whichever leads
        caches = [(f"cache-{i}", f"tcp://127.0.0.1:{next(ports)}", f"tcp://127.0.0.1:{next(ports)}")
                  for i in range(num_cache)]
        api_port = config.api.port or free_port()
        keys_dir = config.security.keys_dir
        if not keys_dir:  # NOTE: the shipped path is the tested path: a dev cluster runs with keys too
            keys_dir = str(self.workdir / "keys")
            if not (self.workdir / "keys" / "conductor.key_secret").exists():
                generate_keys(keys_dir)
        base = dataclasses.replace(
            config,
            security=dataclasses.replace(config.security, keys_dir=keys_dir),
            conductor=dataclasses.replace(config.conductor, control_address=conductors[0]),
            api=dataclasses.replace(config.api, port=api_port, reuse_port=num_api > 1 or config.api.reuse_port),
            cache_client=dataclasses.replace(config.cache_client, nodes=tuple(c[1] for c in caches),
                                             replica_num=min(config.cache_client.replica_num, max(1, num_cache))),
            instance=dataclasses.replace(config.instance, conductor_address=conductor_address,
                                         use_cache_pool=num_cache > 0 and config.instance.use_cache_pool))
        self.url = f"http://{config.api.host}:{api_port}"
        self.config = base
        self.processes: list[Process] = []
        for node_id, control, events in caches:
            self._add(node_id, "cache", dataclasses.replace(base, cache=dataclasses.replace(
                base.cache, node_id=node_id, control_address=control, events_address=events,
                transport=base.instance.transport)))
        self._add("conductor", "conductor", base)
        for i, address in enumerate(conductors[1:], 1):
            self._add(f"conductor-{i}", "conductor", dataclasses.replace(
                base, conductor=dataclasses.replace(base.conductor, control_address=address)))
        for i in range(num_api):
            self._add(f"api-{i}", "api", base)
        for role, n in (("prefill", num_prefill), ("decode", num_decode)):
            for i in range(n):
                self._add(f"{role}-{i}", role, dataclasses.replace(base, instance=dataclasses.replace(
                    base.instance, instance_id=f"{role}-{i}")))

    def _add(self, name: str, role: str, config: MooncakeConfig) -> None:
        path = self.workdir / f"{name}.toml"
        path.write_text(dump_config(config))
        log_path = self.workdir / f"{name}.log" if self.log_to_files else None
        self.processes.append(Process(name, role, path, log_path))

    def process(self, name: str) -> Process:
        return next(p for p in self.processes if p.name == name)

    def spawn(self, proc: Process) -> None:
        """Start (or restart) one process."""
        if proc.popen is not None and proc.popen.poll() is None:
            raise MooncakeError(f"{proc.name} (pid {proc.pid}) is still running; end it before starting it again")
        out = open(proc.log_path, "ab") if proc.log_path else None
        proc.popen = subprocess.Popen([sys.executable, "-m", "mooncake", "serve", "--role", proc.role,
                                       "--config", str(proc.config_path)], stdout=out, stderr=out,
                                      env=_environment(proc.role), start_new_session=out is not None,
                                      preexec_fn=_die_with_parent)
        proc.started_s = time.monotonic()
        proc.is_exit_reported = False
        if out:
            out.close()

    def restart_exited(self, leave: frozenset[str] = frozenset()) -> list[Process]:
        """Start again each process that exited (at most once per RESTART_BACKOFF_S each, so a role that
        cannot start does not spin), but those named in `leave`; the processes restarted."""
        restarted = []
        for proc in self.processes:
            if proc.popen is None or proc.popen.poll() is None or proc.name in leave:
                continue
            if time.monotonic() - proc.started_s < RESTART_BACKOFF_S:
                continue
            proc.num_restarts += 1
            self.spawn(proc)
            restarted.append(proc)
        return restarted

    def start(self, timeout_s: float = 300.0) -> None:
        try:
            for proc in self.processes:
                self.spawn(proc)
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout_s: float, num_prefill: int | None = None, num_decode: int | None = None) -> dict:
        """Wait until /health lists every (or the given number of) prefill and decode instances."""
        want_p = num_prefill if num_prefill is not None else sum(p.role == "prefill" for p in self.processes)
        want_d = num_decode if num_decode is not None else sum(p.role == "decode" for p in self.processes)
        deadline = time.monotonic() + timeout_s
        health = {}
        while time.monotonic() < deadline:
            for proc in self.processes:
                if proc.popen is not None and proc.popen.poll() is not None and proc.role in ("conductor", "api",
                                                                                             "cache"):
                    raise MooncakeError(f"{proc.name} exited with status {proc.popen.returncode} during start"
                                        + self._log_tail(proc))
            health = self.health()
            if len(health.get("prefill", [])) >= want_p and len(health.get("decode", [])) >= want_d:
                return health
            time.sleep(0.25)
        raise MooncakeError(f"the cluster was not ready within {timeout_s:g} s (health: {health})")

    def health(self) -> dict:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return json.loads(exc.read() or b"{}")
        except (urllib.error.URLError, OSError, ValueError):
            return {}

    def _log_tail(self, proc: Process) -> str:
        if proc.log_path is None or not proc.log_path.exists():
            return ""
        return ":\n" + "\n".join(proc.log_path.read_text(errors="replace").splitlines()[-15:])

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` to one process; for a signal that ends it, wait until it has exited."""
        proc = self.process(name)
        if proc.popen is not None and proc.popen.poll() is None:
            os.kill(proc.pid, sig)
            if sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
                proc.popen.wait(timeout=STOP_TIMEOUT_S)

    def stop(self) -> None:
        """SIGTERM everything we started, in reverse order; SIGKILL what is still up after the deadline."""
        running = [p for p in reversed(self.processes) if p.popen is not None and p.popen.poll() is None]
        for proc in running:
            proc.popen.send_signal(signal.SIGTERM)
            proc.popen.send_signal(signal.SIGCONT)  # one that was stopped (SIGSTOP) must run to exit
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in running:
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) did not stop within %g s; killing it", proc.name, proc.pid, STOP_TIMEOUT_S)
                proc.popen.kill()
                proc.popen.wait()
        if self.is_own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()


def ask(url: str, model: str, question: str, timeout_s: float = 300.0) -> str:
    """One greedy chat turn through the REST API; the answer's text."""
    body = {"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0,
            "max_tokens": 64}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())["choices"][0]["message"]["content"]
    except urllib.error.HTTPError as exc:
        raise MooncakeError(f"the cluster answered {exc.code}: {exc.read().decode(errors='replace')}") from None


def run_dev(cluster: DevCluster, timeout_s: float, question: str | None = None, restart: bool = True) -> None:
    """Start the cluster, print its URL (and the answer to `question`), and keep it up until Ctrl-C or
    SIGTERM; with `restart`, a process that exits is started again."""
    stopping = []

    def on_signal(signum, frame):
        stopping.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        print(f"starting {len(cluster.processes)} processes (configs in {cluster.workdir}) ...", file=sys.stderr)
        cluster.start(timeout_s)
        model = cluster.config.api.model_name or cluster.config.engine.model
        print(f"mooncake is serving '{model}' at {cluster.url}/v1  (OpenAI API; Ctrl-C stops everything)",
              flush=True)
        if question:
            print(f"Q: {question}\nA: {ask(cluster.url, model, question)}", flush=True)
        print(f"try: curl {cluster.url}/v1/chat/completions -H 'Content-Type: application/json' -d "
              f"'{{\"model\": \"{model}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi!\"}}]}}'",
              flush=True)
        while True:
            time.sleep(1)
            for proc in cluster.processes:
                if proc.popen.poll() is not None and not proc.is_exit_reported:
                    proc.is_exit_reported = True
                    print(f"{proc.name} (pid {proc.pid}) exited with status {proc.popen.returncode}"
                          + ("; restarting it" if restart else ""), file=sys.stderr)
            if restart:
                for proc in cluster.restart_exited():
                    print(f"{proc.name} restarted (pid {proc.pid}, restart {proc.num_restarts})", file=sys.stderr)
    except KeyboardInterrupt:
        print("stopping ...", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, previous)
        cluster.stop()
        print("stopped", file=sys.stderr)

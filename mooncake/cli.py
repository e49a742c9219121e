"""The `mooncake` command: `generate`, `serve --role`, `dev`, `simulate`, and `model fetch|list`.

Every deliberate error (`MooncakeError`) becomes one line on stderr and exit status 1, no traceback."""

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from mooncake.errors import MooncakeError

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="mooncake: KVCache-centric disaggregated LLM serving.")
model_app = typer.Typer(no_args_is_help=True, help="Fetch and list models.")
app.add_typer(model_app, name="model")


@app.command()
def generate(
    prompt: str = typer.Option(..., "--prompt", "-p", help="Prompt text."),
    model: str = typer.Option(None, "--model", "-m",
                              help="Catalog name (see `mooncake model list`) or a local Hugging Face "
                                   "directory of a Llama-family model. Default: the config's engine.model."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt as a user turn in the chat template."),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n", help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling mass, in (0, 1]."),
    top_k: int = typer.Option(0, "--top-k", help="Sample among the k likeliest tokens; 0 is off."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed for reproducible sampling."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: text, token_ids, "
                                 "prompt_tokens, completion_tokens, ttft_s, tokens_per_s."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML config file ([engine] table)."),
    device: Optional[str] = typer.Option(None, "--device", help="Override engine.device (cpu, cuda)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="Override engine.dtype."),
):
    """Generate a completion for one prompt with the local engine."""
    from mooncake.config import load_config
    from mooncake.engine import LLMEngine, SamplingParams
    from mooncake.text import decode_completion, encode_prompt

    overrides = {f"engine.{k}": v for k, v in (("model", model), ("device", device), ("dtype", dtype)) if v}
    cfg = load_config(config, overrides)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            seed=seed, stop=tuple(stop))
    engine = LLMEngine(cfg.engine)
    prompt_ids = encode_prompt(engine.tokenizer, prompt, chat=chat)
    (done,) = engine.generate([prompt_ids], params)
    text = decode_completion(engine.tokenizer, done.token_ids, params.stop)
    decode_s = done.total_s - done.ttft_s
    tokens_per_s = (len(done.token_ids) - 1) / decode_s if len(done.token_ids) > 1 and decode_s > 0 else 0.0
    if as_json:
        print(json.dumps({"text": text, "token_ids": done.token_ids, "prompt_tokens": done.num_prompt_tokens,
                          "completion_tokens": len(done.token_ids), "finish_reason": done.finish_reason,
                          "ttft_s": round(done.ttft_s, 4), "tokens_per_s": round(tokens_per_s, 2)}))
    else:
        print(text)
        print(f"[{done.num_prompt_tokens} prompt + {len(done.token_ids)} completion tokens, "
              f"finish {done.finish_reason}, TTFT {done.ttft_s:.3f} s, {tokens_per_s:.1f} tokens/s]",
              file=sys.stderr)


ROLES = ("conductor", "api", "prefill", "decode", "cache")


@app.command()
def serve(
    role: str = typer.Option(..., "--role", "-r", help=f"One of: {', '.join(ROLES)}."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML config file (see configs/)."),
):
    """Run one mooncake role until Ctrl-C or SIGTERM.

    conductor: the global scheduler ([conductor]); prefill and decode instances and API processes register
    with it. api: the OpenAI-compatible REST endpoint ([api]); it asks the conductor at
    [instance].conductor_address to place each request, and instances stream its tokens straight to it (run
    as many as you like: behind one port with [api].reuse_port, or behind a load balancer). prefill /
    decode: an engine ([engine]) serving the conductor at [instance].conductor_address; KV moves prefill ->
    decode over [instance].transport, and prefill reads and writes the cache pool ([cache_client]). cache:
    a KVCache store node ([store], [cache])."""
    from mooncake.config import load_config
    from mooncake.errors import ConfigError
    from mooncake.runtime import run_service
    from mooncake.security import configure

    if role not in ROLES:
        raise ConfigError(f"unknown role '{role}': choose one of {', '.join(ROLES)}")
    cfg = load_config(config)
    configure(cfg, role)  # this role's keys for every socket of this process, or loopback only
    service = make_role(role, cfg)
    if role in ("prefill", "decode"):  # NOTE: here only the engine's thread computes in parallel
        from mooncake.instance.compute_threads import compute_alone
        compute_alone()
    run_service(service)


def make_role(role: str, cfg):
    """The service object of one role, not started."""
    if role == "cache":
        from mooncake.store.server import CacheServer
        return CacheServer(cfg)
    if role == "prefill":
        from mooncake.prefill.worker import PrefillWorker
        return PrefillWorker(cfg)
    if role == "decode":
        from mooncake.decode.worker import DecodeWorker
        return DecodeWorker(cfg)
    if role == "api":
        from mooncake.api.front_door import FrontDoor
        from mooncake.api.server import ApiServer
        from mooncake.runtime import ServiceStack
        door = FrontDoor(cfg)
        return ServiceStack("API process", [door, ApiServer(cfg, door, reuse_port=cfg.api.reuse_port)])
    from mooncake.conductor.service import Conductor
    return Conductor(cfg)


def dev_defaults() -> dict:
    """What `mooncake dev` runs without --config. One box runs every role, so each gets less than a
    dedicated host would: the fastest dtype this CPU has (engine.dtype "auto": bfloat16 with AMX or
    AVX512-BF16, else float32) and, per instance, paged KV for one full 8k-token context of the default
    model in that dtype; the cache node's DRAM the same."""
    from mooncake.config import resolve_dtype
    kv_bytes = (256 if resolve_dtype("auto", "cpu") != "float32" else 512) << 20
    return {"engine.dtype": "auto", "engine.kv_cache_bytes": kv_bytes, "store.dram_bytes": kv_bytes}


@app.command()
def dev(
    prefill: int = typer.Option(1, "--prefill", "-P", help="Prefill instances."),
    decode: int = typer.Option(1, "--decode", "-D", help="Decode instances."),
    colocated: int = typer.Option(0, "--colocated", help="Run the colocated baseline instead: this many "
                                  "instances, each prefilling and decoding its requests itself (vLLM-like), "
                                  "placed by the same conductor (conductor.mode = colocated)."),
    cache: int = typer.Option(1, "--cache", "-C", help="Cache nodes (0: no shared KVCache pool)."),
    api: int = typer.Option(1, "--api", help="API processes, all listening on the one port (SO_REUSEPORT: "
                            "the kernel spreads connections); each tokenizes and streams its own requests."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Catalog name or local Hugging Face "
                                        "directory. Default: the config's engine.model (SmolLM2-135M-Instruct)."),
    port: int = typer.Option(8000, "--port", "-p", help="HTTP port of the OpenAI API (0: any free port)."),
    transport: Optional[str] = typer.Option(None, "--transport", help="KV transport: tcp, shm, mooncake. "
                                            "Default: the config's instance.transport (tcp)."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="Base TOML config for every process. "
                                          "Without one: engine.dtype auto (bfloat16 where the CPU has AMX or "
                                          "AVX512-BF16, else float32) and sizes that fit a laptop: 256 MiB of paged "
                                          "KV per instance and of DRAM for the cache node (512 MiB in float32)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="engine.dtype: float32, bfloat16, float16 or auto. "
                                        "float32 gives the same tokens as transformers."),
    speedup: Optional[float] = typer.Option(None, "--speedup", help="Emulated models only (emulated-llama3-70b): "
                                            "divide every modelled step time by this (engine.emulation_speedup). "
                                            "Scale a replay's pace and the SLOs by the same factor."),
    workdir: Optional[Path] = typer.Option(None, "--workdir", help="Where to write each process's config "
                                           "(default: a new temp directory)."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds to wait for every instance to be ready."),
    question: Optional[str] = typer.Option(None, "--ask", help="Once ready, ask this in a chat request and "
                                           "print the answer (then keep serving)."),
    restart: bool = typer.Option(True, "--restart/--no-restart", help="Start again a process that exits "
                                 "(requests it held move to the others meanwhile)."),
):
    """Run a whole cluster on this box: one process per role on loopback, the REST API at
    http://127.0.0.1:PORT/v1. Prints the URL once every instance is ready; Ctrl-C or SIGTERM stops all."""
    from mooncake.config import load_config
    from mooncake.dev import DevCluster, run_dev
    from mooncake.models import resolve_model

    overrides = ({} if config else dev_defaults()) | {"api.port": port}
    if dtype:
        overrides["engine.dtype"] = dtype
    if speedup:
        overrides["engine.emulation_speedup"] = speedup
    if colocated:
        overrides["conductor.mode"] = "colocated"
        prefill, decode = 0, colocated
    if model:
        overrides["engine.model"] = model
    if transport:
        overrides["instance.transport"] = transport
    cfg = load_config(config, overrides)
    resolve_model(cfg.engine.model)  # fetch once here, not in every process at the same time
    run_dev(DevCluster(cfg, prefill, decode, cache, workdir, num_api=api), timeout, question, restart)


keys_app = typer.Typer(no_args_is_help=True, help="The cluster's keys: a CURVE pair per role, and the data plane's "
                                                     "MAC secret.")
app.add_typer(keys_app, name="keys")


@keys_app.command("generate")
def keys_generate(directory: Path = typer.Argument(..., help="Where to write the keys (created 0700).")):
    """Make the cluster's keys in DIR: per role (conductor, api, cache, prefill, decode) a CURVE pair,
    DIR/<role>.key (public) and DIR/<role>.key_secret (mode 0600), and DIR/data.secret (0600), the MAC
    secret of the KV data plane. Give every host the public keys, the secret of each role it runs, and, if
    it runs a cache, prefill or decode role, data.secret; set security.keys_dir to that directory. A
    role's key lets its holder act as that role only: a cache node's cannot register an instance."""
    from mooncake.security import generate_keys
    directory = generate_keys(directory)
    for path in sorted(directory.iterdir()):
        print(path)


@app.command()
def simulate(
    trace: Path = typer.Option(..., "--trace", "-t", help="Trace file (JSON lines: timestamp, input_length, "
                                                        "output_length, hash_ids)."),
    config: Optional[Path] = typer.Option(None, "--config", "-c", help="TOML with sim and conductor tables."),
    speed: Optional[float] = typer.Option(None, "--speed", help="Replay speed (overrides sim.speed)."),
    out: Path = typer.Option(Path("sim-results"), "--out", "-o", help="Directory for report.json and plots."),
    plots: bool = typer.Option(True, "--plots/--no-plots", help="Write PNG plots (needs matplotlib)."),
    sweep_speeds: Optional[str] = typer.Option(None, "--sweep", help="Comma-separated speeds to sweep, e.g. "
                                               "1,1.5,2; with --pd, every prefill:decode split at each speed."),
    pd: Optional[str] = typer.Option(None, "--pd", help="Prefill:decode splits to sweep, e.g. 6:10,8:8,10:6."),
):
    """Replay a trace through a simulated Mooncake (or vLLM-like) cluster on a simulated clock, with the
    conductor's own policy classes, and report TTFT, TBT, effective capacity and rejections."""
    from mooncake.config import load_config
    from mooncake.errors import ConfigError
    from mooncake.sim import run as sim_run

    cfg = load_config(config, {"sim.speed": speed} if speed else None)
    if sweep_speeds or pd:
        try:
            speeds = [float(x) for x in sweep_speeds.split(",")] if sweep_speeds else [cfg.sim.speed]
            splits = [tuple(int(v) for v in x.split(":")) for x in pd.split(",")] if pd else []
        except ValueError:
            raise ConfigError("--sweep takes speeds like 1,1.5,2 and --pd splits like 6:10,8:8") from None
        rows = sim_run.sweep(trace, cfg, speeds, splits)
        print(f"{'speed':>6}{'P:D':>7}{'cap@100ms':>11}{'cap@200ms':>11}{'cap@300ms':>11}{'mean TTFT':>11}"
              f"{'rejected':>10}")
        for r in rows:
            c = r["capacity"]
            print(f"{r['speed']:>6g}{r['prefill']:>4}:{r['decode']:<3}{c['100ms']:>10.1%}{c['200ms']:>11.1%}"
                  f"{c['300ms']:>11.1%}{r['mean_ttft_s']:>10.2f}s{r['rejected']:>10}")
        out.mkdir(parents=True, exist_ok=True)
        (out / "sweep.json").write_text(json.dumps(rows, indent=2))
        print(f"wrote {out / 'sweep.json'}")
        return
    result = sim_run.simulate(trace, cfg, show_progress=sys.stderr.isatty())
    path = sim_run.write_report(result, out)
    capacity = ", ".join(f"{k} {v:.1%}" for k, v in result["effective_capacity"].items())
    print(f"{cfg.sim.mode}: {result['requests']} requests, {result['served']} served, rejected "
          f"{result['rejected']}; mean TTFT {result['ttft_s']['mean']:.2f} s, p90 TBT "
          f"{result['tbt_s']['p90'] * 1000:.0f} ms; effective capacity {capacity}; hit ratio "
          f"{result['hit_ratio']:.1%}; {result['wall_s']:.1f} s wall")
    print(f"wrote {path}")
    if plots:
        from mooncake.sim.plots import write_plots
        for png in write_plots({cfg.sim.mode: result}, out):
            print(f"wrote {png}")


@model_app.command("fetch")
def model_fetch(name: str = typer.Argument("smollm2-135m-instruct", help="Catalog model name.")):
    """Download and convert a catalog model once into $MOONCAKE_HOME (default ~/.cache/mooncake);
    prints its directory. Safe to interrupt and re-run."""
    from mooncake.models.fetch import fetch_model
    print(fetch_model(name))


@model_app.command("list")
def model_list():
    """The models mooncake knows by name, and whether each is fetched."""
    from mooncake.models.catalog import CATALOG
    from mooncake.models.fetch import is_fetched
    for name, entry in sorted(CATALOG.items()):
        state = "fetched" if is_fetched(name) else "not fetched"
        print(f"{name:24} {state:12} {entry.description}")


def main() -> None:
    from mooncake.logs import setup_logging
    setup_logging()
    try:
        app()
    except MooncakeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)

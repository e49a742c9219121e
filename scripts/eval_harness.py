#!/usr/bin/env python3
"""lm-evaluation-harness against a `mooncake dev` cluster, beside lm-eval's own transformers model on the same
model directory: a loglikelihood (multiple-choice) task of our own, scored three ways in one run:

- `--model local-completions` against the cluster's /v1/completions, batch size 1 and 4 (lm-eval sends
  token-id prompts with `echo: true, max_tokens: 1, logprobs: 1`, a batch of them per request);
- `--model hf` on the same model directory, float32 on the CPU (the reference).

Per item and choice the loglikelihoods must agree within --tolerance (1e-3), and the accuracies exactly.
lm-eval is installed into its own environment under the cache (~/.cache/mooncake/lm-eval, never the
project's venv): torch 2.13.0 (the CPU build on disk), the project's transformers, `lm-eval[api,hf]`. The
task's items are written here (no dataset hub). Prints a table and writes bench-results/eval_harness.json;
exits 1 when the engines disagree."""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mooncake.config import load_config  # noqa: E402
from mooncake.dev import DevCluster  # noqa: E402
from mooncake.env import mooncake_home  # noqa: E402
from mooncake.models.fetch import fetch_model  # noqa: E402

LM_EVAL = "lm-eval[api,hf]==0.4.13"
TASK = "mooncake_facts"
# (question, choices, index of the right one): a few general facts, four choices each.
ITEMS = [
    ("The capital of France is", ["Paris", "London", "Rome", "Madrid"], 0),
    ("The largest planet of the solar system is", ["Mars", "Jupiter", "Venus", "Mercury"], 1),
    ("Water freezes at a temperature of", ["50 degrees Celsius", "100 degrees Celsius", "0 degrees Celsius",
                                           "20 degrees Celsius"], 2),
    ("The author of Romeo and Juliet is", ["Charles Dickens", "Jane Austen", "Mark Twain", "William Shakespeare"],
     3),
    ("The chemical symbol for gold is", ["Au", "Ag", "Fe", "Pb"], 0),
    ("The number of days in a week is", ["five", "seven", "ten", "twelve"], 1),
    ("The animal known as the king of the jungle is the", ["mouse", "rabbit", "lion", "goldfish"], 2),
    ("The opposite of hot is", ["warm", "loud", "bright", "cold"], 3),
    ("The first man to walk on the Moon was", ["Neil Armstrong", "Albert Einstein", "Isaac Newton",
                                               "Julius Caesar"], 0),
    ("The colour of a clear daytime sky is", ["green", "blue", "red", "black"], 1),
    ("The longest river in Africa is the", ["Thames", "Seine", "Nile", "Danube"], 2),
    ("Bees make", ["milk", "silk", "wool", "honey"], 3),
    ("The square root of 81 is", ["9", "8", "7", "6"], 0),
    ("The currency of Japan is the", ["euro", "yen", "dollar", "peso"], 1),
    ("A triangle has this many sides:", ["two", "four", "three", "five"], 2),
    ("The gas that plants take in to make food is", ["helium", "neon", "argon", "carbon dioxide"], 3),
    ("Python is a programming", ["language", "snake pit", "river", "mountain"], 0),
    ("The ocean between Europe and North America is the", ["Indian Ocean", "Atlantic Ocean", "Arctic Ocean",
                                                            "Southern Ocean"], 1),
    ("The freezing water that falls from clouds in winter is", ["sand", "rain", "snow", "dust"], 2),
    ("The organ that pumps blood through the body is the", ["lung", "liver", "kidney", "heart"], 3),
]


def environment(root: Path) -> Path:
    """lm-eval's own environment (made once; a marker names what it holds): its python."""
    venv = root / "venv"
    marker = venv / ".mooncake-installed"
    wanted = f"torch==2.13.0 transformers=={_transformers_version()} {LM_EVAL}"
    if not marker.exists() or marker.read_text() != wanted:
        print(f"installing {wanted} into {venv} (once)", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        *wanted.split()], check=True)
        marker.write_text(wanted)
    return venv / "bin" / "python"


def _transformers_version() -> str:
    import transformers
    return transformers.__version__


def write_task(where: Path) -> Path:
    """The task's YAML and its items (JSON lines) in `where`, for lm-eval's --include_path."""
    where.mkdir(parents=True, exist_ok=True)
    data = where / "items.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": [" " + c for c in choices], "answer": a}) + "\n"
                            for q, choices, a in ITEMS))
    (where / f"{TASK}.yaml").write_text(f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
""")
    return where


def run_lm_eval(python: Path, task_dir: Path, out_dir: Path, model: str, model_args: str, batch_size: int,
                timeout_s: float, extra: list[str] = ()) -> tuple[dict, float]:
    """One lm-eval run: ({(doc id, choice): loglikelihood} plus accuracy, wall seconds)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    cmd = [str(python), "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", TASK,
           "--include_path", str(task_dir), "--batch_size", str(batch_size), "--output_path", str(out_dir),
           "--log_samples", "--seed", "1234", *extra]
    started = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    seconds = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"lm-eval ({model}) failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    samples = next(out_dir.rglob(f"samples_{TASK}_*.jsonl"))
    results = json.loads(next(out_dir.rglob("results_*.json")).read_text())
    scores = {}
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        for choice, resp in enumerate(sample["resps"]):
            scores[(sample["doc_id"], choice)] = float(resp[0][0])
    acc = results["results"][TASK]["acc,none"]
    return {"scores": scores, "acc": acc}, seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a model of the catalog (default: the dev "
                    "cluster's default model)")
    ap.add_argument("--tolerance", type=float, default=1e-3, help="the largest loglikelihood difference allowed")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds each lm-eval run may take")
    ap.add_argument("--out", default="bench-results/eval_harness.json")
    args = ap.parse_args()

    root = mooncake_home() / "lm-eval"
    python = environment(root)
    model_dir = fetch_model(args.model)
    work = Path(tempfile.mkdtemp(prefix="eval-harness-"))
    task_dir = write_task(work / "task")
    runs = {}
    cfg = load_config(None, {"engine.model": args.model, "api.port": 0})
    with DevCluster(cfg, workdir=work / "cluster", log_to_files=True) as cluster:
        served = json.loads(urllib.request.urlopen(cluster.url + "/v1/models", timeout=10).read())["data"][0]["id"]
        for batch in (1, 4):
            model_args = (f"model={served},base_url={cluster.url}/v1/completions,tokenizer={model_dir},"
                          f"tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=1,max_retries=1")
            runs[f"mooncake batch {batch}"] = run_lm_eval(python, task_dir, work / f"mooncake-{batch}",
                                                          "local-completions", model_args, batch, args.timeout)
    runs["transformers (hf)"] = run_lm_eval(python, task_dir, work / "hf", "hf",
                                            f"pretrained={model_dir},dtype=float32", 1, args.timeout,
                                            ["--device", "cpu"])

    shutil.rmtree(work, ignore_errors=True)
    reference = runs["transformers (hf)"][0]
    report = {"model": args.model, "items": len(ITEMS), "choices": sum(len(c) for _, c, _ in ITEMS),
              "tolerance": args.tolerance, "runs": {}}
    ok = True
    print(f"{'run':<20} {'accuracy':>9} {'max |dLL|':>10} {'mean |dLL|':>11} {'seconds':>8}")
    for name, (result, seconds) in runs.items():
        diffs = [abs(result["scores"][k] - v) for k, v in reference["scores"].items()]
        same_items = set(result["scores"]) == set(reference["scores"])
        agrees = same_items and max(diffs) <= args.tolerance and result["acc"] == reference["acc"]
        ok = ok and agrees
        report["runs"][name] = {"accuracy": result["acc"], "max_abs_diff": max(diffs), "mean_abs_diff":
                                sum(diffs) / len(diffs), "seconds": round(seconds, 1), "agrees": agrees}
        print(f"{name:<20} {result['acc']:>9.3f} {max(diffs):>10.2e} {sum(diffs) / len(diffs):>11.2e} "
              f"{seconds:>8.1f}{'' if agrees else '  DISAGREES'}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

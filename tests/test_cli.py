"""The command line as a user meets it: JSON output, the real model's answer, and one-line errors."""

import json
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REAL


def mooncake(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "mooncake", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_generate_json_output(tiny_dir):
    proc = mooncake("generate", "--model", "tiny-llama", "--prompt", "hello", "--max-tokens", "5", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert set(out) >= {"text", "token_ids", "prompt_tokens", "completion_tokens", "ttft_s", "tokens_per_s"}
    assert out["prompt_tokens"] == 5 and out["completion_tokens"] == len(out["token_ids"]) <= 5


@pytest.mark.real_model
def test_capital_of_france_is_paris(real_dir):
    proc = mooncake("generate", "--model", REAL, "--chat", "--prompt", "What is the capital of France?")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def unsupported_dir(tiny_dir, tmp_path):
    copy = shutil.copytree(tiny_dir, tmp_path / "gpt2-like")
    (copy / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    return str(copy)


def bad_config(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[engine]\nblok_size = 16\n")
    return str(path)


@pytest.mark.parametrize("case, args, message", [
    ("unknown model", lambda d, t: ["--model", "gpt-17"], "unknown model 'gpt-17'"),
    ("missing path", lambda d, t: ["--model", str(t / "nowhere")], "does not exist"),
    ("unsupported architecture", lambda d, t: ["--model", unsupported_dir(d, t)], "unsupported architecture"),
    ("prompt over context", lambda d, t: ["--model", "tiny-llama", "--prompt", "x" * 5000], "context length"),
    ("max_tokens zero", lambda d, t: ["--model", "tiny-llama", "--max-tokens", "0"], "max_tokens"),
    ("max_tokens negative", lambda d, t: ["--model", "tiny-llama", "--max-tokens", "-4"], "max_tokens"),
    ("bad config key", lambda d, t: ["--config", bad_config(t)], "engine.blok_size"),
])
def test_bad_input_is_one_line_and_nonzero(tiny_dir, tmp_path, case, args, message):
    argv = ["generate", "--prompt", "hi", *args(tiny_dir, tmp_path)]
    if "--prompt" in argv[3:]:
        argv = argv[:1] + argv[3:]
    proc = mooncake(*argv)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], proc.stderr


def test_model_list_and_help():
    proc = mooncake("model", "list")
    assert proc.returncode == 0 and "smollm2-135m-instruct" in proc.stdout and "tiny-llama" in proc.stdout
    assert "emulated-llama3-70b" in proc.stdout
    proc = mooncake("dev", "--help")
    assert proc.returncode == 0 and "--speedup" in proc.stdout and "--dtype" in proc.stdout
    proc = mooncake("generate", "--help")
    assert proc.returncode == 0 and "--max-tokens" in proc.stdout
    proc = mooncake("serve", "--help")  # config tables in brackets are shown, not taken for markup
    assert proc.returncode == 0 and "[instance].conductor_address" in proc.stdout and "()" not in proc.stdout


def test_simulate_reports_and_names_a_bad_trace_line(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]}\n'
                     '{"timestamp": 500, "input_length": 1200, "output_length": 3, "hash_ids": [1, 2, 3]}\n')
    proc = mooncake("simulate", "--trace", str(trace), "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["requests"] == 2 and report["served"] == 2 and report["hit_ratio"] > 0
    trace.write_text('{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]}\n{"oops"\n')
    proc = mooncake("simulate", "--trace", str(trace), "--out", str(tmp_path / "out"))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "t.jsonl:2: bad trace line" in proc.stderr

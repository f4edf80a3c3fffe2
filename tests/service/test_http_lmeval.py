"""lm-eval's `local-completions` model, an eval harness nobody here wrote, against the
HTTP API on two tiny local tasks (tests/service/lmeval_task, no data set download):

- a loglikelihood task: lm-eval sends each context + continuation as token ids with
  `echo`, `logprobs=1` and `max_tokens=1`, and reads the continuation's log-probability
  from the prompt's own logprobs, and whether each of its tokens was the greedy pick;
- a generate_until task: greedy completions that stop at a newline.

lm-eval counts tokens with the embedded model's own tokenizer files.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_http_api import Api, vllm_value
from test_server import start_server, stop_server

pytestmark = pytest.mark.slow

TASK_DIR = Path(__file__).parent / "lmeval_task"
LOGLIKELIHOOD = "pagedinfer_capitals_loglikelihood"
GENERATE = "pagedinfer_capitals_generate"


def task_docs(name: str) -> list[dict]:
    lines = (TASK_DIR / f"{name}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # fp32 products: the loglikelihoods are compared with transformers' forward
    server = start_server(tmp_path_factory.mktemp("lmeval-server"), "--gguf-activations", "fp32")
    yield server
    stop_server(server)


def base_url(server) -> str:
    return f"http://127.0.0.1:{server.http_port}"


def served_model(server) -> str:
    return Api(server).request("GET", "/v1/models").json()["data"][0]["id"]


@pytest.fixture(scope="module")
def evaluation(server, default_model_dir: Path, tmp_path_factory) -> tuple[dict, dict, str]:
    """lm-eval's results, its logged samples per task, and its console output."""
    work = tmp_path_factory.mktemp("lmeval")
    model_args = ",".join(
        [
            f"model={served_model(server)}",
            f"base_url={base_url(server)}/v1/completions",
            f"tokenizer={default_model_dir}",
            "tokenizer_backend=huggingface",
            "tokenized_requests=True",
            "num_concurrent=2",
            "max_retries=1",
            "timeout=300",
        ]
    )
    lm_eval = Path(sys.executable).with_name("lm_eval")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(work / "datasets"), "HF_HOME": str(work / "hf"),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip
    run = subprocess.run(
        [str(lm_eval), "run", "--model", "local-completions", "--model_args", model_args,
         "--tasks", f"{LOGLIKELIHOOD},{GENERATE}", "--include_path", str(TASK_DIR),
         # Two prompts a request: a list of lists of token ids.
         "--batch_size", "2", "--output_path", str(work / "out"), "--log_samples"],
        cwd=TASK_DIR,  # the tasks' data_files are relative to it
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    console = run.stdout + run.stderr
    assert run.returncode == 0, f"lm-eval failed:\n{console[-6000:]}\n{server.log_tail()}"
    results_files = sorted((work / "out").rglob("results_*.json"))
    assert results_files, f"lm-eval wrote no results:\n{console[-6000:]}"
    results = json.loads(results_files[-1].read_text())
    samples = {}
    for task in (LOGLIKELIHOOD, GENERATE):
        files = sorted((work / "out").rglob(f"samples_{task}_*.jsonl"))
        assert files, f"no samples logged for {task}"
        samples[task] = [json.loads(line) for line in files[-1].read_text().splitlines()]
    return results, samples, console


def test_prints_a_result_table_for_both_tasks(evaluation):
    console = evaluation[2]
    table = [line for line in console.splitlines() if line.startswith("|")]
    assert any("Tasks" in line and "Metric" in line for line in table), console[-3000:]
    rows = {task: [line for line in table if task in line] for task in (LOGLIKELIHOOD, GENERATE)}
    assert rows[LOGLIKELIHOOD] and rows[GENERATE], console[-3000:]
    # A task's first row names it; the metrics of its other rows follow.
    for metric in ("perplexity", "acc", "exact_match"):
        assert any(metric in line for line in table), f"{metric} missing from the table"


def test_loglikelihood_task_scores_every_document(evaluation):
    results, samples, _ = evaluation
    scores = results["results"][LOGLIKELIHOOD]
    assert 0 <= scores["acc,none"] <= 1
    # Perplexity exp(-mean loglikelihood) is at least 1 and finite: real log-probabilities.
    assert 1 <= scores["perplexity,none"] < math.inf
    assert len(samples[LOGLIKELIHOOD]) == len(task_docs("capitals_loglikelihood"))


def test_loglikelihoods_are_the_models_own(evaluation, default_model_dir: Path):
    """What lm-eval read from the echoed prompt logprobs is what transformers' forward
    pass of the same checkpoint gives: the continuation's summed log-probability, and
    whether each of its tokens was the most likely one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    for sample in evaluation[1][LOGLIKELIHOOD]:
        doc = sample["doc"]
        # lm-eval's split: the whole text's tokens, the context's count of them first.
        context = tokenizer(doc["context"], add_special_tokens=False).input_ids
        whole = tokenizer(doc["context"] + doc["continuation"], add_special_tokens=False).input_ids
        with torch.no_grad():
            logprobs = model(torch.tensor([whole])).logits[0].log_softmax(-1)
        rows = logprobs[len(context) - 1 : len(whole) - 1]
        targets = torch.tensor(whole[len(context) :])
        expected = float(rows.gather(1, targets[:, None]).sum())
        greedy = bool((rows.argmax(-1) == targets).all())
        # The samples file keeps each (loglikelihood, is_greedy) pair as strings.
        loglikelihood, is_greedy = sample["filtered_resps"][0]
        assert float(loglikelihood) == pytest.approx(expected, abs=2e-3), doc
        assert is_greedy == str(greedy), doc


def test_generate_until_task_answers_and_stops_at_the_newline(evaluation):
    results, samples, _ = evaluation
    # Greedy, and the answer's first token leads the runner-up by at least 2.7 nats in
    # transformers' forward of this checkpoint: every answer is the one in the data.
    assert results["results"][GENERATE]["exact_match,none"] == 1.0
    docs = task_docs("capitals_generate")
    assert len(samples[GENERATE]) == len(docs)
    for sample in samples[GENERATE]:
        (text,) = sample["filtered_resps"]
        assert text.strip(), f"empty generation for {sample['doc']}"
        assert "\n" not in text  # the stop string ended it, and is not returned


def test_server_is_idle_and_holds_no_blocks_afterwards(evaluation, server):
    server.wait_all_blocks_free()
    metrics = Api(server).metrics()
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:kv_cache_usage_perc"):  # fmt: skip
        assert vllm_value(metrics, gauge) == 0, gauge

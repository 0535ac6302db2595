"""lm-evaluation-harness's `local-completions`, at its defaults and offline, against a real
`butter serve` on the instruct model. Its default tokenizer backend finds butter's
/tokenizer_info and /tokenize (the remote tokenizer, nothing from the hub), and it sends
token-id prompts with `echo`. Every loglikelihood must equal a direct llama.cpp
computation on the same tokens to 1e-4, one request at a time or four concurrent
requests of four prompts each. One continuation ends with the end-of-text token, and
after another the model samples its end of turn (whose logprob must still be there)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import INSTRUCT_MODEL, ServerProcess, start_instruct_server

MODEL = INSTRUCT_MODEL
TOLERANCE = 1e-4
ITEMS = [
    ("The capital of France is", ["Paris", "London", "Rome"]),
    ("Two plus two equals", ["four", "five", "three"]),
    ("The sky on a clear day is", ["blue", "green", "red"]),
    ("A cat says", ["meow", "woof", "moo"]),
    ("The sun rises in the", ["east", "west", "north"]),
    ("That is all I have to say.", ["<|im_end|>", "And more."]),  # ends in end-of-text
    # A chat turn whose answer the model ends right after: the token it samples after the
    # echoed prompt is its end of turn, whose logprob lm-eval drops as the last entry.
    ("<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n",
     ["Hello!", "Goodbye!"]),
]
TASK = """task: butter_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: 0
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import json

    folder = tmp_path_factory.mktemp("lm-eval-task")
    data = folder / "items.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c}) + "\n"
                            for q, c in ITEMS))
    (folder / "tiny.yaml").write_text(TASK.format(data=data))
    return folder


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    # llama.cpp's own layer kernels: butter's (Q4_1 on this model) sum in another order,
    # and a continuation's score then moves by float rounding carried through the layers
    # (0.24 nats measured here), past the 1e-4 this test holds to (docs/api.md)
    process = start_instruct_server("--parallel", "4", "--max-context", "1024",
                                    "--no-fast-layers")
    yield process
    process.stop()


def evaluate(server: ServerProcess, task_dir: Path, *, batch_size: int, concurrent: int,
             monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, float]]:
    """(context, continuation, loglikelihood) of every request lm-eval made."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args=(f"base_url={server.api}/completions,model={MODEL},"
                    f"num_concurrent={concurrent},max_retries=1"),
        tasks=["butter_tiny_choice"], task_manager=TaskManager(include_path=str(task_dir)),
        batch_size=batch_size, log_samples=True)
    return [(arguments[0], arguments[1], response[0][0])
            for sample in results["samples"]["butter_tiny_choice"]
            for arguments, response in zip(sample["arguments"], sample["resps"], strict=True)]


def direct_loglikelihoods(pairs: list[tuple[str, str, float]]) -> list[float]:
    """The same tokens through llama.cpp itself, with flash attention as butter's context
    runs it (llama.cpp's CPU flash attention rounds differently from its plain path)."""
    import llama_cpp
    import numpy as np

    from butter.models import resolve_model

    llm = llama_cpp.Llama(model_path=str(resolve_model(MODEL)), n_ctx=512, n_batch=512,
                          logits_all=True, flash_attn=True, verbose=False)
    found = []
    for context, continuation, _ in pairs:
        # lm-eval moves a context's trailing whitespace onto its continuation.
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = llm.tokenize((context + continuation).encode(), add_bos=False, special=True)
        start = len(llm.tokenize(context.encode(), add_bos=False, special=True))
        llm.reset()
        llm.eval(whole)
        logits = np.asarray(llm.scores[: len(whole)], dtype=np.float64)
        total = 0.0
        for position in range(start, len(whole)):
            row = logits[position - 1]
            peak = row.max()
            total += row[whole[position]] - (peak + math.log(np.exp(row - peak).sum()))
        found.append(total)
    return found


def test_local_completions_at_its_defaults(server: ServerProcess, task_dir: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    os.environ.pop("OPENAI_API_KEY", None)
    one = evaluate(server, task_dir, batch_size=1, concurrent=1, monkeypatch=monkeypatch)
    many = evaluate(server, task_dir, batch_size=4, concurrent=4, monkeypatch=monkeypatch)
    assert len(one) == len(many) == sum(len(choices) for _, choices in ITEMS)
    assert [pair[:2] for pair in one] == [pair[:2] for pair in many]
    assert any(continuation.endswith("<|im_end|>") for _, continuation, _ in one)
    expected = direct_loglikelihoods(one)
    worst: dict[str, Any] = {}
    for name, run in (("one at a time", one), ("batched", many)):
        worst[name] = max(abs(got - want) for (_, _, got), want in zip(run, expected,
                                                                       strict=True))
    assert all(gap <= TOLERANCE for gap in worst.values()), worst


def test_the_tokenizer_routes_in_both_shapes(server: ServerProcess) -> None:
    import httpx

    base = server.base_url
    info = httpx.get(f"{base}/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    text = "Hello world"
    vllm = httpx.post(f"{base}/tokenize", json={"prompt": text}).json()
    llama = httpx.post(f"{base}/tokenize", json={"content": text, "with_pieces": True}).json()
    assert vllm["count"] == len(vllm["tokens"]) and vllm["max_model_len"] == 1024
    assert [piece["id"] for piece in llama["tokens"]] == vllm["tokens"]  # (no BOS here)
    assert "".join(piece["piece"] for piece in llama["tokens"]) == text
    back = httpx.post(f"{base}/v1/detokenize", json={"tokens": vllm["tokens"]}).json()
    assert back == {"prompt": text, "content": text}
    chat = httpx.post(f"{base}/tokenize", json={
        "messages": [{"role": "user", "content": text}]}).json()
    assert chat["count"] > vllm["count"]  # the template's turn markers
    special = httpx.post(f"{base}/tokenize", json={"prompt": "<|im_end|>",
                                                   "add_special_tokens": False}).json()
    assert special["count"] == 1  # the end-of-turn token itself
    echoed = httpx.post(f"{server.api}/completions", json={
        "prompt": vllm["tokens"], "echo": True, "max_tokens": 1, "logprobs": 1,
        "temperature": 0}).json()["choices"][0]
    assert echoed["text"].startswith(text)
    assert len(echoed["logprobs"]["token_logprobs"]) == vllm["count"] + 1
    for bad in ({}, {"prompt": "a", "content": "b"}, {"prompt": 5}):
        assert httpx.post(f"{base}/tokenize", json=bad).status_code == 400, bad
    assert httpx.post(f"{base}/detokenize", json={"tokens": [10**9]}).status_code == 400

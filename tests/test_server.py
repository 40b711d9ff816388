"""The OpenAI-compatible server with --attention-backend sparse_quoka answers the openai client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.engine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    import requests

    port = _free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    cfg = '{"sparse_attention": {"dense_below_tokens": 64, "budget": {"fraction": 0.25, "min_tokens": 32}}}'
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", tiny_llama, "--served-model-name", "tiny",
        "--attention-backend", "sparse_quoka", "--additional-config", cfg,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "2048", "--block-size", "32",
        "--max-num-batched-tokens", "128", "--enforce-eager",
        "--gpu-memory-utilization", "0.5", "--kv-cache-memory-bytes", str(1 << 28),
    ]
    env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 300
        try:
            while time.time() < deadline:
                if proc.poll() is not None:
                    pytest.fail(f"server exited rc={proc.returncode}:\n{log_path.read_text()[-5000:]}")
                try:
                    if requests.get(f"{base}/health", timeout=2).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                time.sleep(1)
            else:
                pytest.fail(f"server did not start:\n{log_path.read_text()[-5000:]}")
            yield base, log_path
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0)


LONG = " ".join(f"item{i}" for i in range(150))  # long enough that sparse layers select pages


def test_completion(client):
    r = client.completions.create(model="tiny", prompt=LONG, max_tokens=16, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens >= 1


def test_chat(client):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": LONG}], max_tokens=16, temperature=0
    )
    assert isinstance(r.choices[0].message.content, str)
    assert r.usage.completion_tokens >= 1


def test_streaming_completion_and_chat(client):
    # A random model's tokens may be end-of-text or bytes that do not decode to text: count tokens.
    chunks = list(
        client.completions.create(
            model="tiny", prompt=LONG, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )  # fmt: skip
    assert len([c for c in chunks if c.choices]) >= 2  # streamed, not one final message
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)
    assert chunks[-1].usage.completion_tokens == 12
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": LONG}], max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)  # a random model's bytes may not decode to text, so count tokens instead
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)
    assert chunks[-1].usage.completion_tokens == 12


def test_bad_request_rejected_and_server_stays_up(client, server):
    import openai

    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt=LONG, max_tokens=10_000, temperature=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=4, temperature=-1)
    r = client.completions.create(model="tiny", prompt=LONG, max_tokens=8, temperature=0)
    assert r.usage.completion_tokens >= 1
    assert "using SPARSE_QUOKA on CPU" in server[1].read_text()


# --------------------------------------------------------------------------------------------
# Bad requests (issue 15 item 4): each refused with a 4xx and a message; the server stays up
# --------------------------------------------------------------------------------------------

GOOD = {"model": "tiny", "prompt": LONG, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def good_answer(server):
    """The good request's answer before any bad one (greedy, so it must not change)."""
    import requests

    r = requests.post(f"{server[0]}/v1/completions", json=GOOD, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


TOO_LONG = "x" * 3000  # one token a byte: past --max-model-len 2048
BAD_REQUESTS = {
    # name: (path, body, HTTP status, words the message must contain)
    "empty_prompt": ("completions", {**GOOD, "prompt": ""}, 400, "non-empty"),
    "empty_token_ids": ("completions", {**GOOD, "prompt": []}, 400, "at least one prompt"),
    "token_id_out_of_vocab": ("completions", {**GOOD, "prompt": [1, 10**6]}, 400, "out of vocabulary"),
    "prompt_too_long": ("completions", {**GOOD, "prompt": TOO_LONG}, 400, "2048"),
    "chat_too_long": ("chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": TOO_LONG}], "max_tokens": 4}, 400, "2048"),
    "stream_too_long": ("completions", {**GOOD, "prompt": TOO_LONG, "stream": True}, 400, "2048"),
    "max_tokens_huge": ("completions", {**GOOD, "max_tokens": 10**9}, 400, "max_tokens"),
    "max_tokens_negative": ("completions", {**GOOD, "max_tokens": -1}, 400, "max_tokens"),
    "max_tokens_zero": ("completions", {**GOOD, "max_tokens": 0}, 400, "max_tokens"),
    "max_tokens_not_a_number": ("completions", {**GOOD, "max_tokens": "many"}, 400, "max_tokens"),
    "temperature_negative": ("completions", {**GOOD, "temperature": -1}, 400, "temperature"),
    "top_p_above_one": ("completions", {**GOOD, "top_p": 1.5}, 400, "top_p"),
    "top_k_negative": ("completions", {**GOOD, "top_k": -5}, 400, "top_k"),
    "presence_penalty_out_of_range": ("completions", {**GOOD, "presence_penalty": 5}, 400, "presence_penalty"),
    "n_zero": ("completions", {**GOOD, "n": 0}, 400, "n"),
    "logprobs_absurd": ("completions", {**GOOD, "logprobs": 10**6}, 400, "logprobs"),
    "unknown_model": ("completions", {**GOOD, "model": "no-such-model"}, 404, "no-such-model"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_gets_4xx_with_a_message(name, server, good_answer):
    import requests

    path, body, status, needle = BAD_REQUESTS[name]
    r = requests.post(f"{server[0]}/v1/{path}", json=body, timeout=120)
    assert r.status_code == status, (name, r.status_code, r.text[:500])
    message = str(r.json()["error"]["message"])
    assert needle in message, (name, message)


def test_malformed_json_gets_400(server, good_answer):
    import requests

    r = requests.post(
        f"{server[0]}/v1/completions", data=b'{"model": "tiny", "prompt": ', headers={"Content-Type": "application/json"},
        timeout=60,
    )  # fmt: skip
    assert r.status_code == 400, r.text[:500]


def test_good_request_after_the_bad_ones_gives_the_same_answer(server, good_answer):
    import requests

    assert requests.get(f"{server[0]}/health", timeout=10).status_code == 200
    r = requests.post(f"{server[0]}/v1/completions", json=GOOD, timeout=120)
    assert r.status_code == 200, r.text
    again = r.json()
    assert again["usage"]["completion_tokens"] == 8
    assert again["choices"][0]["text"] == good_answer["choices"][0]["text"]
    log = server[1].read_text()
    assert "EngineDeadError" not in log and "Traceback" not in log, log[-3000:]

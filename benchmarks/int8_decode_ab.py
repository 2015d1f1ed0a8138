"""int8 decode before / after this change, in one process, interleaved, against transformers fp32.

    python benchmarks/int8_decode_ab.py --threads 1 --rounds 5 --new-tokens 32        # llama-155m

"before" reproduces the previous int8 decode step on the same quantized model: ``KVInt8`` rounds the
keys and values the int8 cache returned a second time and validates a second ``mh.attention`` call,
``Int8Linear`` reshapes around fbgemm and asks torch for the quantized engine on every call, and bf16
activations run on ``torch._weight_int8pack_mm`` (the previous "auto" for bf16). "after" is the library
as it is. Tokens/s as in ``multihead bench decode``: ``(new - 1) / (t(new) - t(1))``, fastest round.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from torch import Tensor

import multihead as mh
from multihead.bench import timing
from multihead.bench.decode import DEFAULT_PRESET
from multihead.core.functional import attention
from multihead.models import quant

AFTER = (quant.Int8Linear.forward, quant.int8_rounded, quant.KVInt8._exact)


def before_forward(self: quant.Int8Linear, x: Tensor) -> Tensor:
    """The previous Int8Linear.forward: flatten, engine query per call, fbgemm for fp32 only."""
    engines = torch.backends.quantized.supported_engines
    lead = x.shape[:-1]
    x2 = x.reshape(-1, self.in_features)  # (M, I)
    if x.dtype == torch.float32 and any(e in engines for e in ("fbgemm", "x86")):
        y = torch.ops.quantized.linear_dynamic(x2.contiguous(), self._fbgemm_weight(), quant.REDUCE_RANGE)
    elif x.dtype in (torch.bfloat16, torch.float16):
        y = torch._weight_int8pack_mm(x2.contiguous(), self.weight_int8, self.scale.to(x.dtype))  # (M, O)
    else:
        y = F.linear(x2, self.weight_int8.to(x.dtype) * self.scale.to(x.dtype)[:, None])  # (M, O)
    if self.bias is not None:
        y = y + self.bias.to(y.dtype)
    return y.reshape(*lead, self.out_features)  # (..., O)


def before_exact(p) -> Tensor:
    """The previous KVInt8 inner call: a second, validated mh.attention."""
    out = attention(p.q, p.k, p.v, mask=p.mask, bias=p.bias, scale=p.scale, dropout_p=p.dropout_p)
    assert isinstance(out, Tensor)
    return out


def use(version: str) -> None:
    forward, rounded, exact = AFTER
    if version == "before":
        forward, rounded, exact = before_forward, (lambda t: False), before_exact
    quant.Int8Linear.forward = forward  # type: ignore[method-assign]
    quant.int8_rounded = rounded
    quant.KVInt8._exact = staticmethod(exact)  # type: ignore[method-assign,assignment]


def main() -> None:
    import transformers as tf

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--preset",
        default="llama-155m",
        help=f"a pretrained preset (default llama-155m; {DEFAULT_PRESET} is quick)",
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    config = mh.pretrained.preset_config(args.preset)
    hf_config = tf.LlamaConfig(**{k: v for k, v in config.items() if k != "model_type"})
    hf_config.bos_token_id = hf_config.eos_token_id = hf_config.pad_token_id = None
    torch.manual_seed(0)
    hf32 = tf.LlamaForCausalLM(hf_config).eval()
    ours = mh.pretrained.from_hf(hf32)
    ours16 = copy.deepcopy(ours).to(torch.bfloat16)
    q8 = mh.quant.quantize(ours, weights="int8", kv="int8")
    q8_16 = mh.quant.quantize(ours16, weights="int8", kv="int8")
    ids = torch.randint(0, config["vocab_size"], (1, args.prompt), generator=torch.Generator().manual_seed(1))
    runs = {
        "HF fp32": (
            "after",
            lambda n: hf32.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False),
        ),
        "int8, fp32 activations, before": ("before", lambda n: q8.generate(ids, n)),
        "int8, fp32 activations, after": ("after", lambda n: q8.generate(ids, n)),
        "int8, bf16 activations, before": ("before", lambda n: q8_16.generate(ids, n)),
        "int8, bf16 activations, after": ("after", lambda n: q8_16.generate(ids, n)),
    }

    def call(version: str, gen, n: int):
        def run() -> None:
            use(version)
            gen(n)

        return run

    with torch.inference_mode():
        tokens = {}
        for name, (version, gen) in runs.items():
            use(version)
            tokens[name] = gen(8)
        calls = {}
        for name, (version, gen) in runs.items():
            calls[f"{name}|1"] = call(version, gen, 1)
            calls[f"{name}|n"] = call(version, gen, args.new_tokens)
        t = timing.measure_all(calls, min_samples=args.rounds, warmup=0)  # interleaved, rotated
    use("after")
    steps = {k: timing.difference(t[f"{k}|n"], t[f"{k}|1"]) for k in runs}
    tok_s = {k: steps[k].rate(args.new_tokens - 1) for k in runs}
    same = torch.equal(tokens["int8, fp32 activations, before"], tokens["int8, fp32 activations, after"])
    print(
        f"{args.preset}, prompt {args.prompt}, {args.new_tokens} new tokens, {args.threads} thread(s), "
        f"median of >= {args.rounds} interleaved samples; fp32-activation tokens before == after: {same}"
    )
    for name, rate in tok_s.items():
        vs = timing.compare(steps["HF fp32"], steps[name])  # HF's time / ours: our speed-up
        shown = timing.TOO_SHORT if rate is None else f"{rate:7.1f} tok/s"
        print(f"{name:32s} {shown}  vs HF fp32: {vs}")


if __name__ == "__main__":
    main()

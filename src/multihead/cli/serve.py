"""``multihead serve``: an OpenAI-compatible HTTP server over the continuous-batching engine.

    multihead serve                                  SmolLM2-135M-Instruct on http://127.0.0.1:8000
    multihead serve --model FILE.gguf --port 9000    another model, another port
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "Hello"}], "stream": true}'

Endpoints and errors: :mod:`multihead.cli.serve_app`. Bound to 127.0.0.1 unless ``--host`` says
otherwise (there is no authentication). Needs the ``serve`` extra: ``pip install "multihead[serve]"``.
"""

from __future__ import annotations

import argparse
import importlib.util

from .models import LM_MODEL
from .threads import threads_option

__all__ = ["register"]


def _cmd_serve(args: argparse.Namespace) -> int:
    """Load the model, start the engine's thread, and serve until Ctrl-C."""
    for name in ("fastapi", "uvicorn"):
        if importlib.util.find_spec(name) is None:
            raise ImportError(f"multihead serve needs {name}: pip install 'multihead[serve]'")
    import uvicorn

    from ..serve import Engine
    from ..serve.background import EngineThread
    from .models import load_lm
    from .serve_app import Limits, build_app

    model, tokenizer, what = load_lm(args.model)
    engine = Engine(
        model,
        num_blocks=args.num_blocks,
        max_seqs=args.max_seqs,
        kv=args.kv,
        tokenizer=tokenizer,
    )
    limits = Limits(
        max_prompt_tokens=min(args.max_prompt_tokens, model.max_len - 1),
        max_tokens=args.max_tokens,
        max_request_bytes=args.max_request_bytes,
        max_concurrent=args.max_concurrent,
    )
    runner = EngineThread(engine).start()
    try:
        print(f"multihead serve: {what} on http://{args.host}:{args.port}/v1 ({engine.cache})", flush=True)
        uvicorn.run(
            build_app(runner, args.model, limits), host=args.host, port=args.port, log_level="warning"
        )
    finally:
        runner.stop()
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``serve`` subcommand to the ``multihead`` parser."""
    from .args import integer, positive_int

    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models)",
        description="Serve a language model over HTTP with continuous batching on a paged KV cache: "
        "OpenAI's /v1/completions and /v1/chat/completions (stream=true as server-sent events), "
        "/v1/models, /health and /metrics. Needs pip install 'multihead[serve]'.",
    )
    p.add_argument("--model", metavar="M", default="smollm2", help=f"{LM_MODEL} (default smollm2)")
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)"
    )
    p.add_argument("--port", type=integer(1, 65535), default=8000, help="TCP port (default 8000)")
    p.add_argument("--max-seqs", type=integer(1, 1024), default=16, help="sequences decoded at once (16)")
    p.add_argument(
        "--num-blocks", type=positive_int, default=None, help="KV blocks of 16 tokens (default: 256 MiB)"
    )
    p.add_argument("--kv", choices=("dense", "int8"), default="dense", help="KV page storage (dense)")
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=1024,
        help="the most tokens one request may generate (1024)",
    )
    p.add_argument("--max-prompt-tokens", type=positive_int, default=4096, help="longest prompt (4096)")
    p.add_argument("--max-request-bytes", type=positive_int, default=1 << 20, help="largest body (1 MiB)")
    p.add_argument("--max-concurrent", type=positive_int, default=64, help="requests in flight (64)")
    p.set_defaults(func=_cmd_serve)
    threads_option(p)

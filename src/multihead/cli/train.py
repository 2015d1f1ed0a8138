"""``multihead train``: train the small TransformerLM on MQAR with exact or approximate attention.

    multihead train                                    exact attention on a small task (a few CPU minutes)
    multihead train --full                             the report's recipe (seq 256, 16 pairs, 5000 steps;
                                                       20-25 minutes on a quiet CPU)
    multihead train --attention Performer --steps 300  an approximation (names as in `multihead approx`)
    multihead train --attention moh                    a head design of multihead.variants (MoH, DCMHA, ...)
    multihead train --seq-len 64 --pairs 4 --json      a smaller task, machine-readable result

Prints the held-out accuracy (the fraction of queried keys whose value the model names).
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from .threads import threads_option

if TYPE_CHECKING:
    from ..train.trainer import TrainConfig

__all__ = ["register", "training_bytes"]


def _choices() -> list[str]:
    """Every valid ``--attention``: exact, the head designs, the approximations of ``multihead approx``."""
    from ..bench import approx as measure
    from ..variants import NAMES

    methods = [m.name.split("(")[0] for m in measure.METHODS if not m.name.startswith("exact")]
    return ["exact", *NAMES, *methods]


def _cmd_train(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import Progress

    from ..bench import approx as measure
    from ..train.trainer import TrainConfig, train_mqar
    from ..variants import NAMES
    from .console import progress_columns

    _resolve_recipe(args)
    valid = _choices()
    if args.attention not in valid and not any(args.attention == m.name for m in measure.METHODS):
        raise ValueError(
            f"--attention {args.attention!r} is not known; choose one of {valid} (exact attention, a head "
            "design of multihead.variants, or an approximation of `multihead approx`)"
        )
    cfg = TrainConfig(
        seq_len=args.seq_len,
        n_pairs=args.pairs,
        vocab=args.vocab,
        d_model=args.d_model,
        n_heads=args.heads,
        d_ff=2 * args.d_model,
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        seed=args.seed,
        short_steps=args.short_steps,
        attention=args.attention if args.attention in NAMES else "mha",
    )
    _check_memory(cfg)
    plain = args.attention == "exact" or args.attention in NAMES
    approx = None if plain else measure.make(args.attention, cfg.seq_len)
    with Progress(*progress_columns(count=True), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(f"train {args.attention}", total=cfg.steps)

        def progress(step: int, loss: float) -> None:
            bar.update(task, completed=step + 1, description=f"train {args.attention}: loss {loss:.3f}")

        res = train_mqar(cfg, approx, progress=progress)
    if args.json:
        doc = res.as_dict()
        doc["final_loss"] = res.losses[-1]
        del doc["losses"]
        print(json.dumps(doc, indent=1))
        return 0
    from .console import make_console

    mode = "causal" if res.causal else "bidirectional (no causal form)"
    make_console().print(
        f"MQAR seq_len={cfg.seq_len}, {cfg.n_pairs} pairs, vocab {cfg.vocab}: {res.approx}, {mode}, "
        f"{cfg.steps} steps in {res.seconds:.0f} s, final loss {res.losses[-1]:.3f}, "
        f"held-out accuracy {100 * res.accuracy:.1f}% ({cfg.eval_examples} examples); "
        f"{res.extra['params']:,} parameters, {res.extra['flops'] / 1e6:,.1f} MFLOP per sequence forward",
        markup=False,
    )
    return 0


def training_bytes(cfg: TrainConfig) -> int:
    """A lower bound on the bytes a run of ``cfg`` holds at once: the weights with their gradients and
    AdamW's two moments (fp32), the held-out set (inputs and targets, int64), and one batch's
    activations (8 of width d_model a layer) and logits (fp32)."""
    d, layers = cfg.d_model, cfg.n_layers
    params = cfg.vocab * d + layers * (4 * d * d + 2 * d * cfg.d_ff)
    held_out = cfg.eval_examples * cfg.seq_len * 16
    batch = cfg.batch * cfg.seq_len * (8 * d * layers + cfg.vocab) * 4
    return 16 * params + held_out + batch


def _check_memory(cfg: TrainConfig) -> None:
    """Refuse, before the data or the model is built, a run larger than the free memory.

    Raises:
        ValueError: :func:`training_bytes` over the free memory; the message names the options.
    """
    from ..core.limits import check_fits

    check_fits(
        training_bytes(cfg),
        f"--batch {cfg.batch} x --seq-len {cfg.seq_len} with --vocab {cfg.vocab} and --d-model {cfg.d_model} "
        "(the weights and their optimizer state, the held-out set, one batch's activations and logits)",
        "lower --batch, --seq-len, --vocab or --d-model",
    )


#: the default of `multihead train` with no arguments: a quarter-size MQAR task that a CPU learns in
#: minutes; ``--full`` takes the trainer's own recipe (:class:`~multihead.train.trainer.TrainConfig`)
QUICK = {"seq_len": 64, "pairs": 4, "steps": 2000, "short_steps": 0}


def _resolve_recipe(args: argparse.Namespace) -> None:
    """Fill the options left unset from the quick recipe, or from TrainConfig's with ``--full``."""
    from ..train.trainer import TrainConfig

    d = TrainConfig()
    full = {"seq_len": d.seq_len, "pairs": d.n_pairs, "steps": d.steps, "short_steps": d.short_steps}
    for key, value in (full if args.full else QUICK).items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``train`` subcommand to the ``multihead`` parser."""
    from ..train.trainer import TrainConfig
    from .args import count, positive_int, real, seed

    d = TrainConfig()
    choices = _choices()
    p = sub.add_parser(
        "train",
        help="train a 2-layer TransformerLM on MQAR (associative recall) with exact or approximate attention",
        description="Train a small TransformerLM on fresh MQAR batches (Zoology's generator) "
        "and report held-out accuracy. With no options it trains a quarter-size task (seq_len 64, 4 pairs, "
        "2000 steps: about 2 CPU minutes on a quiet machine, 99% held-out accuracy with exact attention); "
        "--full runs the report's recipe. --attention takes 'exact', a head design of multihead.variants "
        f"or a method of `multihead approx`: {', '.join(choices)}.",
    )
    p.add_argument("--task", choices=["mqar"], default="mqar", help="the task (default mqar)")
    p.add_argument(
        "--attention",
        default="exact",
        metavar="NAME",
        help=f"exact, a head design or an approximation (default exact): {', '.join(choices)}",
    )
    p.add_argument(
        "--full",
        action="store_true",
        help=f"the report's recipe: seq_len {d.seq_len}, {d.n_pairs} pairs, {d.steps} steps with a "
        "curriculum (20-25 minutes on a quiet CPU); default: the quick task below",
    )
    q = QUICK
    p.add_argument(
        "--steps", type=positive_int, default=None,
        help=f"training steps (default {q['steps']}; {d.steps} with --full)",
    )  # fmt: skip
    p.add_argument("--batch", type=positive_int, default=d.batch, help=f"batch size (default {d.batch})")
    lr = real(0.0, lo_open=True)
    p.add_argument("--lr", type=lr, default=d.lr, help=f"peak learning rate (default {d.lr})")
    p.add_argument(
        "--seq-len", type=positive_int, default=None,
        help=f"tokens per example (default {q['seq_len']}; {d.seq_len} with --full)",
    )  # fmt: skip
    p.add_argument(
        "--pairs", type=positive_int, default=None,
        help=f"key-value pairs (default {q['pairs']}; {d.n_pairs} with --full)",
    )  # fmt: skip
    p.add_argument("--vocab", type=positive_int, default=d.vocab, help=f"vocabulary (default {d.vocab})")
    p.add_argument(
        "--d-model", type=positive_int, default=d.d_model, help=f"model width (default {d.d_model})"
    )
    p.add_argument(
        "--heads", type=positive_int, default=d.n_heads, help=f"attention heads (default {d.n_heads})"
    )
    p.add_argument(
        "--short-steps",
        type=count,
        default=None,
        help="curriculum: train the first N steps on sequences and pair counts a quarter of the size "
        f"(default {q['short_steps']}: off; 40%% of --steps with --full)",
    )
    p.add_argument(
        "--seed",
        type=seed,
        default=d.seed,
        help=f"seed of data and weights (0 to 4294967295, default {d.seed})",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=_cmd_train)
    threads_option(p)

"""``multihead heads``: what the 72 heads of the bundled all-MiniLM-L6-v2 look at.

    multihead heads                                  the default sentence; roles over 32 docstrings
    multihead heads "Some text to look at." --out multihead-heads/
    multihead heads --texts 0 --head 0.2 --head 1.11 --json

Writes to ``--out`` (default ``multihead-heads/``): ``maps.png`` (the layer x head grid of the text's
attention maps), ``roles.png`` and ``roles.md`` (each head's role and Clark et al.'s statistics,
measured on the text and ``--texts`` standard-library docstrings) and ``head_L_H.png`` per ``--head L.H``
(one map with its tokens). Prints the role grid (or, with ``--json``, the table and the files).

    multihead heads convert --to gqa|mla|prune ...   shrink a model's KV cache by head surgery
                                                     (``multihead heads convert --help``)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..pretrained.files import atomic_folder, atomic_write
from .args import count, minutes
from .console import for_terminal
from .threads import threads_option

__all__ = ["DEFAULT_TEXT", "register", "run"]

DEFAULT_TEXT = "The quick brown fox jumps over the lazy dog, and then it runs away."


def _head_arg(text: str) -> tuple[int, int]:
    layer, sep, head = text.partition(".")
    if not sep or not layer.isdigit() or not head.isdigit():
        raise argparse.ArgumentTypeError(f"expected LAYER.HEAD such as 0.2, got {text!r}")
    return int(layer), int(head)


def run(args: argparse.Namespace) -> int:
    """Measure the roles, draw the maps, write the files; return 0.

    Raises:
        ValueError: a --head outside the model, an --out that cannot be written (checked first), a full
            disk, and what the head tools raise.
    """
    from .. import heads
    from ..heads import plots
    from ..pretrained import minilm, stdlib_docstrings
    from .console import check_output_dir, writing
    from .progress import eta_progress

    out = check_output_dir(args.out, "--out", inside=True)  # before the model is loaded
    with writing(out, "--out"):
        out.mkdir(parents=True, exist_ok=True)
    with writing(out, "--out", full_only=True), eta_progress() as bar:
        # units: loading, each text's maps, the roles, the two grids, each --head, the table
        units = 4 + len(args.head)
        task = bar.add_task("loading all-MiniLM-L6-v2", total=units + 1 + args.texts)
        model = minilm()
        attns = [layer.self_attn for layer in heads.layers_of(model)]
        L, H = len(attns), attns[0].n_heads
        for layer, head in args.head:
            if not (0 <= layer < L and 0 <= head < H):
                raise ValueError(f"--head {layer}.{head} is outside the model's {L} layers x {H} heads")
        texts = [args.text, *(stdlib_docstrings(args.texts, max_chars=600) if args.texts else [])]
        bar.update(
            task, advance=1, total=units + len(texts), description=f"attention maps of {len(texts)} texts"
        )
        maps = []
        for text in texts:  # one at a time, as attention_maps runs them: each a unit of the ETA
            maps += heads.attention_maps(model, [text])
            bar.update(task, advance=1)
        tokens = heads.token_strings(model, texts)
        table = heads.roles(maps, tokens)
        bar.update(task, advance=1, description="drawing")
        files = [
            plots.plot_maps(maps[0], out / "maps.png", table, title=args.text[:100]),
            plots.plot_roles(table, out / "roles.png"),
        ]
        bar.update(task, advance=1)
        for layer, head in args.head:
            name = out / f"head_{layer}_{head}.png"
            title = f"layer {layer} head {head}"
            files.append(plots.plot_head(maps[0][layer, head], tokens[0], name, title=title))
            bar.update(task, advance=1)
        md = out / "roles.md"
        where = f"the text and {args.texts} docstrings" if args.texts else "the text"
        with atomic_write(md) as tmp:
            tmp.write_text(
                f"# Head roles of all-MiniLM-L6-v2 on {where}\n\n{heads.roles_grid(table)}\n\n"
                f"{heads.roles_table(table)}\n"
            )
        files.append(md)
        bar.update(task, advance=1)
    if args.json:
        doc = {"text": args.text, "texts": len(texts), "roles": [r.as_dict() for r in table]}
        print(json.dumps({**doc, "files": [str(f) for f in files]}, indent=1))
        return 0
    from .console import make_console

    console = make_console()
    console.print(f"head roles on {where} ({sum(len(t) for t in tokens)} tokens):", markup=False)
    console.print(heads.roles_grid(table), markup=False)
    for f in files:
        console.print(f"wrote {f}", markup=False)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``heads`` subcommand to the ``multihead`` parser."""
    p = sub.add_parser(
        "heads",
        help="what each head of all-MiniLM-L6-v2 attends to (map grid, role table); `heads convert`: "
        "GQA / MLA / pruning surgery",
        description=for_terminal(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("text", nargs="?", default=DEFAULT_TEXT, help="the text whose maps are drawn")
    p.add_argument(
        "--texts",
        type=count,
        default=32,
        help="standard-library docstrings added to the role statistics; 0: the text only (default 32)",
    )
    p.add_argument(
        "--out",
        default="multihead-heads",
        help="directory for the PNGs and roles.md (default multihead-heads/)",
    )
    p.add_argument(
        "--head",
        type=_head_arg,
        action="append",
        default=[],
        metavar="L.H",
        help="also draw head H of layer L with its tokens (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print the role table and the files as JSON")
    p.set_defaults(func=run)
    threads_option(p)


def _fraction(text: str) -> float:
    """argparse type: a fraction in (0, 1), as 0.33 or 1/3."""
    try:
        num, sep, den = text.partition("/")
        value = float(num) / float(den) if sep else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.33 or 1/3, got {text!r}") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"expected a fraction in (0, 1), got {text!r}")
    return value


def _lm_tokens(
    model: Any, docs: list[str], tokenizer_dir: Path | None, max_tokens: int = 128
) -> list[list[int]]:
    """Token ids of ``docs`` for an LM: its tokenizer.json when the checkpoint has one, else the texts'
    UTF-8 bytes modulo the vocabulary (random-weight presets have no tokenizer)."""
    if tokenizer_dir is not None and (tokenizer_dir / "tokenizer.json").is_file():
        from ..pretrained.files import read_tokenizer

        tok = read_tokenizer(tokenizer_dir / "tokenizer.json")
        return [e.ids[:max_tokens] or [0] for e in tok.encode_batch(docs)]
    return [[b % model.vocab_size for b in d.encode("utf-8")[:max_tokens]] or [0] for d in docs]


def _base(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """The model to convert, its surgery.json base, and its name."""
    from ..heads.checkpoint import MINILM
    from ..pretrained import load, minilm, random_lm

    if args.hf is not None and args.preset is not None:
        raise ValueError("pass one of --hf DIR and --preset NAME (or neither, for MiniLM)")
    if args.hf is not None:
        return load(args.hf), {"hf": str(args.hf)}, str(args.hf)
    if args.preset is not None:
        return random_lm(args.preset), {"preset": args.preset}, f"{args.preset} (random weights)"
    try:
        return minilm(), MINILM, MINILM
    except ImportError as e:
        raise ValueError(str(e)) from None


def convert(args: argparse.Namespace) -> int:
    """``multihead heads convert``: shrink a model's KV cache (MiniLM, or a LLaMA-family LM with --hf /
    --preset), optionally recover, save, load back; return 0.

    Raises:
        ValueError: --hf with --preset, a surgery that changes nothing or does not shrink the KV cache
            (without --allow-unchanged), and what the surgery, recover and checkpoint functions raise.
    """
    import time

    import torch

    from .. import heads
    from ..heads import mla
    from ..heads.access import pad_batch
    from ..models.lm import TransformerLM
    from ..pretrained import SentenceEncoder, stdlib_docstrings
    from .console import check_input_dir, check_output_dir, make_console, writing

    if args.hf is not None:
        check_input_dir(args.hf, "--hf", "a save_pretrained() checkpoint folder")
    check_output_dir(args.out, "--out")  # before the surgery, not after it
    model, base, name = _base(args)
    lm = isinstance(model, TransformerLM)
    docs = stdlib_docstrings(args.texts, max_chars=600)
    texts: Any = _lm_tokens(model, docs, None if args.hf is None else Path(args.hf)) if lm else docs
    calibration = texts[: mla.ENCODER_CALIBRATION_DOCS]  # the recipe's 256 (fewer when --texts is smaller)
    if args.to == "gqa":
        step: dict = {"to": "gqa", "n_kv_heads": args.kv_heads}
    elif args.to == "mla":
        step = {"to": "mla", "kv_rank": args.kv_rank}
        if lm:
            step |= {"rope_dims": args.rope_dims, "rope_select": args.rope_select}
    else:
        scored: Any = docs[64:128]
        if lm:  # next-token loss on equal-length id rows: the first 32 tokens of each docstring
            scored = torch.tensor([t[:32] for t in texts[64:128] if len(t) >= 32])  # (n, 32)
        scores = heads.importance(model, scored)  # (L, H)
        H = scores.shape[1]
        drop: dict[str, list[int]] = {}
        for i in scores.flatten().argsort()[: round(args.fraction * scores.numel())].tolist():
            drop.setdefault(str(i // H), []).append(i % H)
        step = {
            "to": "prune",
            "heads": {k: sorted(v) for k, v in sorted(drop.items(), key=lambda kv: int(kv[0]))},
        }
    _check_changes(model, step, args.allow_unchanged)
    t0 = time.perf_counter()
    student = heads.apply_surgery(model, step, calibration=None if args.to == "prune" else calibration)
    before = heads.kv_cache_bytes_per_token(model, torch.float32)
    after = heads.kv_cache_bytes_per_token(student, torch.float32)
    if args.to != "prune" and after >= before and not args.allow_unchanged:  # pruning saves compute
        raise ValueError(
            f"{args.to} with {step} does not shrink the KV cache ({before} -> {after} bytes per token, "
            f"float32); nothing saved to {args.out}. Choose a smaller --kv-rank / --kv-heads, or pass "
            "--allow-unchanged to save it anyway"
        )
    if args.recover_minutes or args.recover_steps:
        heads.recover(  # the recipe's defaults: mixed lengths (texts), lr, schedule, held-out stop
            student, model, texts, minutes=args.recover_minutes or None, steps=args.recover_steps,
            progress=not args.json,
        )  # fmt: skip
    with writing(args.out, "--out"):
        # text in, text out: the tokenizer is saved with the pair, in the same folder swap
        tokenizer = [] if args.hf is None else _tokenizer_files(Path(args.hf))
        folder = heads.save_converted(student, [step], args.out, base=base, files=tokenizer)
    loaded = heads.load_converted(folder)
    probe = texts[-8:]
    result = {
        "model": name, "to": args.to, "step": step, "out": str(folder),
        "kv_bytes_per_token": {"before": before, "after": after}, "changed": after < before,
        "seconds": time.perf_counter() - t0,
    }  # fmt: skip
    if lm:
        assert isinstance(student, TransformerLM) and isinstance(loaded, TransformerLM)
        ids, real = pad_batch(probe)  # (8, N) each
        with torch.no_grad():
            new, back, old = (m(ids, attention_mask=real) for m in (student, loaded, model))  # (8, N, V) each
        agree = (new.argmax(-1) == old.argmax(-1))[real].float().mean()
        result |= {
            "reload_max_abs_diff": float((back - new).abs().max()),
            "next_token_agreement": float(agree),
        }
        what = f"next-token agreement with the original {float(agree):.1%} on {int(real.sum())} tokens"
    else:
        assert isinstance(student, SentenceEncoder) and isinstance(loaded, SentenceEncoder)
        enc = [torch.as_tensor(m.encode(probe)) for m in (student, loaded, model)]  # (8, 384) each
        fidelity = float((enc[0] * enc[2]).sum(-1).mean())
        result |= {
            "reload_max_abs_diff": float((enc[1] - enc[0]).abs().max()),
            "cosine_to_original": fidelity,
        }
        what = f"mean cosine to the original {fidelity:.3f} on 8 docstrings"
    with writing(folder / "hf", "--out", full_only=True):
        result["hf"] = _export_hf(student, folder / "hf") if lm else _no_hf(args.to)
    if result["hf"]["written"] and args.hf is not None:
        _copy_tokenizer(Path(args.hf), folder / "hf")
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    kv = result["kv_bytes_per_token"]
    make_console().print(
        f"{name} {args.to}: KV cache {kv['before']} -> {kv['after']} bytes per token (float32); {what}; "
        f"saved to {folder}/ (model.safetensors, surgery.json), reloaded with mh.heads.load_converted: "
        f"max |diff| {result['reload_max_abs_diff']:.1e}",
        markup=False,
    )
    hf = result["hf"]
    make_console().print(
        f"transformers checkpoint: {hf['dir']}/ (AutoModelForCausalLM.from_pretrained; logits max |diff| "
        f"{hf['max_abs_diff']:.1e})"
        if hf["written"]
        else f"no transformers checkpoint: {hf['why']}",
        markup=False,
    )
    return 0


def _check_changes(model: Any, step: dict, allow: bool) -> None:
    """Refuse a step that changes nothing (GQA to the kv heads every layer already has, a prune of no
    heads) unless ``allow``.

    Raises:
        ValueError: such a step without ``allow``.
    """
    from ..heads import layers_of

    if allow:
        return
    if step["to"] == "gqa":
        have = sorted({layer.self_attn.n_kv_heads for layer in layers_of(model)})
        if have == [step["n_kv_heads"]]:
            raise ValueError(
                f"--to gqa --kv-heads {step['n_kv_heads']}: every layer already has {have[0]} kv heads, so "
                "nothing would change; pass fewer --kv-heads, or --allow-unchanged to save the model as it is"
            )
    if step["to"] == "prune" and not any(step["heads"].values()):
        raise ValueError(
            "--fraction prunes no head of this model (it rounds to 0 heads); pass a larger --fraction, or "
            "--allow-unchanged to save the model as it is"
        )


def _tokenizer_files(source: Path) -> list[Path]:
    """The tokenizer files of a checkpoint directory (those it has)."""
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
    return [source / name for name in names if (source / name).is_file()]


def _copy_tokenizer(source: Path, folder: Path) -> None:
    """Copy the tokenizer files of a checkpoint directory into ``folder`` (those it has)."""
    import shutil

    for f in _tokenizer_files(source):
        shutil.copy(f, folder / f.name)


def _no_hf(to: str) -> dict:
    """Why a converted MiniLM has no transformers checkpoint."""
    why = (
        "transformers' BertModel has no latent attention"
        if to == "mla"
        else "transformers' BertModel holds 12 key/value heads per query head set (no GQA, no per-layer "
        "head counts)"
    )
    return {"written": False, "why": why}


def _export_hf(student: Any, folder: Path) -> dict:
    """Write ``student`` as a transformers checkpoint in ``folder`` with ``mh.pretrained.to_hf`` where its
    family allows (LLaMA / Mistral / Qwen2 after GQA, DeepSeek-V3 after MLA), load it back with plain
    transformers and compare logits; else say why not (what to_hf refuses, or transformers missing)."""
    import torch

    from ..pretrained import to_hf

    try:
        hf_model: Any = to_hf(student)
    except (ValueError, ImportError) as e:
        return {"written": False, "why": str(e)}
    from transformers import AutoModelForCausalLM

    with atomic_folder(folder) as tmp:
        hf_model.save_pretrained(tmp)
    back = AutoModelForCausalLM.from_pretrained(folder, dtype=hf_model.dtype).eval()
    ids = torch.arange(1, 17).remainder(student.vocab_size)[None]  # (1, 16)
    with torch.no_grad():
        diff = (back(ids).logits - student(ids)).abs().max()
    return {"written": True, "dir": str(folder), "max_abs_diff": float(diff)}


def register_convert(sub: argparse._SubParsersAction) -> None:
    """Add ``heads convert`` (reached as ``multihead heads convert ...``; see cli/main.py)."""
    from ..heads.mla import ROPE_SELECT
    from ..pretrained import PRESETS
    from .args import positive_int

    p = sub.add_parser(
        "heads-convert",
        prog="multihead heads convert",
        hidden=True,  # reached as `heads convert` (cli/main.py): neither listed nor suggested
        description="Shrink a model's KV cache by head surgery - GQA (aligned merge), MLA (activation-aware "
        "joint SVD of keys and values; partial RoPE on rotary models) or importance pruning - "
        "optionally recover by distillation (mh.heads.recover) on standard-library docstrings, and save a "
        "safetensors checkpoint (model.safetensors + surgery.json) that mh.pretrained.load(DIR) and the "
        "--model DIR of eval, encode and generate load back; an LM also as a transformers checkpoint in "
        "OUT/hf/ where its family holds it (LLaMA family after GQA or even pruning, DeepSeek-V3 after MLA). "
        "A surgery that changes nothing exits with status 2 unless --allow-unchanged. The model is the "
        "bundled all-MiniLM-L6-v2, or a LLaMA / Mistral / Qwen2 save_pretrained directory (--hf DIR; its "
        "tokenizer.json when present, else the texts' bytes) or a random-weight preset (--preset NAME).",
    )
    p.add_argument("--to", choices=("gqa", "mla", "prune"), default="mla", help="the surgery (default mla)")
    p.add_argument("--hf", metavar="DIR", default=None, help="a LLaMA-family save_pretrained directory")
    p.add_argument("--preset", choices=list(PRESETS), default=None, help="a random-weight LM preset")
    p.add_argument("--kv-heads", type=positive_int, default=2, help="GQA kv heads per layer (default 2)")
    p.add_argument("--kv-rank", type=positive_int, default=128, help="MLA latent width (default 128)")
    p.add_argument(
        "--rope-dims", type=positive_int, default=None,
        help="rotary models: rotary dims kept per head, even (default head dim / 4)",
    )  # fmt: skip
    p.add_argument(
        "--rope-select", choices=ROPE_SELECT, default="disjoint",
        help="rotary models: which frequency pairs each kv head keeps (default disjoint: the strongest "
        "by norm, each pair in one kv head, so that OUT/hf/ holds it as a DeepSeek-V3 checkpoint)",
    )  # fmt: skip
    p.add_argument("--fraction", type=_fraction, default=1 / 3, help="heads pruned (default 1/3)")
    p.add_argument(
        "--recover-minutes", type=minutes, default=0.0,
        help="distillation wall time in minutes, 0 to a week (default 0)",
    )  # fmt: skip
    p.add_argument("--recover-steps", type=positive_int, default=None, help="or a number of steps")
    p.add_argument("--texts", type=positive_int, default=1000, help="docstrings for calibration/recovery")
    p.add_argument(
        "--out", default="multihead-converted", help="output folder (default multihead-converted/)"
    )
    p.add_argument(
        "--allow-unchanged", action="store_true",
        help="save even when the surgery changes nothing or does not shrink the KV cache (else exit 2)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=convert)
    threads_option(p)

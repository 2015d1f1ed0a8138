"""The ``--model`` of the commands: a saved sentence encoder or language model, including the folders
``multihead heads convert`` writes (surgery.json + model.safetensors), read by ``mh.pretrained.load``;
for the language-model commands also ``smollm2`` (the packaged SmolLM2-135M-Instruct) or a .gguf file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["ENCODER_DIR", "LM_MODEL", "load_encoder", "load_lm"]

#: what ``--model`` of ``generate`` and ``chat`` takes
LM_MODEL = (
    "smollm2 (the packaged SmolLM2-135M-Instruct), a .gguf file, or a save_pretrained() / `heads convert` "
    "folder"
)

#: what ``--model`` of ``encode`` and ``eval`` takes
ENCODER_DIR = (
    "a SentenceEncoder folder (config.json, tokenizer.json, ...) or a `heads convert` folder of MiniLM"
)


def load_encoder(path: str) -> Any:
    """The SentenceEncoder in ``path`` (given as ``--model``): a sentence-transformers directory
    (config.json, tokenizer.json, ...) or a converted MiniLM (surgery.json).

    Raises:
        ValueError: a path that does not exist or is a file, a folder with neither, or one that holds a
            language model (the message names it and what --model takes).
    """
    from ..pretrained import SentenceEncoder, load
    from .console import check_input_dir

    folder = check_input_dir(path, "--model", ENCODER_DIR)
    if not (folder / "surgery.json").is_file():
        if folder.is_dir() and not (folder / "config.json").is_file():
            load(folder)  # raises: names the folder and what it holds
        return SentenceEncoder.from_dir(folder)
    model = load(folder)
    if not isinstance(model, SentenceEncoder):
        raise ValueError(
            f"{path!r} holds a converted {type(model).__name__} (a language model), not a sentence encoder; "
            "use multihead generate --model for it"
        )
    return model


def load_lm(spec: str) -> tuple[Any, Any, str]:
    """``(TransformerLM, tokenizer or None, description)`` for ``--model spec``: ``smollm2``, a .gguf file
    (:func:`multihead.pretrained.from_gguf`, with its tokenizer) or a folder (its tokenizer.json when it
    has one; a folder named smollm2 is ``./smollm2``).

    Raises:
        ImportError: ``smollm2`` or a .gguf file without the packages they need (says what to install).
        ValueError: a path that does not exist, a file that is not .gguf, a folder holding an encoder,
            and what the loaders raise.
    """
    from .. import pretrained
    from ..models.lm import TransformerLM
    from .console import check_input_dir

    if spec == "smollm2":
        model = pretrained.smollm2()
        return model, model.tokenizer, "SmolLM2-135M-Instruct"
    p = Path(spec)
    if p.is_file() or p.suffix.lower() == ".gguf":
        if not p.exists():
            raise ValueError(f"--model {spec!r} does not exist; give {LM_MODEL}")
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"--model {spec!r} is a file, not a folder or a .gguf file; give {LM_MODEL}")
        model = pretrained.from_gguf(p, dequantize=True)  # fp32 for now: serve's engine reads embed.weight
        return model, model.tokenizer, p.name
    check_input_dir(spec, "--model", LM_MODEL)
    loaded = pretrained.load(p)
    if not isinstance(loaded, TransformerLM):
        raise ValueError(
            f"{spec!r} holds an encoder ({type(loaded).__name__}), not a language model; use multihead encode"
        )
    tokenizer = None
    if (p / "tokenizer.json").is_file():
        from ..pretrained.files import read_tokenizer

        tokenizer = read_tokenizer(p / "tokenizer.json", root=p)
    return loaded, tokenizer, spec

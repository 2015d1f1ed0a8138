"""The ``--model DIR`` of the commands: a saved sentence encoder or language model, including the folders
``multihead heads convert`` writes (surgery.json + model.safetensors), read by ``mh.pretrained.load``."""

from __future__ import annotations

from typing import Any

__all__ = ["ENCODER_DIR", "load_encoder"]

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

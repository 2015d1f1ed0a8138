"""Save a model changed by head surgery and load it back: ``model.safetensors`` (its state dict) and
``surgery.json`` (the base model and the list of changes), from which :func:`load_converted` rebuilds the
structure on the base before loading the weights.

Bases in ``surgery.json``: ``"all-MiniLM-L6-v2"`` (the bundled sentence encoder), ``{"hf": DIR}`` (a
LLaMA-family ``save_pretrained`` directory, read by ``mh.pretrained.load``; it must still be there to
load) or ``{"preset": NAME}`` (``mh.pretrained.random_lm(NAME)``). Steps (applied in order):

    {"to": "prune", "heads": {"0": [1, 2], ...}}     heads removed per layer
    {"to": "gqa", "n_kv_heads": 2}                   kv heads per layer
    {"to": "mla", "kv_rank": 128}                     latent width per layer
    {"to": "mla", "kv_rank": 64, "rope_dims": 8, "rope_select": "norm"}      a rotary model (partial RoPE;
                                                      the kept pairs are buffers in the weights)
"""

from __future__ import annotations

import copy
import json
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from .. import rng
from ..models.lm import TransformerLM
from ..pretrained.files import atomic_write, read_json, read_safetensors, read_safetensors_metadata
from ..pretrained.sentence_encoder import SentenceEncoder, minilm
from .gqa import to_gqa
from .mla import to_mla
from .pruning import prune

__all__ = ["MINILM", "SURGERIES", "apply_surgery", "load_converted", "save_converted"]

#: The base of a converted MiniLM in surgery.json.
MINILM = "all-MiniLM-L6-v2"

_AGAIN = "convert the model again (`multihead heads convert` or mh.heads.save_converted)"

SURGERIES = ("prune", "gqa", "mla")


def apply_surgery(model: nn.Module, step: dict[str, Any], *, calibration: Any = None) -> nn.Module:
    """One step of ``surgery.json`` applied to a copy of ``model`` (GQA by mean-pooling when no
    calibration is given: the structure is what matters when weights are loaded afterwards).

    Raises:
        ValueError: an unknown step.
    """
    kind = step.get("to")
    if kind == "prune":
        return prune(copy.deepcopy(model), {int(k): list(v) for k, v in step["heads"].items()})
    if kind == "gqa":
        method = "mean" if calibration is None else "aligned"
        return to_gqa(copy.deepcopy(model), int(step["n_kv_heads"]), method, calibration=calibration)
    if kind == "mla":
        rope_select = str(step.get("rope_select", "norm"))
        return to_mla(
            model, int(step["kv_rank"]), step.get("rope_dims"), calibration, rope_select=rope_select
        )
    raise ValueError(f"unknown surgery step {step!r}; 'to' must be one of {list(SURGERIES)}")


def save_converted(
    model: nn.Module, steps: Sequence[dict[str, Any]], out: str | Path, *, base: str | dict[str, str] = MINILM
) -> Path:
    """Write ``model.safetensors`` and ``surgery.json`` into ``out`` (created); return the folder.

    ``base``: what the steps were applied to (see the module docstring); a ``{"hf": DIR}`` is stored
    as an absolute path. Each file is written to a temporary in ``out`` and renamed over the old one
    once complete (the weights first); both carry the same random ``weights_id``, so
    :func:`load_converted` refuses a pair from two different saves, and an interrupted save (an error,
    Ctrl-C, SIGTERM) leaves the previous pair and no temporary.
    """
    from safetensors.torch import save_file

    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    # a copy of each tensor: tied weights (embedding = head) would share memory, which safetensors refuses
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    if isinstance(base, dict) and "hf" in base:
        base = {"hf": str(Path(base["hf"]).resolve())}
    pair = secrets.token_hex(8)
    meta = {"base": base, "steps": list(steps), "weights_id": pair}
    with atomic_write(folder / "surgery.json") as tmp_meta, atomic_write(folder / "model.safetensors") as tmp:
        save_file(state, str(tmp), metadata={"weights_id": pair})
        tmp_meta.write_text(json.dumps(meta, indent=2), encoding="utf-8")
    return folder  # the weights were renamed into place first (inner block), then surgery.json


def _base_model(base: Any, where: str) -> nn.Module:
    """The model a surgery.json's ``base`` names.

    Raises:
        ValueError: a base that is none of the three kinds.
    """
    from ..pretrained.loading import load_hf_dir, random_lm

    if base == MINILM:
        return minilm()
    if isinstance(base, dict) and isinstance(base.get("hf"), str):
        return load_hf_dir(base["hf"])
    if isinstance(base, dict) and isinstance(base.get("preset"), str):
        return random_lm(base["preset"])
    raise ValueError(f"{where}: base {base!r} is not {MINILM!r}, {{'hf': DIR}} or {{'preset': NAME}}")


def _check_step(step: Any, i: int, where: str) -> None:
    """One surgery.json step: an object with a known ``to`` and fields of the right types.

    Raises:
        ValueError: naming the file, the step and the field.
    """
    if not isinstance(step, dict) or step.get("to") not in SURGERIES:
        raise ValueError(
            f"{where}: step {i} is {step!r}, expected an object whose 'to' is one of {list(SURGERIES)}"
        )
    ints = {"gqa": ("n_kv_heads",), "mla": ("kv_rank",), "prune": ()}[step["to"]]
    for key in ints:
        if isinstance(step.get(key), bool) or not isinstance(step.get(key), int) or step[key] < 1:
            raise ValueError(
                f"{where}: step {i} ({step['to']}) needs {key!r} as an int >= 1, got {step.get(key)!r}"
            )
    rope = step.get("rope_dims")
    if (
        step["to"] == "mla"
        and rope is not None
        and (isinstance(rope, bool) or not isinstance(rope, int) or rope < 0)
    ):
        raise ValueError(f"{where}: step {i} (mla) has rope_dims {rope!r}, expected null or an int >= 0")
    heads = step.get("heads")
    if step["to"] == "prune" and not (
        isinstance(heads, dict)
        and all(
            k.isdigit() and isinstance(v, list) and all(type(h) is int for h in v) for k, v in heads.items()
        )
    ):
        raise ValueError(
            f"{where}: step {i} (prune) needs 'heads' as {{\"layer\": [head, ...]}}, got {heads!r}"
        )


def _rebuild(meta: dict[str, Any], steps: list[dict[str, Any]], where: str) -> nn.Module:
    """The structure ``surgery.json`` describes: its base with its steps applied (weights to be loaded)."""
    try:
        model = _base_model(meta.get("base", MINILM), where)
    except ValueError as e:  # an unknown preset, an unreadable base checkpoint: say whose base it is
        raise ValueError(
            e.args[0] if where in str(e) else f"{where}: its base cannot be built: {e}"
        ) from None
    try:
        for step in steps:
            model = apply_surgery(model, step)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{where}: step {step!r} cannot be applied to its base: {e}") from None
    return model


def load_converted(path: str | Path) -> SentenceEncoder | TransformerLM:
    """The model saved by :func:`save_converted` in ``path``: a SentenceEncoder (MiniLM base) or a
    TransformerLM (LLaMA-family base), in eval mode.

    Raises:
        ValueError: a folder without surgery.json / model.safetensors, a file that is truncated or not
            what it should be, an unknown base or step, a weights file from another save than the
            surgery.json, or weights that do not fit (the message names the file and the key).
    """
    folder = Path(path)
    meta_file, weights = folder / "surgery.json", folder / "model.safetensors"
    if not meta_file.is_file() or not weights.is_file():
        raise ValueError(
            f"{folder} must hold surgery.json and model.safetensors (written by `multihead heads convert` "
            "or mh.heads.save_converted)"
        )
    meta = read_json(meta_file, "surgery", fix=_AGAIN)
    where = f"surgery file {str(meta_file)!r}"
    steps = meta.get("steps")
    if not isinstance(steps, list):
        raise ValueError(f"{where} has no 'steps' list (got {steps!r}); convert the model again")
    for i, step in enumerate(steps):
        _check_step(step, i, where)
    pair = read_safetensors_metadata(weights, fix=_AGAIN).get("weights_id")
    if pair != meta.get("weights_id"):
        raise ValueError(
            f"{str(weights)!r} and {str(meta_file)!r} come from different saves (weights_id {pair!r} vs "
            f"{meta.get('weights_id')!r}): a save was interrupted or is running; save the model again"
        )
    with rng.private(0):  # the structure's first weights are replaced by the file's: the caller's generator
        model = _rebuild(meta, steps, where)  # is neither reset nor advanced
    sd = read_safetensors(weights, fix=_AGAIN)
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{str(weights)!r} does not fit the structure surgery.json describes: {e}") from None
    assert isinstance(model, (SentenceEncoder, TransformerLM))
    return model.eval()

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
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from .. import rng
from ..models.lm import TransformerLM
from ..pretrained.files import (
    atomic_folder,
    read_json,
    read_safetensors,
    read_safetensors_header,
    read_safetensors_metadata,
)
from ..pretrained.sentence_encoder import SentenceEncoder, minilm
from .gqa import to_gqa
from .mla import to_mla
from .pruning import prune

__all__ = ["MAX_STEPS", "MINILM", "SURGERIES", "apply_surgery", "load_converted", "save_converted"]

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


#: The most steps a surgery.json may list (`multihead heads convert` writes one; each costs a copy).
MAX_STEPS = 8
#: A converted weights file holds at least this fraction of its base's bytes: surgery changes only the
#: attention, and the embeddings and MLPs it leaves are most of a model.
MIN_KEPT_FRACTION = 0.25
#: The files a converted folder is made of (the tokenizer's copied from a Hugging Face base).
OWN_FILES = ("model.safetensors", "surgery.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "hf")  # fmt: skip


def save_converted(
    model: nn.Module,
    steps: Sequence[dict[str, Any]],
    out: str | Path,
    *,
    base: str | dict[str, str] = MINILM,
    files: Sequence[str | Path] = (),
) -> Path:
    """Write ``model.safetensors``, ``surgery.json`` and a copy of each of ``files`` into the folder
    ``out``; return it.

    The folder is written whole: the new files go into a temporary folder beside ``out``, which is
    then swapped with the old ``out`` in one step (:func:`~multihead.pretrained.files.atomic_folder`),
    so a reader finds the old pair or the new one, never the weights of one save with the surgery.json
    of another; an interrupted save (an error, Ctrl-C, SIGTERM) leaves the old folder as it was and no
    temporary. Both files also carry the same random ``weights_id``, which :func:`load_converted` checks.
    The old folder's files are replaced, its ``hf/`` copy among them (it described the old model).

    Args:
        model: the converted model.
        steps: the surgery steps applied (the module docstring lists them).
        out: the folder; created, or replaced when it holds only a converted model's files.
        base: what the steps were applied to (see the module docstring); a ``{"hf": DIR}`` is stored
            as an absolute path.
        files: files copied into the folder with the pair (a Hugging Face base's tokenizer files).

    Raises:
        ValueError: ``out`` is a file, its parent folder cannot be made, or it holds files that are not
            a converted model's (they would be lost; the message names them).
    """
    from safetensors.torch import save_file

    folder = Path(out)
    _check_own_folder(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # a copy of each tensor: tied weights (embedding = head) would share memory, which safetensors refuses
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    if isinstance(base, dict) and "hf" in base:
        base = {"hf": str(Path(base["hf"]).resolve())}
    pair = secrets.token_hex(8)
    meta = {"base": base, "steps": list(steps), "weights_id": pair}
    if isinstance(model, TransformerLM):  # the shape the rebuilt model must have (checked on load)
        meta["config"] = model.config.to_dict()
    with atomic_folder(folder) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"weights_id": pair})
        (tmp / "surgery.json").write_text(json.dumps(meta, indent=2), encoding="utf-8")
        for f in files:
            shutil.copyfile(f, tmp / Path(f).name)
    return folder


def _check_own_folder(folder: Path) -> None:
    """Refuse to replace a folder that holds more than a converted model's files.

    Raises:
        ValueError: naming the folder and the files that would be lost.
    """
    if not folder.is_dir():
        return
    foreign = sorted(p.name for p in folder.iterdir() if p.name not in OWN_FILES and not _leftover(p.name))
    if foreign:
        raise ValueError(
            f"cannot save a converted model into {str(folder)!r}: it holds {foreign[:8]}, which are not a "
            "converted model's files and would be replaced with the folder; give a new or empty folder"
        )


def _leftover(name: str) -> bool:
    """A hidden temporary of an earlier write that was killed (``.<name>.tmp-<hex>``)."""
    return name.startswith(".") and (".tmp-" in name or ".old-" in name)


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


def _base_bytes(base: Any) -> int | None:
    """The bytes of weights the base named in surgery.json holds, found without building it (None for
    the bundled MiniLM, whose size is fixed, and for a base that is not understood: building it says why).
    """
    from ..pretrained.llama import PRESETS, llama_kwargs
    from ..pretrained.reading import checkpoint_files, shapes_only

    if isinstance(base, dict) and isinstance(base.get("preset"), str) and base["preset"] in PRESETS:
        with shapes_only():  # on the meta device: sizes, no memory
            skeleton = TransformerLM(**llama_kwargs(PRESETS[base["preset"]]))
        return sum(t.numel() * t.element_size() for t in skeleton.state_dict().values())
    if isinstance(base, dict) and isinstance(base.get("hf"), str) and Path(base["hf"]).is_dir():
        return sum(f.stat().st_size for f in checkpoint_files(Path(base["hf"])))
    return None


def _check_base_size(base: Any, weights: Path, where: str) -> None:
    """Refuse a base far larger than the converted weights before it is built: surgery changes only the
    attention, so a converted model keeps at least :data:`MIN_KEPT_FRACTION` of its base's bytes.

    Raises:
        ValueError: naming the surgery file, its base, both sizes and the fix.
    """
    need, have = _base_bytes(base), weights.stat().st_size
    if need is not None and have < MIN_KEPT_FRACTION * need:
        raise ValueError(
            f"{where}: its base {base!r} holds {need} bytes of weights, but {str(weights)!r} holds {have}: "
            f"a converted model keeps at least {MIN_KEPT_FRACTION:.0%} of its base (the embeddings and "
            f"MLPs), so the weights and the base do not belong together; {_AGAIN}"
        )


def _check_fits(model: nn.Module, header: dict[str, tuple[Any, tuple[int, ...]]], weights: Path) -> None:
    """Compare the rebuilt structure with the weights file's header before the weights are read: the
    same names and shapes, and floating-point tensors exactly where the model has them (an int32
    weight would otherwise be cast to float silently by ``load_state_dict``).

    Raises:
        ValueError: naming the weights file and the first tensors that differ.
    """
    own = model.state_dict()
    missing, extra = sorted(set(own) - set(header)), sorted(set(header) - set(own))
    wrong = [f"{k}: file {header[k][1]} vs model {tuple(own[k].shape)}"
             for k in own if k in header and header[k][1] != tuple(own[k].shape)]  # fmt: skip
    kinds = [f"{k}: file {header[k][0]} vs model {t.dtype}" for k, t in own.items()
             if k in header and header[k][0].is_floating_point != t.is_floating_point()]  # fmt: skip
    if missing or extra or wrong or kinds:
        raise ValueError(
            f"{str(weights)!r} does not fit the structure surgery.json describes: missing {missing[:5]}, "
            f"unexpected {extra[:5]}, wrong shapes {wrong[:5]}, wrong dtypes {kinds[:5]}; {_AGAIN}"
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
        raise ValueError(f"{where} has no 'steps' list (got {type(steps).__name__}); convert the model again")
    if len(steps) > MAX_STEPS:
        raise ValueError(
            f"{where}: 'steps' lists {len(steps)} surgery steps, more than the {MAX_STEPS} a converted model "
            f"is rebuilt from (each step copies the model); {_AGAIN}"
        )
    for i, step in enumerate(steps):
        _check_step(step, i, where)
    header = read_safetensors_header(weights, fix=_AGAIN)
    _check_base_size(meta.get("base", MINILM), weights, where)
    pair = read_safetensors_metadata(weights, fix=_AGAIN).get("weights_id")
    if pair != meta.get("weights_id"):
        raise ValueError(
            f"{str(weights)!r} and {str(meta_file)!r} come from different saves (weights_id {pair!r} vs "
            f"{meta.get('weights_id')!r}): a save was interrupted or is running; save the model again"
        )
    with rng.private(0):  # the structure's first weights are replaced by the file's: the caller's generator
        model = _rebuild(meta, steps, where)  # is neither reset nor advanced
    stored = meta.get("config")
    if isinstance(model, TransformerLM) and stored is not None and stored != model.config.to_dict():
        raise ValueError(
            f"{where} records the config {stored} but its base and steps rebuild {model.config.to_dict()}: "
            f"the base changed since the save; {_AGAIN}"
        )
    _check_fits(model, header, weights)
    sd = read_safetensors(weights, fix=_AGAIN)
    try:
        model.load_state_dict(sd, strict=True)
    except RuntimeError as e:
        raise ValueError(f"{str(weights)!r} does not fit the structure surgery.json describes: {e}") from None
    assert isinstance(model, (SentenceEncoder, TransformerLM))
    return model.eval()

"""A ``save_pretrained`` directory read so that a bad file costs no more than its own size.

    config.json -> check_config (types, ranges, divisibility; errors name the file and the field)
    model.safetensors / shards -> headers only (names, dtypes, shapes; shard names confined to the folder)
    -> layer count of the config vs the checkpoint's (a config of 2000 layers for a 2-layer file fails here)
    -> the model built on the ``meta`` device and matched against the header shapes (no memory)
    -> only then the weights are read and the real model built

So a config that does not describe its weights (``vocab_size`` 6,000,000 for a 1.7 MB file, a missing
``k_proj``) fails with a ValueError naming the file before anything the size of the config is allocated.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor, nn

from .config_checks import check_config, unify_dtypes
from .files import read_json, read_safetensors, read_safetensors_header, shard_path

_RESAVE = "re-save them with model.save_pretrained(DIR) or download the checkpoint again"

__all__ = [
    "check_layer_count",
    "checkpoint_files",
    "convert_checked",
    "dry_run",
    "load_checked",
    "read_config",
    "shapes_only",
    "uninitialised",
]

M = TypeVar("M")

#: A layer index in a checkpoint key: LLaMA / BERT ``layers.3.`` / ``layer.3.``, GPT-2 ``h.3.``.
_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h)\.(\d+)\.")
#: Config fields that give the number of layers.
_LAYER_FIELDS = ("num_hidden_layers", "n_layer")


def read_config(root: Path) -> dict[str, Any]:
    """The checked config.json of the checkpoint directory ``root``.

    Raises:
        ValueError: no config.json, a file that is not a JSON object, a field of the wrong type or range
            (naming the file and the field).
    """
    if not (root / "config.json").exists() and not (root / "config.json").is_symlink():
        raise ValueError(
            f"{str(root)!r} is not a Hugging Face checkpoint directory: no config.json in it; "
            "save one with model.save_pretrained(DIR)"
        )
    config = read_json(root / "config.json", root=root)
    check_config(config, f"config file {str(root / 'config.json')!r}")
    return config


def checkpoint_files(root: Path) -> list[Path]:
    """The safetensors files of ``root``: ``model.safetensors``, or the shards its index names.

    Raises:
        ValueError: no weights, an index without a ``weight_map`` object, a shard named outside ``root``.
    """
    index = root / "model.safetensors.index.json"
    if (root / "model.safetensors").is_file() or (root / "model.safetensors").is_symlink():
        return [root / "model.safetensors"]  # a link is checked by the readers (files.confined)
    if index.is_file() or index.is_symlink():
        weight_map = read_json(index, "sharded index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            shown = "empty" if weight_map == {} else f"{type(weight_map).__name__}, not an object"
            raise ValueError(
                f"sharded index {str(index)!r}: its weight_map is {shown}; it must name the shard of "
                "every tensor (re-save the checkpoint)"
            )
        names = {shard_path(root, name, index) for name in weight_map.values()}
        return sorted(names)
    raise ValueError(
        f"{str(root)!r} has no model.safetensors (nor a sharded index); save the weights with "
        "model.save_pretrained(DIR, safe_serialization=True)"
    )


def header_state(files: list[Path], root: Path | None = None) -> dict[str, Tensor]:
    """Every tensor the files hold, as an empty ``meta`` tensor of its dtype and shape (headers only).

    Raises:
        ValueError: what :func:`~.files.read_safetensors_header` raises; files that hold no tensor.
    """
    out: dict[str, Tensor] = {}
    for f in files:
        for name, (dtype, shape) in read_safetensors_header(f, root=root).items():
            out[name] = torch.empty(shape, dtype=dtype, device="meta")
    if not out:
        names = ", ".join(repr(str(f)) for f in files[:3])
        raise ValueError(f"the weights files {names} hold no tensors; {_RESAVE}")
    return out


def check_layer_count(
    config: Mapping[str, Any], keys: list[str], where: str, source: str = "config.json"
) -> None:
    """Refuse a config that asks for more layers than the checkpoint's keys hold (before any build).

    Raises:
        ValueError: naming ``where``, both counts and the fix.
    """
    held = {int(m[1]) for k in keys for m in [_LAYER.search(k)] if m is not None}
    for field in _LAYER_FIELDS:
        want = config.get(field)
        if isinstance(want, int) and held and want > len(held):
            raise ValueError(
                f"{where}: {source} says {field}={want} but the weights hold {len(held)} layers "
                f"(indices {min(held)}..{max(held)}); config and weights do not belong together"
            )


_INITS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
          "trunc_normal_", "zeros_", "ones_", "constant_")  # fmt: skip
_INIT_LOCK = threading.Lock()


@contextmanager
def shapes_only() -> Iterator[None]:
    """Build modules on the ``meta`` device with ``torch.nn.init``'s initialisers skipped: shapes only, no
    memory, and fast (initialising a meta tensor runs Python reference code). Weights are loaded after.
    """
    with uninitialised(), torch.device("meta"):
        yield


@contextmanager
def uninitialised() -> Iterator[None]:
    """Build modules with ``torch.nn.init``'s initialisers skipped: for a model whose every weight is
    loaded right after (a random initialisation of 100M weights takes about a second).

    The initialisers are swapped in ``torch.nn.init`` while the block runs (as transformers does when it
    loads a model); the stand-ins skip only in the thread that entered, so a module built meanwhile in
    another thread is initialised as usual.
    """
    owner = threading.get_ident()

    def stand_in(original: Callable[..., Tensor]) -> Callable[..., Tensor]:
        def maybe_skip(t: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            return t if threading.get_ident() == owner else original(t, *args, **kwargs)

        return maybe_skip

    with _INIT_LOCK:
        saved = {name: getattr(nn.init, name) for name in _INITS}
        try:
            for name, fn in saved.items():
                setattr(nn.init, name, stand_in(fn))
            yield
        finally:
            for name, fn in saved.items():
                setattr(nn.init, name, fn)


def dry_run(convert: Callable[[Mapping[str, Tensor], Any], Any], shapes: Mapping[str, Tensor], config: Any,
            where: str) -> None:  # fmt: skip
    """``convert`` on the ``meta`` device with tensors of the weights' shapes: a config that does not fit
    its weights (missing keys, wrong shapes, integer weights) fails here, before any allocation.

    Raises:
        ValueError: what ``convert`` raises, prefixed with ``where``; a tensor operation that fails on
            the shapes (weights that do not fit each other, e.g. a k_proj of another width than q_proj).
    """
    try:
        with shapes_only():
            convert(unify_dtypes(shapes, config, where, warn=False), config)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    except (RuntimeError, IndexError, KeyError, TypeError) as e:
        raise ValueError(f"{where}: the weights do not fit together or the config ({e!r})") from None


def convert_checked(
    convert: Callable[[Mapping[str, Tensor], Any], M], sd: Mapping[str, Tensor], config: Any, where: str
) -> M:
    """``convert(sd, config)`` after a :func:`dry_run` on tensors of the same shapes; mixed float dtypes
    are cast to one, with a warning (:func:`~.config_checks.unify_dtypes`).

    Raises:
        ValueError: what ``convert`` raises, prefixed with ``where``.
    """
    dry_run(convert, {k: t.to("meta") for k, t in sd.items()}, config, where)
    return convert(unify_dtypes(sd, config, where), config)


def _describe(root: Path, files: list[Path]) -> str:
    names = ", ".join(f.name for f in files[:3]) + (f" and {len(files) - 3} more" if len(files) > 3 else "")
    return f"checkpoint {str(root)!r} (config.json with {names})"


def load_checked(path: str | Path, convert: Callable[[Mapping[str, Tensor], Any], M]) -> M:
    """``convert`` applied to the checkpoint directory ``path``, every size checked before allocation
    (the steps of the module docstring).

    Raises:
        ValueError: what :func:`read_config`, :func:`checkpoint_files` and ``convert`` raise, naming the
            checkpoint.
    """
    root = Path(path)
    config = read_config(root)
    files = checkpoint_files(root)
    where = _describe(root, files)
    shapes = header_state(files, root)
    check_layer_count(config, list(shapes), where)
    dry_run(convert, shapes, config, where)
    sd: dict[str, Tensor] = {}
    for f in files:
        sd.update(read_safetensors(f, root=root))
    return convert(unify_dtypes(sd, config, where), config)

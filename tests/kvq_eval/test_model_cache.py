"""The float32 model copy is written whole or not at all (``kvq_eval.models._save_copy``)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
from kvq_eval.models import _save_copy  # noqa: E402


class _Saver:
    """Stands in for a model or tokenizer: writes its files, optionally failing half-way."""

    def __init__(self, tag: str, fail: bool = False):
        self.tag, self.fail = tag, fail

    def save_pretrained(self, folder):
        (folder / "model.safetensors").write_text(self.tag)
        if self.fail:
            raise OSError("disk full")
        (folder / "config.json").write_text(json.dumps({"tag": self.tag}))


def _leftovers(parent, name):
    return [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


def test_copy_appears_whole(tmp_path):
    folder = tmp_path / "m-fp32"
    _save_copy(folder, _Saver("a"), _Saver("a"))
    assert json.loads((folder / "config.json").read_text()) == {"tag": "a"}
    assert _leftovers(tmp_path, "m-fp32") == []


def test_first_copy_wins(tmp_path):
    folder = tmp_path / "m-fp32"
    _save_copy(folder, _Saver("first"), _Saver("first"))
    _save_copy(folder, _Saver("second"), _Saver("second"))  # a process that built it side by side
    assert (folder / "model.safetensors").read_text() == "first"
    assert _leftovers(tmp_path, "m-fp32") == []


def test_a_failed_save_leaves_nothing(tmp_path):
    folder = tmp_path / "m-fp32"
    with pytest.raises(OSError, match="disk full"):
        _save_copy(folder, _Saver("a", fail=True), _Saver("a"))
    assert not folder.exists() and _leftovers(tmp_path, "m-fp32") == []


def test_a_half_written_folder_is_replaced(tmp_path):
    folder = tmp_path / "m-fp32"
    folder.mkdir()
    (folder / "model.safetensors").write_text("torn")  # an older, killed in-place save: no config.json
    _save_copy(folder, _Saver("b"), _Saver("b"))
    assert (folder / "model.safetensors").read_text() == "b" and (folder / "config.json").is_file()


def test_no_stale_folder_is_left_aside(tmp_path):
    folder = tmp_path / "m-fp32"
    folder.mkdir()
    _save_copy(folder, _Saver("c"), _Saver("c"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m-fp32"]

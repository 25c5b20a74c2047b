"""Atomic artifact folders: racing writers and readers, a writer killed at every step of the swap.

Regression tests of issue 16, findings 1 (two ``save_tables`` into one folder: a raw
FileNotFoundError and a folder that no longer loaded) and 2 (a kill between two renames left
neither the old nor the new set).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from codebooks import Gaussian, SphereMarginal, TableFileError, lloyd_max, load_tables, save_tables
from codebooks._atomic import aside_path, read_folder, write_folder
from codebooks.artifacts import holds_only
from codebooks.tables import HEADER, MANIFEST, TENSORS

CTX = multiprocessing.get_context("fork")
SET_A = [lloyd_max(Gaussian(1.0), 1), lloyd_max(SphereMarginal(8), 2)]
SET_B = [lloyd_max(Gaussian(1.0), 2), lloyd_max(SphereMarginal(16), 1), lloyd_max(Gaussian(0.5), 3)]
NAMES_A, NAMES_B = {cb.name for cb in SET_A}, {cb.name for cb in SET_B}
STEPS = ("locked", f"wrote {TENSORS}", f"wrote {HEADER}", f"wrote {MANIFEST}", "synced", "moved old aside",
         "swapped", "done")


def _files(folder: Path) -> dict[str, bytes]:
    return {n: (folder / n).read_bytes() for n in (TENSORS, HEADER, MANIFEST)}


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}.")
                  and not p.name.endswith(".lock"))


def _writer(folder, rounds, offset, q):
    try:
        for i in range(rounds):
            save_tables(SET_A if (i + offset) % 2 else SET_B, folder)
        q.put(("ok", None))
    except BaseException as exc:  # report anything, the parent asserts
        q.put(("error", repr(exc)))


def _reader(folder, stop, q):
    seen, errors = set(), []
    while not stop.is_set():
        try:
            names = set(load_tables(folder))
            seen.add("A" if names == NAMES_A else "B" if names == NAMES_B else f"other {sorted(names)}")
        except BaseException as exc:
            errors.append(repr(exc))
    q.put((seen, errors[:3], len(errors)))


def test_racing_writers_and_readers_see_whole_sets(tmp_path):
    """3 writers (alternating two sets) and 2 readers on one folder: every load is set A or set B,
    every writer succeeds, and the folder loads afterwards with nothing left beside it."""
    folder = tmp_path / "tables"
    save_tables(SET_A, folder)
    q, stop = CTX.Queue(), CTX.Event()
    writers = [CTX.Process(target=_writer, args=(folder, 8, k, q)) for k in range(3)]
    readers = [CTX.Process(target=_reader, args=(folder, stop, q)) for _ in range(2)]
    for p in readers + writers:
        p.start()
    results = [q.get(timeout=300) for _ in writers]
    stop.set()
    reads = [q.get(timeout=300) for _ in readers]
    for p in readers + writers:
        p.join(timeout=60)
    assert results == [("ok", None)] * 3
    for seen, errors, n_errors in reads:
        assert n_errors == 0, errors
        assert seen <= {"A", "B"} and seen
    assert set(load_tables(folder)) in (NAMES_A, NAMES_B)
    assert _leftovers(folder) == []


def _killed_writer(folder, files, step):
    def hook(name):
        if name == step:
            os._exit(9)
    write_folder(folder, files, replaceable=lambda f: holds_only(f, files), _hook=hook)
    os._exit(0)


@pytest.mark.parametrize("step", STEPS)
def test_writer_killed_at_every_step_leaves_old_or_new(tmp_path, step):
    """A writer dying (os._exit) after each step: the folder loads as the old set up to and
    including the first rename, as the new set after the second; the next writer recovers."""
    new_files = _files(save_tables(SET_B, tmp_path / "scratch"))
    folder = tmp_path / "tables"
    save_tables(SET_A, folder)
    p = CTX.Process(target=_killed_writer, args=(folder, new_files, step))
    p.start()
    p.join(timeout=120)
    assert p.exitcode == (0 if step == "never" else 9)
    expect = NAMES_B if STEPS.index(step) >= STEPS.index("swapped") else NAMES_A
    assert set(load_tables(folder)) == expect
    if step == "moved old aside":  # neither renamed back yet: the reader used the aside copy
        assert not folder.exists() and aside_path(folder).is_dir()
    save_tables(SET_B, folder)  # the next writer recovers whatever was left
    assert set(load_tables(folder)) == NAMES_B
    assert _leftovers(folder) == []


def _looping_writer(folder):
    i = 0
    while True:
        save_tables(SET_A if i % 2 else SET_B, folder)
        i += 1


@pytest.mark.parametrize("delay", [0.0, 0.003, 0.011, 0.02, 0.037, 0.06])
def test_sigkill_at_random_moments(tmp_path, delay):
    """SIGKILL a writer looping over two sets at several moments: the folder always loads whole."""
    folder = tmp_path / "tables"
    save_tables(SET_A, folder)
    p = CTX.Process(target=_looping_writer, args=(folder,))
    p.start()
    time.sleep(0.3 + delay)  # past the child's start-up, then at a varying point of a write
    os.kill(p.pid, signal.SIGKILL)
    p.join(timeout=60)
    assert set(load_tables(folder)) in (NAMES_A, NAMES_B)
    save_tables(SET_A, folder)
    assert set(load_tables(folder)) == NAMES_A and _leftovers(folder) == []


def test_writer_refuses_to_replace_foreign_folders(tmp_path):
    """A folder with other files (e.g. --out pointed at a home directory) is never swapped away."""
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds other files; refusing to replace it"):
        save_tables(SET_A, tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        save_tables(SET_A, target)
    save_tables(SET_A, tmp_path / "fresh")
    save_tables(SET_B, tmp_path / "fresh")  # its own set is replaced
    assert set(load_tables(tmp_path / "fresh")) == NAMES_B


def test_reader_reports_missing_folder_and_files(tmp_path):
    with pytest.raises(TableFileError, match="directory missing"):
        load_tables(tmp_path / "nope")
    folder = save_tables(SET_A, tmp_path / "t")
    (folder / HEADER).unlink()
    with pytest.raises(TableFileError, match=f"{HEADER}: file is missing"):
        load_tables(folder)
    with pytest.raises(ValueError, match="directory missing"):
        read_folder(tmp_path / "gone", lambda r: None)


def test_cleanup_never_touches_another_folders_temporary_files(tmp_path):
    """Issue 53: stale temporary folders were found with a glob of the folder name, so saving
    "t[1]" deleted the temporary folder of "t1" (being written by another process). Names are now
    compared as text, and only the exact .F.tmp-<pid>-<hex8> names of F count."""
    busy = [tmp_path / ".t1.tmp-4242-0123abcd", tmp_path / ".t.tmp-5.tmp-77-deadbeef", tmp_path / ".t[1].tmp-x"]
    for b in busy:
        b.mkdir()
        (b / "part").write_bytes(b"being written")
    mine = tmp_path / ".t[1].tmp-99-00ff00ff"  # a stale temporary folder of t[1] itself
    mine.mkdir()
    save_tables(SET_A, tmp_path / "t[1]")
    save_tables(SET_A, tmp_path / "t")
    assert all((b / "part").read_bytes() == b"being written" for b in busy)
    assert not mine.exists()
    assert load_tables(tmp_path / "t[1]").keys() == load_tables(tmp_path / "t").keys()


@pytest.mark.parametrize("plant", ["symlink-to-dir", "dangling-symlink", "file"])
def test_a_planted_aside_name_does_not_break_saves_or_redirect_reads(tmp_path, plant):
    """Issue 53: a planted .F.old symlink made every later save fail (rmtree refuses symlinks) and
    could send readers elsewhere. The writer removes the name (never what it points to); a reader
    does not follow it."""
    other = tmp_path / "other"
    save_tables(SET_B, other)
    before = _files(other)
    folder = tmp_path / "F"
    save_tables(SET_A, folder)
    aside = aside_path(folder)
    {"symlink-to-dir": lambda: aside.symlink_to(other), "dangling-symlink": lambda: aside.symlink_to(tmp_path / "nowhere"),
     "file": lambda: aside.write_bytes(b"x")}[plant]()
    save_tables(SET_B, folder)  # failed for every later save before
    save_tables(SET_A, folder)
    assert not os.path.lexists(aside) and len(load_tables(folder)) == len(SET_A)
    assert _files(other) == before
    # folder absent, the aside name planted: a reader refuses instead of reading the target
    os.rename(folder, tmp_path / "moved")
    aside.symlink_to(other)
    with pytest.raises(TableFileError, match="directory missing .*symbolic link"):
        load_tables(folder)

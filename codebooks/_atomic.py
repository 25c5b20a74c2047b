"""Atomic artifact folders: one writer protocol and one consistent reader for every folder we write.

Writer (``write_folder``), for a target folder ``P/F``:

1. take an exclusive ``flock`` on ``P/.F.lock`` (serialises writers; the kernel drops it if the
   writer dies, so a killed writer never blocks the next one);
2. recover what a killed writer left (below), remove stale ``P/.F.tmp-*`` folders;
3. write every file into a fresh ``P/.F.tmp-<pid>-<random>``, fsync each file and the folder;
4. ``rename(F, .F.old)`` (if F exists), ``rename(.F.tmp-..., F)``, fsync ``P``;
5. remove ``.F.old``, fsync ``P``, release the lock.

A directory cannot be renamed over a non-empty one on Linux, so step 4 is two renames. Between
them ``F`` is absent and ``.F.old`` holds the whole old set; readers then read ``.F.old``. A
killed writer leaves one of: nothing new (F intact, a stale tmp folder); F absent and ``.F.old``
complete (the next writer renames it back: roll back); F new and ``.F.old`` present (the next
writer deletes it: roll forward). In every state ``F`` or, failing that, ``.F.old`` is a whole set.

Reader (``read_folder``): opens the folder once (``O_DIRECTORY``) and reads every file relative
to that descriptor (``openat``), so all files come from one directory even if a writer swaps
``F`` meanwhile. If a file is absent and ``F`` no longer names the opened directory (a writer
swapped it and deleted the old one), the read restarts on the new folder; a file absent from a
folder that was not swapped is reported missing. Readers take no lock and write nothing, so they
work on read-only installs.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import shutil
import stat
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["write_folder", "write_file", "read_file", "read_folder", "FolderReader", "check_name", "aside_path",
           "check_output_folder", "check_output_file"]

#: Attempts of a reader racing writers before it reports the folder as missing.
_READ_ATTEMPTS = 200


def check_name(name) -> str:
    """A file name inside an artifact folder: a plain name, no separators, no ``.``/``..``."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or "\x00" in name or name.startswith(".") or len(name) > 255:
        raise ValueError(f"file name {name!r} is not a plain file name inside the folder")
    return name


def _paths(folder: Path) -> tuple[Path, Path, Path]:
    """(lock file, aside folder, tmp-folder prefix) of ``folder``."""
    parent, base = folder.parent, folder.name
    return parent / f".{base}.lock", parent / f".{base}.old", parent / f".{base}.tmp-"


def aside_path(folder) -> Path:
    """Where the old set waits during a swap (read when the folder itself is absent)."""
    return _paths(Path(folder))[1]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_tmp_of(name: str, folder: Path) -> bool:
    """``name`` is exactly one of this folder's temporary names ``.F.tmp-<pid>-<8 hex>`` (compared as
    text: a folder named ``t[1]`` must never match ``t1``'s, as a glob pattern would)."""
    prefix = _paths(folder)[2].name
    if not name.startswith(prefix):
        return False
    pid, _, token = name[len(prefix):].partition("-")
    return pid.isdigit() and len(token) == 8 and all(c in "0123456789abcdef" for c in token)


def _recover(folder: Path) -> None:
    """Undo or finish what a killed writer left (caller holds the lock)."""
    _, aside, _ = _paths(folder)
    if os.path.islink(aside) or (os.path.lexists(aside) and not aside.is_dir()):
        os.unlink(aside)  # never written by the protocol (a planted symlink or file): remove the name only
        _fsync_dir(folder.parent)
    elif aside.exists():
        if folder.exists():
            shutil.rmtree(aside)  # the new set is in place: finish the swap
        else:
            os.rename(aside, folder)  # killed between the two renames: roll back
        _fsync_dir(folder.parent)
    with os.scandir(folder.parent) as entries:
        stale = [Path(e.path) for e in entries if _is_tmp_of(e.name, folder)]
    for path in stale:
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)


def check_output_folder(folder, name: str = "--out", replaceable: Callable[[Path], bool] | None = None) -> Path:
    """Refuse, before any work, an output folder that cannot be written.

    The path must not be an existing non-directory, an existing directory holding anything but a
    set this writer may replace (``replaceable(folder)``; default: only an empty folder), and its
    nearest existing ancestor must be a writable directory. Returns the absolute path.
    """
    folder = Path(os.path.abspath(folder))
    if folder.exists() or folder.is_symlink():
        if not folder.is_dir():
            raise ValueError(f"{name} {folder}: exists and is not a directory")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(f"{name} {folder}: exists and is not writable")
        if any(folder.iterdir()) and not (replaceable and replaceable(folder)):
            raise ValueError(f"{name} {folder}: exists and holds other files; refusing to replace it "
                             "(give a new or empty folder, or one this command wrote)")
    _check_parent(folder, name)
    return folder


def _check_parent(path: Path, name: str) -> None:
    """The nearest existing ancestor of ``path`` must be a writable directory."""
    anc = path.parent
    while not anc.exists():
        anc = anc.parent
    if not anc.is_dir():
        raise ValueError(f"{name} {path}: {anc} is not a directory")
    if not os.access(anc, os.W_OK | os.X_OK):
        raise ValueError(f"{name} {path}: {anc} is not writable")


def check_output_file(path, name: str = "-o", suffixes: tuple[str, ...] = ()) -> Path:
    """Refuse, before any work, an output file path that cannot be written (see ``check_output_folder``)."""
    path = Path(os.path.abspath(path))
    if path.is_dir():
        raise ValueError(f"{name} {path}: is a directory; give a file path")
    if path.exists() and not path.is_file():
        raise ValueError(f"{name} {path}: exists and is not a regular file")
    if suffixes and path.suffix.lower() not in suffixes:
        raise ValueError(f"{name} {path}: must end in one of {', '.join(suffixes)}")
    _check_parent(path, name)
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{name} {path}: exists and is not writable")
    return path


def write_folder(folder, files: dict[str, bytes], replaceable: Callable[[Path], bool] | None = None,
                 _hook: Callable[[str], None] | None = None) -> Path:
    """Replace ``folder`` by a folder holding exactly ``files``, atomically (module docstring).

    Parameters
    ----------
    folder : str or Path
        Created with its parents if missing. An existing folder is replaced only if it is empty or
        ``replaceable(folder)`` says it is a set of the same kind (never a user's other files).
    files : dict of str -> bytes
        Plain file names (``check_name``) and their contents.
    replaceable : callable, optional
    _hook : callable, optional
        Called with the name of each step (tests kill the writer there).

    Returns
    -------
    Path
        The folder (absolute, symlinks resolved).
    """
    for n in files:
        check_name(n)
    folder = Path(os.path.realpath(folder))
    folder.parent.mkdir(parents=True, exist_ok=True)
    lock_path, aside, tmp_prefix = _paths(folder)
    hook = _hook or (lambda step: None)
    lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        hook("locked")
        _recover(folder)
        check_output_folder(folder, "folder", replaceable)
        tmp = Path(f"{tmp_prefix}{os.getpid()}-{secrets.token_hex(4)}")
        tmp.mkdir()
        try:
            for n, data in files.items():
                _write_synced(tmp / n, data)
                hook(f"wrote {n}")
            _fsync_dir(tmp)
            hook("synced")
            had_old = folder.exists()
            if had_old:
                os.rename(folder, aside)
                hook("moved old aside")
            os.rename(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_dir(folder.parent)
        hook("swapped")
        if had_old:
            shutil.rmtree(aside)
            _fsync_dir(folder.parent)
        hook("done")
    finally:
        os.close(lock_fd)  # releases the flock
    return folder


def write_file(path, data: bytes) -> Path:
    """Replace one file atomically: a synced temporary file in the same folder, then ``rename``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        _write_synced(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def _read_fd(fd: int, path: Path, max_bytes: int) -> bytes:
    """All bytes of the regular file open as ``fd`` (at most ``max_bytes``), else ``ValueError`` naming ``path``."""
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise ValueError(f"{path}: is a directory, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: is not a regular file (a FIFO, socket or device)")
        if st.st_size > max_bytes:
            raise ValueError(f"{path}: is {st.st_size} bytes, more than the {max_bytes} allowed")
        # one buffer of the file's size, filled in place (no chunk list joined into a second copy)
        buf = bytearray(st.st_size)
        view, got = memoryview(buf), 0
        while got < st.st_size:
            n = os.readv(fd, [view[got:]])
            if n == 0:
                break
            got += n
        view.release()
        if os.read(fd, 1):
            raise ValueError(f"{path}: grew past its size while being read")
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror})") from None
    if got < st.st_size:
        raise ValueError(f"{path}: shrank while being read ({got} of {st.st_size} bytes)")
    return bytes(buf) if got < (1 << 20) else buf


class _Swapped(Exception):
    """The folder was replaced by a writer during the read: start again."""


class FolderReader:
    """Reads the files of one opened directory (all from the same directory inode).

    ``read(name, max_bytes)`` returns the bytes of a regular file; ``OSError``-free: problems
    raise ``ValueError`` naming the file (absent, not a regular file, too large, unreadable).
    """

    def __init__(self, folder: Path, fd: int, main: Path):
        self.folder, self._fd, self.main = folder, fd, main

    def _swapped(self) -> bool:
        if self.folder != self.main and os.path.lexists(self.main):
            return True  # read the aside copy mid-swap; the new set is in place now
        mine = os.fstat(self._fd)
        try:
            now = os.stat(self.folder)
        except FileNotFoundError:
            return True
        return mine.st_nlink == 0 or (mine.st_ino, mine.st_dev) != (now.st_ino, now.st_dev)

    def read(self, name: str, max_bytes: int) -> bytes:
        check_name(name)
        path = self.folder / name
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW, dir_fd=self._fd)
        except FileNotFoundError:
            if self._swapped():
                raise _Swapped() from None
            raise ValueError(f"{path}: file is missing") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ValueError(f"{path}: is a symbolic link, not a file written by this toolkit") from None
            raise ValueError(f"{path}: cannot be opened ({exc.strerror})") from None
        try:
            return _read_fd(fd, path, max_bytes)
        finally:
            os.close(fd)


def _wait_for_writer(folder: Path) -> bool:
    """Block until no writer holds the folder's lock; False if no writer can be active (no lock file)."""
    lock_path = _paths(folder)[0]
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except OSError:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False  # nobody writes now: the absence is real
        except BlockingIOError:
            fcntl.flock(fd, fcntl.LOCK_SH)  # a writer is mid-swap: wait for it, then read again
            return True
    finally:
        os.close(fd)


def read_folder(folder, fn: Callable[[FolderReader], object]):
    """Call ``fn(reader)`` on a consistent view of ``folder`` (module docstring) and return its result.

    Raises
    ------
    ValueError
        The folder is missing or is not a directory (``fn``'s own errors pass through).
    """
    folder = Path(folder)
    aside = aside_path(folder)
    for _ in range(_READ_ATTEMPTS):
        fd, opened = None, None
        for cand in (folder, aside):
            try:  # the aside name is the protocol's own: never followed when it is a symlink
                fd = os.open(cand, os.O_RDONLY | os.O_DIRECTORY | (os.O_NOFOLLOW if cand is aside else 0))
                opened = cand
                break
            except FileNotFoundError:
                continue
            except NotADirectoryError:
                if cand is aside:  # O_NOFOLLOW on a symlink, or a file planted under that name
                    raise ValueError(f"{folder}: directory missing ({aside.name} is not a set this toolkit "
                                     "wrote: a symbolic link or a file)") from None
                raise ValueError(f"{folder}: is not a directory") from None
            except OSError as exc:
                if cand is aside and exc.errno == errno.ELOOP:
                    raise ValueError(f"{folder}: directory missing ({aside.name} is a symbolic link, not a set "
                                     "this toolkit wrote)") from None
                raise ValueError(f"{folder}: cannot be opened ({exc.strerror})") from None
        if fd is None:
            if not _wait_for_writer(folder) and not (os.path.lexists(folder) or os.path.lexists(aside)):
                raise ValueError(f"{folder}: directory missing")
            continue
        try:
            # reading the aside copy: the folder itself must still be absent (else start again)
            return fn(FolderReader(opened, fd, folder))
        except _Swapped:
            time.sleep(0.0005)
            continue
        finally:
            os.close(fd)
    raise ValueError(f"{folder}: kept changing while being read ({_READ_ATTEMPTS} attempts)")


def read_file(path, max_bytes: int) -> bytes:
    """Bytes of a regular file of at most ``max_bytes``; ``ValueError`` naming the file otherwise
    (missing, a directory, a FIFO/socket/device (never opened for blocking reads), too large)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ValueError(f"{path}: file not found") from None
    except OSError as exc:
        raise ValueError(f"{path}: cannot be opened ({exc.strerror})") from None
    try:
        return _read_fd(fd, path, max_bytes)
    finally:
        os.close(fd)

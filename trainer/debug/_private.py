"""Folders under a shared temporary directory that are really this user's (DESIGN 8).

``$TMPDIR`` (``/tmp``) is writable by every user, so a folder with a predictable name there
(``trainer-debug-UID``) may have been made first by someone else, with mode 0777 and links
planted inside. :func:`private_dir` makes such a folder with mode 0700, or accepts the one
already there only if ``lstat`` says it is a real directory (not a link), owned by this user
and writable by no one else; :func:`open_private` opens a file inside without following a
link. A folder or file that fails is refused with :class:`UnsafePathError`, whose one-line
message names it and says what to do.

Once a folder passes, no other user can put anything in it or rename it: in a sticky
``/tmp`` (the norm) only its owner may remove or replace it. A ``TMPDIR`` that is not sticky
and that others may write to is out of reach of any check: point ``TMPDIR`` at a folder of
your own there.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = [
    "UnsafePathError",
    "check_own_socket",
    "check_private_dir",
    "open_private",
    "private_dir",
]

#: The mode a private folder is made with; group and others may do nothing in it.
DIR_MODE = 0o700
#: The mode a private file is made with.
FILE_MODE = 0o600


class UnsafePathError(OSError):
    """A folder or file under a shared directory that another user may control: not a real
    directory (a link, a file), owned by someone else, or writable by group or others. Its
    message is one line naming the path and what to do."""


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0


def _refusal(path: Path, problem: str) -> UnsafePathError:
    return UnsafePathError(
        f"{path} {problem}: another user may have made or changed it; remove it (or set "
        "TMPDIR to a folder of your own) and start again"
    )


def _dir_problem(st: os.stat_result) -> str | None:
    """What makes a folder with ``lstat`` result ``st`` unsafe to use, or None."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link, not a folder"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != _uid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {_uid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by others (mode {stat.S_IMODE(st.st_mode):04o}; 0700 expected)"
    return None


def check_private_dir(path: Path) -> Path:
    """``path``, if it is a real directory owned by this user and writable by no one else;
    else :class:`UnsafePathError`. ``FileNotFoundError`` where it does not exist. Never
    follows a link, never creates or changes anything. Blocking."""
    problem = _dir_problem(os.lstat(path))
    if problem is not None:
        raise _refusal(path, problem)
    return path


def private_dir(path: Path) -> Path:
    """Make ``path`` a folder with mode 0700 (its parent must exist), or check the one there
    with :func:`check_private_dir`; returns ``path``. A folder that fails the check is left
    exactly as it is (nothing in it is read, removed or changed) and
    :class:`UnsafePathError` is raised. Blocking."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        pass
    return check_private_dir(path)


def open_private(path: Path, flags: int) -> int:
    """A file descriptor of ``path`` (in a folder that passed :func:`private_dir`), opened
    with ``flags`` plus ``O_NOFOLLOW`` (and mode 0600 where ``O_CREAT`` makes it). A link in
    its place is never followed, so never truncated or written through: it is refused with
    :class:`UnsafePathError`, as is anything but a regular file of this user with one name
    (a hard link). ``O_TRUNC`` truncates only after those checks. Blocking."""
    truncate = flags & os.O_TRUNC  # only once the file is known to be ours alone
    flags = (flags & ~os.O_TRUNC) | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags, FILE_MODE)
    except OSError as exc:
        if os.path.islink(path):
            raise _refusal(path, "is a symbolic link") from None
        raise exc
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != _uid() or st.st_nlink != 1:
        os.close(fd)
        raise _refusal(path, "is not a regular file of this user alone (a link?)")
    if truncate:
        os.ftruncate(fd, 0)
    return fd


def check_own_socket(path: Path) -> Path:
    """``path``, if it is a unix socket owned by this user in a folder that passes
    :func:`check_private_dir`; else :class:`UnsafePathError` (a socket someone else put
    there would be handed our requests). ``FileNotFoundError`` where it does not exist."""
    check_private_dir(path.parent)
    st = os.lstat(path)
    if not stat.S_ISSOCK(st.st_mode):
        raise _refusal(path, "is not a socket")
    if st.st_uid != _uid():
        raise _refusal(path, f"is owned by uid {st.st_uid}, not by this user (uid {_uid()})")
    return path

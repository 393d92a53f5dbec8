"""The debug folder under the shared ``$TMPDIR`` is the user's own or it is not used: a folder
another user made first (writable by others, a link, another owner) is refused in one line and
left as it is, a link planted inside is never followed, and ``debug dump`` never connects to a
socket it cannot trust."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainer.debug import (
    DEBUG_FILE,
    Dumper,
    UnsafePathError,
    debug_main,
    open_debug_services,
    private_dir,
    stack_signal,
)
from trainer.debug._server import debug_folder

IS_ROOT = hasattr(os, "getuid") and os.getuid() == 0
NOBODY = 65534


@pytest.fixture
def tmpdir_of_all(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A stand-in for ``/tmp``: ``$TMPDIR`` as the trainer reads it. Short, and not under
    pytest's ``tmp_path`` (whose test-named folders take a socket's path past the 108 bytes
    a unix socket's address may hold)."""
    shared = Path(tempfile.mkdtemp(prefix="dbg-", dir="/tmp" if Path("/tmp").is_dir() else None))
    shared.chmod(0o1777)
    monkeypatch.setattr(tempfile, "tempdir", str(shared))
    try:
        yield shared
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def _victim(tmp_path: Path) -> tuple[Path, tuple[bytes, int]]:
    """A file of this user's that a planted link points at, with its contents and mtime (set
    in the past, so any write would show)."""
    victim = tmp_path / "precious.txt"
    victim.write_bytes(b"do not truncate me\n")
    os.utime(victim, ns=(1_000_000_000_000_000_000, 1_000_000_000_000_000_000))
    return victim, (victim.read_bytes(), victim.stat().st_mtime_ns)


def _as_it_was(victim: Path) -> tuple[bytes, int]:
    return victim.read_bytes(), victim.stat().st_mtime_ns


def _planted(tmpdir_of_all: Path, mode: int) -> Path:
    folder = tmpdir_of_all / debug_folder().name
    folder.mkdir()
    folder.chmod(mode)
    return folder


async def _run_with_debug_services(run_dir: Path) -> None:
    async with open_debug_services(Dumper(run_dir)):
        pass


async def test_a_debug_folder_writable_by_others_is_refused_and_its_planted_links_never_followed(
    tmp_path, tmpdir_of_all, caplog
):
    folder = _planted(tmpdir_of_all, 0o777)
    victim, before = _victim(tmp_path)
    (folder / f"{os.getpid()}.stacks").symlink_to(victim)
    caplog.set_level(logging.WARNING, logger="trainer.debug")
    run_dir = tmp_path / "run"
    run_dir.mkdir()

    await _run_with_debug_services(run_dir)  # the run goes on, without its socket

    assert _as_it_was(victim) == before
    assert stat.S_IMODE(folder.stat().st_mode) == 0o777  # left exactly as it was
    assert sorted(p.name for p in folder.iterdir()) == [f"{os.getpid()}.stacks"]
    assert not (run_dir / DEBUG_FILE).exists()
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "\n" not in warning
    assert str(folder) in warning and "writable by others (mode 0777" in warning
    assert "without its debug socket" in warning
    with pytest.raises(UnsafePathError, match="writable by others"):
        with stack_signal(folder / f"{os.getpid()}.stacks"):
            pass
    assert _as_it_was(victim) == before


def test_a_debug_folder_that_is_a_link_is_refused_and_its_target_untouched(tmp_path, tmpdir_of_all):
    target = tmp_path / "mine"
    target.mkdir(mode=0o700)
    (tmpdir_of_all / debug_folder().name).symlink_to(target)
    with pytest.raises(UnsafePathError, match="is a symbolic link, not a folder"):
        with stack_signal(debug_folder() / "1.stacks"):
            pass
    assert list(target.iterdir()) == []


def test_a_stacks_file_planted_as_a_link_in_a_private_folder_is_refused_not_truncated(
    tmp_path, tmpdir_of_all
):
    folder = private_dir(debug_folder())
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    victim, before = _victim(tmp_path)
    stacks = folder / "123.stacks"
    stacks.symlink_to(victim)
    with pytest.raises(UnsafePathError, match=r"123\.stacks is a symbolic link"):
        with stack_signal(stacks):
            pass
    assert _as_it_was(victim) == before
    # a hard link, which O_NOFOLLOW cannot see, is refused before it is truncated
    stacks.unlink()
    os.link(victim, stacks)
    with pytest.raises(UnsafePathError, match="a link"):
        with stack_signal(stacks):
            pass
    assert _as_it_was(victim) == before


def test_a_private_folder_is_made_0700_and_one_already_right_is_taken_as_it_is(tmpdir_of_all):
    folder = private_dir(debug_folder())
    (folder / "kept").write_text("x")
    assert private_dir(folder) == folder and (folder / "kept").read_text() == "x"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    with stack_signal(folder / "1.stacks"):
        assert stat.S_IMODE((folder / "1.stacks").stat().st_mode) == 0o600


@pytest.mark.skipif(not IS_ROOT, reason="making a folder of another owner needs root")
def test_a_debug_folder_of_another_owner_is_refused_even_with_mode_0700(tmp_path, tmpdir_of_all):
    folder = _planted(tmpdir_of_all, 0o700)
    os.chown(folder, NOBODY, NOBODY)
    with pytest.raises(UnsafePathError, match=f"is owned by uid {NOBODY}, not by this user"):
        with stack_signal(folder / "1.stacks"):
            pass
    assert list(folder.iterdir()) == []


def _fake_socket(path: Path) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()
    server.setblocking(False)
    return server


def _never_connected(server: socket.socket) -> bool:
    try:
        server.accept()[0].close()
    except BlockingIOError:
        return True
    return False


def test_debug_dump_never_connects_to_a_socket_in_a_folder_others_may_write(tmpdir_of_all, capsys):
    folder = _planted(tmpdir_of_all, 0o777)
    with _fake_socket(folder / f"{os.getpid()}.sock") as server:
        status = debug_main(["dump", str(os.getpid()), "--timeout", "1"])
        assert _never_connected(server)
    assert status == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(folder) in err[0] and "writable by others" in err[0]


def test_debug_dump_by_run_dir_never_connects_to_a_socket_its_debug_json_points_elsewhere(
    tmp_path, tmpdir_of_all, capsys
):
    elsewhere = tmpdir_of_all / "elsewhere"
    elsewhere.mkdir()
    elsewhere.chmod(0o777)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with _fake_socket(elsewhere / "s.sock") as server:
        info = {"pid": os.getpid(), "socket": str(elsewhere / "s.sock"), "stacks": "x"}
        (run_dir / DEBUG_FILE).write_text(json.dumps(info))
        status = debug_main(["dump", str(run_dir), "--timeout", "1"])
        assert _never_connected(server)
    assert status == 1
    assert "writable by others" in capsys.readouterr().err


@pytest.mark.skipif(not IS_ROOT, reason="making a socket of another owner needs root")
def test_debug_dump_never_connects_to_a_socket_of_another_owner(tmpdir_of_all, capsys):
    folder = private_dir(debug_folder())
    sock = folder / f"{os.getpid()}.sock"
    with _fake_socket(sock) as server:
        os.chown(sock, NOBODY, NOBODY, follow_symlinks=False)
        status = debug_main(["dump", str(os.getpid()), "--timeout", "1"])
        assert _never_connected(server)
    assert status == 1
    assert f"is owned by uid {NOBODY}" in capsys.readouterr().err

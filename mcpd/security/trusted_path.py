"""Directories and files the daemon may trust: nobody but its user (or root) can change them.

A directory is the daemon's own when
- it is owned by the daemon's user and nobody else (group or others) may write to it;
- every directory on the way to it is owned by that user or root and writable by nobody else,
  unless it is sticky (like /tmp and /dev/shm: others may add entries there, but not rename or
  remove ours);
- every symlink on the way is owned by that user or root (in a sticky directory, whoever owns a
  link can repoint it).
That is OpenSSH's StrictModes rule. It is what makes the check race-free: once a path passes,
nobody else can change where it leads or what it holds, so the sockets, locks and journal the
daemon makes there afterwards are where it checked. A runtime dir planted in /tmp by another
user (with a `mcpd.lock` link to a file of root's, or a `control.ipc` of their own) is refused.

Files the daemon makes never follow a link (O_NOFOLLOW); one found in their place that is not a
regular file of the daemon's user, with one name, is refused rather than used.
"""
from __future__ import annotations

import errno
import os
import stat
from collections import deque
from pathlib import Path

from mcpd.refusal import StartRefused, UnsafePath

MAX_LINKS = 40          # as the kernel's own limit on links followed while resolving a path
PRIVATE_FILE_MODE = 0o600


def make_private_dir(path: Path, mode: int, what: str) -> None:
    """`path` as a directory of the daemon's own (see the module docstring); made with exactly
    `mode` if it is missing, left with the mode it has otherwise. `what` names it in messages,
    e.g. "runtime directory (server.runtime_dir)"."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)   # under the daemon's umask (0077): 0700
        os.mkdir(path, mode)
        os.chmod(path, mode)   # the umask may have taken bits the design needs (0711, say)
    except FileExistsError:
        pass
    except OSError as e:
        raise StartRefused(f"{what} {path}: cannot create it: {e.strerror}") from None
    check_private_dir(path, what)


def check_private_dir(path: Path, what: str) -> None:
    """Raise UnsafePath unless `path` is a directory of the daemon's own."""
    st = _walk(path, what, delegate=False)
    me = os.geteuid()
    if st.st_uid != me:
        raise UnsafePath(f"{what} {path} is owned by uid {st.st_uid}, not by mcpd's user (uid {me}): another "
                         f"user could plant links or sockets in it. Use a directory mcpd's user owns")
    _check_not_shared(st, what, path, "they could replace mcpd's sockets and files. Make it writable by its "
                                      "owner alone (chmod go-w)")


def check_placed_by_trusted_user(path: Path) -> None:
    """mcpctl's check of a runtime dir it is about to send ops to, which may belong to another
    user (the service's, say): nobody but its owner may write to it, and every directory on the
    way is root's or yours, or was handed to its owner in a directory of root's or yours that
    nobody else may add to. So /run/mcpd (made by root for the service) passes, and a directory
    another user planted in /tmp does not."""
    what = "runtime directory"
    _check_not_shared(_walk(path, what, delegate=True), what, path, "anyone could have bound its control socket")


def open_private_file(path: Path, flags: int) -> int:
    """os.open for a file of the daemon's own (created 0600 with O_CREAT), never through a link;
    raises UnsafePath for a link, a non-regular file, another user's file or a hard link."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, PRIVATE_FILE_MODE)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafePath(f"{path} is a symbolic link; mcpd never follows links for files it makes. "
                             f"Remove it") from None
        raise
    try:
        st = os.fstat(fd)
        problem = _not_private(st)
        if problem:
            raise UnsafePath(f"{path} {problem}; mcpd uses only regular files of its own there. Remove it")
        if stat.S_IMODE(st.st_mode) != PRIVATE_FILE_MODE:
            os.fchmod(fd, PRIVATE_FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _not_private(st: os.stat_result) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_uid != os.geteuid():
        return f"is owned by uid {st.st_uid}"
    if st.st_nlink != 1:
        return f"has {st.st_nlink} names (hard links)"
    return None


def _walk(path: Path, what: str, delegate: bool) -> os.stat_result:
    """Resolve `path` one name at a time, checking every directory a name is looked up in and
    every link on the way; returns the lstat of the directory it leads to. With `delegate`, a
    directory of another user is trusted (and so is that user, further down) when it sits in a
    trusted directory that is not sticky: only root or that directory's owner could have put it there."""
    trusted = {0, os.geteuid()}
    names = deque(Path(os.path.abspath(path)).parts[1:])
    current, links = Path("/"), 0
    while names:
        name = names.popleft()
        if name in ("", "."):
            continue
        if name == "..":
            current = current.parent
            continue
        holder = _check_container(current, trusted, what, path)
        candidate = current / name
        try:
            st = os.lstat(candidate)
        except FileNotFoundError:
            raise StartRefused(f"{what} {path}: {candidate} does not exist") from None
        if stat.S_ISLNK(st.st_mode):
            links += 1
            _check_link(candidate, st, links, trusted, what, path)
            target = Path(os.readlink(candidate))
            if target.is_absolute():
                current = Path("/")
            names.extendleft(reversed(target.parts[1:] if target.is_absolute() else target.parts))
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafePath(f"{what} {path}: {candidate} is not a directory")
        if delegate and st.st_uid not in trusted:
            if holder.st_mode & stat.S_ISVTX:
                raise UnsafePath(f"{what} {path}: {candidate} is owned by uid {st.st_uid}, not by you or root, "
                                 f"and sits in {current}, which anyone may add to: anyone could have made it. "
                                 f"Run as uid {st.st_uid}, or use a runtime directory outside such a directory")
            trusted.add(st.st_uid)
        current = candidate
    return os.lstat(current)


def _check_link(link: Path, st: os.stat_result, followed: int, trusted: set[int], what: str, path: Path) -> None:
    if st.st_uid not in trusted:
        raise UnsafePath(f"{what} {path}: the symbolic link {link} on the way to it is owned by uid "
                         f"{st.st_uid}, who could repoint it")
    if followed > MAX_LINKS:
        raise UnsafePath(f"{what} {path}: more than {MAX_LINKS} symbolic links on the way to it")


def _check_container(directory: Path, trusted: set[int], what: str, path: Path) -> os.stat_result:
    """A directory a name is looked up in: owned by root or us, and only sticky if others may write."""
    st = os.lstat(directory)
    if st.st_uid not in trusted:
        raise UnsafePath(f"{what} {path}: {directory} on the way to it is owned by uid {st.st_uid}, who could "
                         f"replace what is in it")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise UnsafePath(f"{what} {path}: {directory} on the way to it is writable by {_writers(st.st_mode)} "
                         f"(mode {_mode(st)}) and not sticky: they could replace what is in it")
    return st


def _check_not_shared(st: os.stat_result, what: str, path: Path, danger: str) -> None:
    if st.st_mode & 0o022:
        raise UnsafePath(f"{what} {path} is writable by {_writers(st.st_mode)} (mode {_mode(st)}): {danger}")


def _writers(mode: int) -> str:
    return " and ".join(who for who, bit in (("its group", 0o020), ("others", 0o002)) if mode & bit)


def _mode(st: os.stat_result) -> str:
    return f"{stat.S_IMODE(st.st_mode):04o}"

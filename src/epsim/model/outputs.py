"""Output files: checked before any work, written whole or not at all, all of a command together.

Glossary:
    target      the path a user named for an output (``--trace OUT``, ``--csv OUT``, ...). It
                may not exist yet; if it exists it must be a regular file (or a symlink to one,
                which is then written through): a directory, a device, a FIFO or a socket is
                refused, never replaced.
    staging     a target's content is held in memory until the command succeeds; then it is
                written to a temp file beside the target (same folder, so the final rename is
                atomic on that file system), named ``.NAME.PID.XXXX.part``. Reserving a target
                creates and removes such a file at once: the check that the folder is
                writable, done before the command's work starts. A temp file whose writer's
                process id no longer runs (killed while writing, which runs no clean-up) is
                removed the next time that target is reserved.
    output set  the targets of one command (:class:`OutputSet`). Writers stage into it; only
                when the command succeeds are the staged files written and renamed over their
                targets, all of them after every target was checked again; on any failure
                every temp file is removed and no target changes.
    mode        a new file gets ``0o666 & ~umask`` (what ``open(path, "w")`` gives); a file that
                is replaced keeps its mode.

The writers (:func:`write_text_atomic`, :func:`write_bytes_atomic`, :func:`staged_path`) stage
into the output set active in this context (``with OutputSet() as outs:``, as ``epsim``'s main
does around every command) when it holds the target, and otherwise write the one file
atomically on their own, with the same checks. So library callers get atomic single files and
the command line gets all-or-nothing sets, with no writer able to skip the checks.
"""

from __future__ import annotations

import contextlib
import contextvars
import glob
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import EpsimError

_ACTIVE: contextvars.ContextVar[OutputSet | None] = contextvars.ContextVar(
    "epsim_output_set", default=None)


def _kind_of(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def check_output_target(path: str | os.PathLike[str], what: str = "output") -> Path:
    """The real path ``path`` will be written at; an :class:`EpsimError` (one line) when it
    cannot be: an existing non-regular file, or a folder that does not exist.

    Example: ``check_output_target("/dev/full")`` raises ``cannot write /dev/full: it is a
    character device``.
    """
    given = Path(path)
    if str(path) == "":
        raise EpsimError(f"{what}: an empty path")
    if str(path).endswith(("/", os.sep)):  # a folder was meant, and Path() drops the slash
        raise EpsimError(f"cannot write {path}: a file path is needed, not a folder")
    real = Path(os.path.realpath(given))  # through symlinks: a link is written through
    try:
        st = os.stat(real)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise EpsimError(f"cannot write {given}: {exc.strerror}") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise EpsimError(f"cannot write {given}: it is {_kind_of(st.st_mode)}")
    if st is not None and not os.access(real, os.W_OK):  # as open(path, "w") would refuse it
        raise EpsimError(f"cannot write {given}: permission denied")
    if not real.parent.is_dir():
        raise EpsimError(f"cannot write {given}: folder {given.parent} does not exist")
    return real


def _new_file_mode(target: Path) -> int:
    try:
        return stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        mask = os.umask(0)
        os.umask(mask)
        return 0o666 & ~mask


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except OSError:  # another user's process: alive
        return True
    return True


def _temp_prefix(real: Path) -> str:
    return f".{real.name}.{os.getpid()}."


def _sweep_stale(real: Path) -> None:
    """Remove temp files of ``real`` left by an epsim process that no longer exists (killed
    while writing: SIGKILL runs no clean-up). Their names carry the writer's process id."""
    for tmp in real.parent.glob(f".{glob.escape(real.name)}.*.part"):
        pid = tmp.name[len(real.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _new_temp(given: Path, real: Path) -> Path:
    try:
        fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(real), suffix=".part", dir=real.parent)
    except OSError as exc:
        raise EpsimError(f"cannot write {given}: {exc.strerror}") from None
    os.close(fd)
    return Path(tmp)


class _Staged:
    """One target and its content, held in memory until the set commits: no temp file waits
    on disk while the command works, so a kill (SIGKILL runs no clean-up) leaves none."""

    def __init__(self, given: Path, real: Path) -> None:
        self.given, self.real = given, real
        _sweep_stale(real)
        _new_temp(given, real).unlink()  # the folder is writable: checked now, before work
        self.data: bytes | None = None
        self.tmp: Path | None = None  # on disk only while a writer fills it, or at commit

    def write_temp(self) -> None:
        """Commit's first phase: the content into a temp file beside the target."""
        self.tmp = _new_temp(self.given, self.real)
        try:
            self.tmp.write_bytes(self.data or b"")
            os.chmod(self.tmp, _new_file_mode(self.real))
        except OSError as exc:
            raise EpsimError(f"cannot write {self.given}: {exc.strerror}") from None

    def rename(self) -> None:
        """Commit's last phase (every target checked first)."""
        assert self.tmp is not None
        try:
            os.replace(self.tmp, self.real)
        except OSError as exc:
            raise EpsimError(f"cannot write {self.given}: {exc.strerror}") from None
        self.tmp = None

    def discard(self) -> None:
        if self.tmp is not None:
            self.tmp.unlink(missing_ok=True)
            self.tmp = None


class OutputSet:
    """The output files of one command, reserved before its work and renamed into place together
    on :meth:`commit`; leaving the ``with`` block without a commit discards them all.

    Example::

        with OutputSet() as outs:
            outs.reserve("run.csv", "--csv")      # checked and staged now
            ...                                   # the work
            write_text_atomic(text, "run.csv")    # staged, not yet visible
            outs.commit()                         # every target appears, or none
    """

    def __init__(self) -> None:
        self._staged: dict[Path, _Staged] = {}
        self._token: contextvars.Token[OutputSet | None] | None = None

    def __enter__(self) -> OutputSet:
        self._token = _ACTIVE.set(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.discard()
        if self._token is not None:
            _ACTIVE.reset(self._token)
            self._token = None

    def reserve(self, path: str | os.PathLike[str], what: str = "output") -> None:
        """Check ``path`` and stage a temp file for it (one line naming ``what`` if not)."""
        real = check_output_target(path, what)
        if real in self._staged:
            raise EpsimError(f"{what}: {path} is already an output of this command")
        self._staged[real] = _Staged(Path(path), real)

    def holds(self, path: str | os.PathLike[str]) -> bool:
        return Path(os.path.realpath(path)) in self._staged

    def put(self, path: str | os.PathLike[str], data: bytes) -> None:
        """Hold ``data`` as the content of a reserved ``path`` (written at :meth:`commit`)."""
        self._staged[Path(os.path.realpath(path))].data = data

    @contextlib.contextmanager
    def temp_for(self, path: str | os.PathLike[str]) -> Iterator[Path]:
        """A temp file beside a reserved ``path`` for a writer that needs a path (a plot's
        ``savefig``); read back into memory and removed when the block ends."""
        staged = self._staged[Path(os.path.realpath(path))]
        tmp = _new_temp(staged.given, staged.real)
        try:
            yield tmp
            staged.data = tmp.read_bytes()
        except OSError as exc:
            raise EpsimError(f"cannot write {staged.given}: {exc.strerror}") from None
        finally:
            tmp.unlink(missing_ok=True)

    def commit(self) -> None:
        """Every written target into place, or none: each one's temp file is written, then
        every target is checked again (one may have changed while the command worked, e.g.
        become a folder), and only then are they renamed. Unwritten reservations vanish."""
        staged, self._staged = self._staged, {}
        written = [s for s in staged.values() if s.data is not None]
        try:
            for s in written:
                s.write_temp()
            for s in written:
                check_output_target(s.given)
            for s in written:
                s.rename()
        finally:
            for s in written:
                s.discard()

    def discard(self) -> None:
        staged, self._staged = self._staged, {}
        for s in staged.values():
            s.discard()


@contextlib.contextmanager
def staged_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """A temp path to write ``path``'s content to (e.g. ``fig.savefig``); on leaving the block
    it is staged in the active output set, or renamed over ``path`` at once when none holds it.
    An error inside the block leaves ``path`` as it was."""
    outs = _ACTIVE.get()
    if outs is not None and outs.holds(path):
        with outs.temp_for(path) as tmp:
            yield tmp
        return
    with OutputSet() as single:
        single.reserve(path)
        with single.temp_for(path) as tmp:
            yield tmp
        single.commit()


def write_bytes_atomic(data: bytes, path: str | os.PathLike[str]) -> None:
    """Write ``data`` to ``path`` whole or not at all: held by the active output set when it
    holds ``path``, else written and renamed into place at once."""
    outs = _ACTIVE.get()
    if outs is not None and outs.holds(path):
        outs.put(path, data)
        return
    with OutputSet() as single:
        single.reserve(path)
        single.put(path, data)
        single.commit()


def write_text_atomic(text: str, path: str | os.PathLike[str]) -> None:
    """Write ``text`` (UTF-8, newlines as given) to ``path`` whole or not at all."""
    write_bytes_atomic(text.encode("utf-8"), path)


def reserve_outputs(paths: dict[str, str | os.PathLike[str]]) -> None:
    """Check every ``{what: path}`` before work starts; inside an active output set also stage
    them (a writer deep in a library reserves what it will write, so that the command's set
    holds it). One line naming the first target that cannot be written."""
    outs = _ACTIVE.get()
    for what, path in paths.items():
        if outs is None:
            check_output_target(path, what)
        elif not outs.holds(path):
            outs.reserve(path, what)

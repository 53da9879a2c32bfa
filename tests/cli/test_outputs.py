"""Output files (``epsim.model.outputs``): checked before work, written whole or not at all and
all of a command's together, never replacing a non-regular file, with the usual file modes."""

import os
import stat
import subprocess

import pytest
from conftest import REPO

from epsim.model.errors import EpsimError
from epsim.model.outputs import (
    OutputSet,
    check_output_target,
    staged_path,
    write_text_atomic,
)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_a_set_writes_every_target_on_commit_and_none_before(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.json"
    with OutputSet() as outs:
        outs.reserve(a, "--csv")
        outs.reserve(b, "--trace")
        write_text_atomic("1,2\n", a)
        write_text_atomic("{}", b)
        assert not a.exists() and not b.exists()  # staged, not visible
        outs.commit()
    assert (a.read_text(), b.read_text()) == ("1,2\n", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.csv", "b.json"]  # no temp left


def test_a_failure_after_one_output_was_written_leaves_no_target_and_no_temp(tmp_path):
    a, b = tmp_path / "a.csv", tmp_path / "b.png"
    a.write_text("old")
    with pytest.raises(RuntimeError), OutputSet() as outs:
        outs.reserve(a, "--csv")
        outs.reserve(b, "--plot")
        write_text_atomic("new", a)
        raise RuntimeError("the plot failed")
    assert a.read_text() == "old" and not b.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.csv"]


def test_non_regular_targets_are_refused_and_left_alone(tmp_path):
    fifo, folder = tmp_path / "fifo", tmp_path / "folder"
    os.mkfifo(fifo)
    folder.mkdir()
    for target, kind in ((fifo, "a FIFO"), (folder, "a directory")):
        with pytest.raises(EpsimError, match=f"it is {kind}"):
            check_output_target(target)
        with pytest.raises(EpsimError), OutputSet() as outs:
            outs.reserve(target)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and folder.is_dir() and not any(folder.iterdir())
    with pytest.raises(EpsimError, match="folder .* does not exist"):
        check_output_target(tmp_path / "nowhere" / "x.json")


def test_a_target_replaced_by_a_fifo_while_working_is_not_overwritten(tmp_path):
    target = tmp_path / "x.json"
    with OutputSet() as outs:
        outs.reserve(target)
        write_text_atomic("{}", target)
        os.mkfifo(target)  # someone put a FIFO there meanwhile
        with pytest.raises(EpsimError, match="FIFO"):
            outs.commit()
    assert stat.S_ISFIFO(os.stat(target).st_mode)
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_an_unwritable_folder_is_one_error_at_reservation(tmp_path):
    with pytest.raises(EpsimError, match="cannot write /proc/epsim-x.json"), OutputSet() as outs:
        outs.reserve("/proc/epsim-x.json")


def test_new_files_follow_the_umask_and_replaced_files_keep_their_mode(tmp_path):
    old = os.umask(0o027)
    try:
        write_text_atomic("x", tmp_path / "new.txt")
        assert _mode(tmp_path / "new.txt") == 0o640
        kept = tmp_path / "kept.txt"
        kept.write_text("old")
        os.chmod(kept, 0o604)
        write_text_atomic("y", kept)
        assert _mode(kept) == 0o604 and kept.read_text() == "y"
    finally:
        os.umask(old)


def test_a_symlink_is_written_through(tmp_path):
    real = tmp_path / "real.json"
    real.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(real)
    write_text_atomic("new", link)
    assert link.is_symlink() and real.read_text() == "new"


def test_the_same_target_twice_is_refused(tmp_path):
    with pytest.raises(EpsimError, match="already an output"), OutputSet() as outs:
        outs.reserve(tmp_path / "a.csv", "--csv")
        outs.reserve(tmp_path / "a.csv", "--plot")


def test_staged_path_without_a_set_writes_atomically(tmp_path):
    target = tmp_path / "fig.png"
    with pytest.raises(RuntimeError), staged_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("savefig failed")
    assert not target.exists() and not any(tmp_path.iterdir())
    with staged_path(target) as tmp:
        tmp.write_bytes(b"png")
    assert target.read_bytes() == b"png"


def test_a_folder_path_with_a_trailing_slash_is_refused(tmp_path):
    with pytest.raises(EpsimError, match="a file path is needed, not a folder"):
        check_output_target(f"{tmp_path}/newdir/")
    assert not (tmp_path / "newdir").exists()


def test_a_target_turned_into_a_folder_before_commit_leaves_the_others_unchanged(tmp_path):
    """sweep --csv A --plot B with B made a folder while the command worked: A keeps its old
    content (every target is checked again before any is renamed), no temp file is left."""
    a, b = tmp_path / "a.csv", tmp_path / "b.png"
    a.write_text("old")
    with pytest.raises(EpsimError, match="b.png: it is a directory"), OutputSet() as outs:
        outs.reserve(a, "--csv")
        outs.reserve(b, "--plot")
        write_text_atomic("new", a)
        write_text_atomic("png", b)
        b.mkdir()
        outs.commit()
    assert a.read_text() == "old" and b.is_dir() and not any(b.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.csv", "b.png"]


def test_nothing_is_on_disk_between_reserve_and_commit(tmp_path):
    """A kill (SIGKILL runs no clean-up) can leave no temp file: the content waits in memory."""
    a = tmp_path / "a.csv"
    with OutputSet() as outs:
        outs.reserve(a, "--csv")
        assert list(tmp_path.iterdir()) == []
        write_text_atomic("1,2\n", a)
        with staged_path(tmp_path / "a.csv") as tmp:  # a writer that needs a path
            tmp.write_text("3,4\n")
            assert list(tmp_path.iterdir()) == [tmp]  # only while it writes
        assert list(tmp_path.iterdir()) == []
        outs.commit()
    assert a.read_text() == "3,4\n"


def test_a_temp_file_of_a_dead_writer_is_removed_when_its_target_is_next_written(tmp_path):
    target = tmp_path / "out.csv"
    dead = _a_dead_pid()
    stale = tmp_path / f".out.csv.{dead}.abcd1234.part"
    ours = tmp_path / f".out.csv.{os.getpid()}.abcd1234.part"  # a live writer's: kept
    other = tmp_path / f".other.csv.{dead}.abcd1234.part"  # another target's: kept
    for p in (stale, ours, other):
        p.write_text("")
    write_text_atomic("x", target)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["out.csv", ours.name, other.name])


def _a_dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_sweep_csv_and_plot_are_written_together_or_not_at_all(tmp_path, monkeypatch, capsys):
    """The issue's case end to end: `sweep --csv A --plot B` with B turned into a folder while
    the sweep worked (here: right after the plot was drawn) exits 2 and leaves A as it was."""
    pytest.importorskip("matplotlib")
    from epsim.cli import main
    from epsim.commands import sweep

    a, b = tmp_path / "a.csv", tmp_path / "b.png"
    a.write_text("old")
    drawn = sweep.write_plot

    def draw_then_swap(points, rows, path):
        drawn(points, rows, path)
        b.mkdir()

    monkeypatch.setattr(sweep, "write_plot", draw_then_swap)
    status = main(["sweep", "--model", str(REPO / "src/epsim/model/configs/tiny-deepseek.json"), "--hardware",
                   "mi300x", "--isl", "16", "--osl", "4", "--concurrency", "1,2", "--workers",
                   "1", "--csv", str(a), "--plot", str(b)])
    err = capsys.readouterr().err
    assert status == 2 and err.splitlines() == [
        f"epsim sweep: error: cannot write {b}: it is a directory"]
    assert a.read_text() == "old" and b.is_dir() and not any(b.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.csv", "b.png"]

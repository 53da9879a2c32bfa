"""Pool workers that never outlive the command that started them.

Why this is needed: a pool worker is forked by multiprocessing's forkserver, not by the command,
and it inherits the write ends of the pool's queues and of the forkserver's "alive" pipe. When
the command dies without closing its pool (SIGKILL, an out-of-memory kill) nothing a worker
reads ever reaches end of file, so the workers wait forever, and the forkserver and the resource
tracker, which wait for those pipes to close, stay too (with the caller's stdout and stderr).

    watch_parent    the pool's worker initializer: a daemon thread that waits on the
                    command's sentinel (``multiprocessing.parent_process().sentinel``, a pipe
                    only the command holds: it reads end of file the moment the command is
                    gone, however it died) and then ends the worker at once (``os._exit``);
                    the worker also ignores SIGINT, SIGTERM and SIGHUP, so a signal sent to the
                    whole process group (Ctrl-C, a terminal hang-up, ``kill -- -PGID``) is the
                    command's to handle: it ends with one line, not one traceback per worker
    stop_workers    what the command does when a signal or an error ends it mid-search: kill
                    its workers now (they ignore SIGTERM) instead of waiting for their points

Once every worker has gone, the forkserver and the resource tracker read end of file on their
pipes and exit on their own. The command's ``pymp-*`` folder in ``$TMPDIR`` (the forkserver's
socket), which the command removes when it exits but cannot when killed, is removed by the
first worker that sees it gone.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import threading
from concurrent.futures import ProcessPoolExecutor

#: the signals a worker leaves to its command
COMMAND_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

#: a worker's exit status when its command vanished (128 + SIGKILL, as if killed with it)
ORPHAN_EXIT = 128 + signal.SIGKILL


def _wait_then_exit(sentinel: int, tempdir: str | None) -> None:
    multiprocessing.connection.wait([sentinel])
    if tempdir:  # the command's pymp-* folder, which its own exit would have removed
        shutil.rmtree(tempdir, ignore_errors=True)
    os._exit(ORPHAN_EXIT)  # nothing else to clean: the command that wanted the result is gone


def watch_parent(tempdir: str | None = None) -> None:
    """Worker initializer: end this process as soon as the process that started the pool ends
    (removing ``tempdir``, the command's multiprocessing folder in ``$TMPDIR``, which a killed
    command leaves), and leave the command's signals to the command."""
    for sig in COMMAND_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    parent = multiprocessing.parent_process()
    if parent is None:  # not a multiprocessing child: nothing to watch
        return
    threading.Thread(target=_wait_then_exit, args=(parent.sentinel, tempdir), daemon=True,
                     name="epsim-watch-parent").start()


def stop_workers(pool: ProcessPoolExecutor) -> None:
    """Kill ``pool``'s workers now and shut it down without waiting for their points."""
    processes = list((getattr(pool, "_processes", None) or {}).values())
    for proc in processes:
        if proc.is_alive():
            proc.kill()  # SIGKILL: a worker ignores SIGTERM (see watch_parent)
    pool.shutdown(wait=False, cancel_futures=True)
    for proc in processes:
        proc.join(timeout=5)

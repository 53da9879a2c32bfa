"""``epsim <command> ...``: argument parsing, one-line errors, exit codes.

Commands live in ``epsim.commands``, one module each with ``add_parser(subparsers)`` and
``run(args) -> int``; ``epsim.commands.COMMANDS`` lists them. Every value a flag takes is
parsed and range-checked by ``epsim.inputs`` while the arguments are parsed; every output file a
command names is then reserved (checked and staged) before the command runs, and written only
if it succeeds, all of them together (``epsim.model.outputs``). Every user error is one line
on stderr and exit status 2 (docs/design.md section 5); a command ended by SIGINT, SIGTERM or
SIGHUP prints one line and exits 130, 143 or 129 (:class:`Terminated`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import signal
import sys
import threading
from collections.abc import Iterator, Sequence

from epsim.model.errors import EpsimError
from epsim.model.outputs import OutputSet

from .commands import COMMANDS
from .config_file import apply_config, config_path, print_group_help
from .specs import output_targets


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        message = " ".join(message.split())  # one line, whatever a value held
        sys.stderr.write(f"epsim: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


class _Version(argparse.Action):
    """``--version``: argparse's own would rewrap the lines into one paragraph."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        from .provenance import version_text

        sys.stdout.write(version_text() + "\n")
        raise SystemExit(0)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="epsim",
        description="Predict, tune and run expert-parallel inference of MoE LLMs.",
    )
    parser.add_argument("--version", action=_Version, nargs=0,
                        help="print the version and every shipped profile's hash, and exit")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subparsers.required = True
    for name in COMMANDS:
        importlib.import_module(f"epsim.commands.{name}").add_parser(subparsers)
    return parser


def _command_parser(parser: argparse.ArgumentParser, argv: Sequence[str]
                    ) -> tuple[argparse.ArgumentParser | None, list[str]]:
    """The (sub)command's own parser that ``argv``'s leading words name, and those words."""
    words: list[str] = []
    current: argparse.ArgumentParser | None = parser
    for token in argv:
        subs = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or token not in subs[0].choices:
            break
        current = subs[0].choices[token]
        words.append(token)
    return (current if words else None), words


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and validate ``argv`` (every flag's range, names, files, output targets): the
    arguments, or ``SystemExit(2)`` after one line on stderr. Nothing is written.
    ``--config FILE`` sets the command's defaults before the flags are read (they win);
    ``--help=GROUP`` prints that group of the command's flags and exits."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    command, words = _command_parser(parser, argv)
    if command is not None:
        try:
            group = next((a.split("=", 1)[1] for a in argv if a.startswith("--help=")), None)
            if group is not None:
                print_group_help(command, group)
                raise SystemExit(0)
            path = config_path(argv)
            flag = command._option_string_actions.get("--config")
            if path is not None and flag is not None:
                apply_config(command, flag.type(path))  # the file checked as an input first
        except argparse.ArgumentTypeError as exc:
            command.error(f"argument --config: {exc}")
        except EpsimError as exc:
            command.error(str(exc))
    return parser.parse_args(argv)


#: the signals that end a command: each with one line and exit status 128 + the signal (130,
#: 143, 129: the shell's convention)
ENDING_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Terminated(BaseException):
    """SIGINT, SIGTERM or SIGHUP arrived while a command worked: it ends with one line, its
    output files discarded (the ``OutputSet`` leaves), exit status 128 + the signal.

    A ``BaseException``, as ``KeyboardInterrupt`` is, so that no ``except EpsimError`` or
    ``except Exception`` on the way (a search skipping a point that cannot run, a library's
    retry) can take the signal for a failed point and go on: the search stops where it is and
    no answer is built from what it had."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.exit_status = 128 + signum


def _terminate(signum: int, _frame: object) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def _termination_as_error() -> Iterator[None]:
    """The ending signals raise :class:`Terminated` in the command (the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, _terminate) for sig in ENDING_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _commit(outputs: OutputSet) -> None:
    """Rename the outputs into place with the ending signals held back, so that a signal cannot
    stop the renames half-way (it is delivered right after, and the command ends on it)."""
    if threading.current_thread() is not threading.main_thread():
        outputs.commit()
        return
    held = signal.pthread_sigmask(signal.SIG_BLOCK, ENDING_SIGNALS)
    try:
        outputs.commit()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def main(argv: Sequence[str] | None = None) -> int:
    # the handlers first: a signal while the commands' modules load is one line too
    with _termination_as_error():
        try:
            args = parse(argv)
        except (Terminated, KeyboardInterrupt) as exc:
            signum = exc.exit_status - 128 if isinstance(exc, Terminated) else signal.SIGINT
            sys.stderr.write(f"epsim: error: terminated by {signal.Signals(signum).name}\n")
            return 128 + signum
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    """The parsed command, its outputs reserved before and committed after, every failure
    and every ending signal one line."""
    try:
        with OutputSet() as outputs:
            for what, path in output_targets(args):  # before any work
                outputs.reserve(path, what)
            status = int(args.run(args) or 0)
            if status == 0:
                _commit(outputs)
            return status
    except (EpsimError, Terminated) as exc:
        message = " ".join(str(exc).split())  # one line, whatever the message held
        sys.stderr.write(f"epsim {args.command}: error: {message}\n")
        return int(getattr(exc, "exit_status", 2))
    except KeyboardInterrupt:  # SIGINT outside the main thread's handler
        sys.stderr.write(f"epsim {args.command}: error: terminated by SIGINT\n")
        return 130
    except BrokenPipeError:
        return 0

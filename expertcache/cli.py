"""The `expertcache` command: one verb per module under expertcache.commands."""
from __future__ import annotations

import argparse
import codecs
import contextlib
import errno
import functools
import importlib
import io
import json
import os
import pickle
import re
import shlex
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from .address_space import address_space_limit
from .atomic import system_error
from .choices import DATA
from .commands.options import check_environment, compiled_ok
from .errors import BadInput, ExpertCacheError, did_you_mean

VERBS = ["generate", "chat", "serve", "ppl", "convert", "info", "calibrate", "predict", "study", "tune", "bench",
         "trace", "simulate", "calibrate-hw", "train"]


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with every option's default shown, unless its text already says it or there is none."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        # by identity: 0 and 0.0 equal False, and a default of 0 (--temperature, --top-k) is one to show
        if "default" in text or any(default is v for v in (None, False, argparse.SUPPRESS)) or default == [] \
                or action.required:
            return text
        if isinstance(action, argparse._StoreFalseAction):  # a --no-X flag: its default True reads as if it were set
            return text
        if isinstance(default, Path) and default.is_relative_to(DATA):  # the built-in model's or texts
            default = Path("expertcache") / default.relative_to(DATA.parent)
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})".lstrip()


class Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (the usage stays behind --help), exit code 2, and the defaults shown."""

    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kw)
        # a value that begins with a minus and a digit is a value, so that its own check names it (as Python 3.13's
        # argparse reads it): 3.11's took `--memory-budget -1G` for an option and said "expected one argument"
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str):
        """Print one line naming the problem, with the nearest spelling of a misspelt verb, option or choice, and
        exit with code 2."""
        if m := re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message):
            message += did_you_mean(m.group(1), re.findall(r"'([^']*)'", m.group(2)))
        elif message.startswith("unrecognized arguments: "):
            options = [o for a in self._actions for o in a.option_strings]
            message += next((near for word in message.split()[2:] if word.startswith("--")
                             for near in [did_you_mean(word.split("=")[0], options)] if near), "")
        self.exit(2, f"{self.prog}: error: {message}; see `{self.prog} --help`\n")

    def _print_message(self, message: str, file=None) -> None:
        """argparse's, except that a --help or --version that cannot be written to stdout (a full disk) ends the run
        as any failed write to it does, in one line and exit code 2 (141 where its reader left): argparse dropped
        the error, and the text was lost with exit code 0. A line that stderr cannot take is still dropped."""
        if not message:
            return
        file = file or sys.stderr
        try:
            file.write(message)
            if file is sys.stdout:
                file.flush()
        except (AttributeError, OSError) as e:
            if file is sys.stdout and isinstance(e, OSError):
                raise SystemExit(reported(e, self.prog.split()[0])) from None


class Terminated(BaseException):
    """SIGTERM (a supervisor, `timeout`, a container stopping), raised where the main thread is so that the verb
    unwinds as from Ctrl-C: a store conversion's partial file (tens of GB under ~/.cache) is removed, and a file
    written whole or not at all leaves no partial one. Not a KeyboardInterrupt: chat's and ppl's Ctrl-C (stop a
    reply, report the windows so far) would catch it and go on."""


SIGTERMS = []  # the SIGTERMs this run took: one raised where Python cannot pass it on (a C library's callback drops
# it) leaves that library failing in its own way, an error that is the signal's
# ended as SIGTERM is: a hang-up (an ssh session dropped during a conversion of hours) and a soft CPU-time limit
# left a partial store file of tens of GB, which only SIGTERM's and Ctrl-C's unwinding removes
ENDING = (signal.SIGTERM, signal.SIGHUP, signal.SIGXCPU)


def _terminated(signum, frame):
    SIGTERMS.append(signum)
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    """Run one verb; returns its exit code (2 on bad input, with one line on stderr; 130 on Ctrl-C,
    also while the verbs' modules load). On SIGTERM the verb unwinds, then the process dies of the signal."""
    _stand_in_for_closed_streams()
    _escape_unencodable(sys.stdout)
    _read_utf8(sys.stdin)
    here = threading.current_thread() is threading.main_thread()  # only the main thread may set a handler
    # None: a handler set in C; one ignored (nohup's SIGHUP) stays ignored
    previous = {sig: signal.signal(sig, _terminated) or signal.SIG_DFL for sig in ENDING
                if signal.getsignal(sig) != signal.SIG_IGN} if here else {}
    SIGTERMS.clear()
    unraisable, sys.unraisablehook = sys.unraisablehook, functools.partial(_quiet_termination, sys.unraisablehook)
    try:
        return _run(argv)
    except KeyboardInterrupt:
        return 130
    except Terminated:
        sig = SIGTERMS[-1] if SIGTERMS else signal.SIGTERM
        signal.signal(sig, previous.get(sig, signal.SIG_DFL))
        signal.raise_signal(sig)  # dies of it, as its supervisor expects (the default handler)
        return 128 + sig
    finally:
        sys.unraisablehook = unraisable
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _quiet_termination(hook, unraisable) -> None:
    """sys.unraisablehook that drops a Terminated raised where it could not propagate (a C library's callback):
    the run ends by the signal, not with "Exception ignored" and a traceback."""
    if not isinstance(unraisable.exc_value, Terminated):
        hook(unraisable)


def _stand_in_for_closed_streams() -> None:
    """/dev/null for a closed stdin or stderr (`<&-`, `2>&-`), where Python's stream is None: a prompt read from
    stdin ended in an AttributeError's traceback, and the lines printed to stderr went to stdout. Stdin reads as
    empty; stderr's lines are dropped, the exit code still says how the run ended (a closed stdout is refused)."""
    if sys.stdin is None:
        sys.stdin = open(os.devnull)  # noqa: SIM115 -- the process's own, open until it exits
    if sys.stderr is None:
        sys.stderr = open(os.devnull, "w")  # noqa: SIM115


def _escape_unencodable(stream) -> None:
    """Write what the stream's encoding cannot hold (a generation's emoji under PYTHONIOENCODING=ascii, a C
    locale) as backslash escapes, as Python's stderr does, rather than end the run in a UnicodeEncodeError. A C
    locale without UTF-8 mode gives stdout surrogateescape, which passes bytes read through but fails on text."""
    errors = getattr(stream, "errors", None)
    if hasattr(stream, "reconfigure") and (errors == "strict" or errors == "surrogateescape" and
                                           codecs.lookup(stream.encoding).name != "utf-8"):
        stream.reconfigure(errors="backslashreplace")


def _read_utf8(stream) -> None:
    """Read stdin as UTF-8 under a C locale without UTF-8 mode (LC_ALL=C PYTHONUTF8=0): Python reads it as ASCII
    there, and a chat's every non-ASCII message was refused as not UTF-8."""
    if hasattr(stream, "reconfigure") and codecs.lookup(getattr(stream, "encoding", None) or "utf-8").name == "ascii":
        stream.reconfigure(encoding="utf-8", errors="surrogateescape")


def _run(argv: list[str] | None) -> int:
    parser = Parser(prog="expertcache", description="MoE inference with a policy-driven expert cache")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="verb", required=True, parser_class=Parser)
    modules, parsers = {}, {}
    for verb in VERBS:
        mod = importlib.import_module(f".commands.{verb.replace('-', '_')}", __package__)
        parsers[verb] = sub.add_parser(verb, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(parsers[verb])
        modules[verb] = mod
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the verb's parser, whose --help lists what it takes
        parsers[args.verb].error(f"unrecognized arguments: {' '.join(unknown)}")
    json_to_stdout = getattr(args, "json", None) == "-"
    if json_to_stdout:  # stdout carries the JSON alone, so that it pipes into a parser
        args.json = io.StringIO()
    try:
        check_environment()
        check_outputs_apart(args)
        if sys.stdout is None and args.verb != "serve":  # fd 1 closed (`>&-`): Python's stdout is None, where a
            # print is lost in silence and a write is an AttributeError after the run; serve writes to stderr only
            raise BadInput("stdout is closed; run with stdout open (`> FILE`, or `> /dev/null` to discard it)")
        if getattr(args, "model", None) is not None:
            from .commands.options import check_before_download
            from .engine.checkpoint import is_hub_id, model_folder
            if is_hub_id(args.model):
                check_before_download(args)
            args.model = model_folder(args.model)  # a Hub id's snapshot, where verbs write beside it (not ./org/name)
        with contextlib.redirect_stdout(sys.stderr) if json_to_stdout else contextlib.nullcontext():
            code = modules[args.verb].run(args)
        if json_to_stdout:
            sys.stdout.write(args.json.getvalue())
        if code == 0:
            compiled_ok()
        return code
    except Exception as e:  # noqa: BLE001 -- what is not a known error is raised again, traceback and all
        if SIGTERMS:  # numba's compile, its callback's Terminated dropped: "no compiled object yet"
            raise Terminated from None
        flags = {f for action in parsers[args.verb]._actions for f in action.option_strings}
        if (code := reported(e, "expertcache", flags)) is None:
            raise
        return code


# what gives a run less memory, by the flag it takes: those of the verb that ran are named
MEMORY_FIXES = (("--cache", "a smaller --cache"), ("--memory-budget", "--memory-budget"),
                ("--slot-dtype", "--slot-dtype int4 --store-dtype int4"), ("--dense-dtype", "--dense-dtype int8"),
                ("--max-seq", "a shorter --max-seq"), ("--max-tokens", "fewer --max-tokens"))


INPUTS, OUTPUTS = ("trace", "text", "calib_text", "profile"), ("out", "json", "plot")


def check_outputs_apart(args: argparse.Namespace) -> None:
    """BadInput where an output file is an input of the same run (`simulate T --json T` wrote JSON over the
    trace, `trace --text F --out F` a trace over the text), before the run overwrites it."""
    def paths(names: tuple[str, ...]) -> list[Path]:
        values = [getattr(args, n, None) for n in names]
        flat = [p for v in values for p in (v if isinstance(v, list) else [v])]
        return [Path(p) for p in flat if isinstance(p, (str, Path)) and str(p) != "-"]
    for out in paths(OUTPUTS):
        for source in paths(INPUTS):
            with contextlib.suppress(OSError):
                if out.is_file() and source.is_file() and os.path.samefile(out, source):
                    raise BadInput(f"{out} is both an input of this run and where it writes its output; give the "
                                   "output another path")


def reported(e: Exception, prog: str, flags: set[str] | None = None) -> int | None:
    """The exit code of an error that ends a run with one line on stderr (printed here): bad input, a corrupt
    file, a refused allocation (2), stdout's reader gone (141); None for any other error, a bug to show whole.
    `flags`: the options of the verb that ran, which the out-of-memory advice names (None: every one)."""
    e = system_error(e) or e  # safetensors' writer reports the system's error in its own type
    if isinstance(e, (ExpertCacheError, UnicodeDecodeError, json.JSONDecodeError)):  # bad input or a corrupt file
        print(f"{prog}: error: {e}", file=sys.stderr)
    elif isinstance(e, BrokenPipeError):  # stdout's reader left (`| head`): end quietly, as SIGPIPE would
        with contextlib.suppress(OSError, ValueError):  # and Python's flush of stdout at exit finds no pipe to fail
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    elif isinstance(e, (MemoryError, RuntimeError, OSError)) and (sizes := out_of_memory(e)) is not None:
        # torch's is a RuntimeError, an anonymous map's an OSError (ENOMEM)
        fixes = [fix for flag, fix in MEMORY_FIXES if flags is None or flag in flags]
        advice = f": {', '.join(fixes[:-1])}{' or ' if len(fixes) > 1 else ''}{fixes[-1]}" if fixes else \
            " (or run it on a machine with more memory)"
        if (limit := address_space_limit()) is not None:  # refused by ulimit -v, not by the machine
            advice += f"; or raise the address-space limit (ulimit -v {limit >> 10}; ulimit -v unlimited)"
        print(f"{prog}: error: out of memory{f' ({sizes})' if sizes else ''}; give the run less{advice}",
              file=sys.stderr)
    elif isinstance(e, OSError):
        print(f"{prog}: error: {e}; {os_error_fix(e, flags)}", file=sys.stderr)
    elif isinstance(e, (EOFError, pickle.UnpicklingError)) and _from_numba_cache(e):  # a truncated index or object
        # file of the kernels' cache failed every run the same way, the folder never named
        from .kernel.compiled import cache_dir
        print(f"{prog}: error: the compiled kernels' cache is damaged ({type(e).__name__}: {e}); delete it (rm -rf "
              f"{shlex.quote(str(cache_dir()))}) and run again, which compiles them anew", file=sys.stderr)
    else:
        return None
    return 2


def run_script(entry: Callable[[], object]) -> NoReturn:
    """A benchmark script's entry point: its bad input ends as a verb's does, in one line and exit code 2 (130 on
    Ctrl-C), not in a traceback; a bug still shows its traceback."""
    try:
        code = entry()
    except KeyboardInterrupt:
        code = 130
    except Exception as e:  # noqa: BLE001 -- as in main
        if (code := reported(e, Path(sys.argv[0]).name)) is None:
            raise
    sys.exit(code if isinstance(code, int) else 0)


def out_of_memory(e: BaseException) -> str | None:
    """What an allocation the machine refused says of its sizes (numpy's MemoryError, the CPU allocator's or CUDA's
    OutOfMemoryError: a too large run on a GPU), or None for another error; matched by name, since --help loads
    no torch."""
    if isinstance(e, OSError):
        return "" if e.errno == errno.ENOMEM else None
    said = " ".join(str(e).split())
    if not (isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or "can't allocate memory" in said):
        return None
    return re.sub(r"^\[enforce fail[^]]*\]\s*(err == 0\.\s*)?", "", said.split(" Of the allocated")[0])


def version() -> str:
    """The installed package's version."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed
    try:
        return installed("expertcache")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "(not installed)"


def _from_numba_cache(e: BaseException) -> bool:
    """Whether `e` was raised while numba read its on-disk cache (numba/core/caching.py)."""
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace(os.sep, "/").endswith("numba/core/caching.py"):
            return True
        tb = tb.tb_next
    return False


def os_error_fix(e: OSError, flags: set[str] | None = None) -> str:
    """What to do about an operating-system error the library did not expect (mostly under ~/.cache); the folders'
    options named where the verb that ran takes them (`flags`; None: every one)."""
    named = [f for f in ("--store-dir", "--out") if flags is None or f in flags]
    where = f"({' or '.join(named)}, or EXPERTCACHE_HOME)" if named else \
        "(a writable copy of the model folder, or EXPERTCACHE_HOME for the cache)"
    if e.errno in (errno.EMFILE, errno.ENFILE):
        return "too many open files for this process's limit: raise it (ulimit -n 4096) and run it again"
    if e.errno in (errno.ENOSPC, errno.EDQUOT) and e.filename is None:  # a write to stdout, or to an open file
        return ("free disk space where the run writes: its output (stdout), its --json file, or its store and cache "
                "(EXPERTCACHE_HOME)")
    if e.errno == errno.EROFS:
        return f"the filesystem is read-only: choose another folder {where}"
    if e.errno in (errno.EACCES, errno.EPERM):  # a model's file or folder it reads, or a folder it writes
        return f"let this user read it (a model's files and folders) or write it (a store's or the cache's), or " \
               f"choose another folder {where}"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"free disk space, or choose a folder on another disk {where}"
    if e.errno in (errno.ENOTDIR, errno.EEXIST):  # a file where a folder must go ($HOME unset, or /dev/null)
        return f"a file stands where a folder must go: choose another folder {where}"
    if e.errno == errno.EFBIG:  # a write past ulimit -f, or the filesystem's largest file (FAT's 4 GiB)
        return f"a file grew past the size limit (ulimit -f) or the filesystem's largest file: raise the limit " \
               f"(ulimit -f unlimited) or choose a folder on another filesystem {where}"
    if e.errno == errno.EINVAL:
        return f"the filesystem refused the operation; choose a folder on another filesystem {where}"
    return "check the path and the disk"


if __name__ == "__main__":
    sys.exit(main())

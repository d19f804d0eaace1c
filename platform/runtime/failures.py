"""A client's own error, as the display and MLflow report it: one line that names the exception and
where the algorithm's code raised it, and the whole traceback beside it.

A client whose code raises is skipped and the run goes on (a round in which every client fails stops
it), so the line is often all an algorithm's author sees of a bug: ``'nope'`` says nothing, while
``KeyError: 'nope' (at algorithms/scaffold.py:74 in upload)`` says where to look. The place is the
innermost frame of the algorithm's code: a file in ``algorithms/`` or a module that defines the
algorithm's classes (an installed package's), else any file that is neither the
platform's nor a library's (torch, Lightning, the standard library: a test's module, a script);
failing that, the innermost of the platform's own frames. The worker builds it, where the frames'
files are, and the Coordinator passes it on (:class:`ClientCodeError`).
"""

from __future__ import annotations

import inspect
import re
import sysconfig
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from fedray.platform.errors import first_line

PLATFORM_DIR = Path(__file__).resolve().parents[1]
PACKAGE_ROOT = PLATFORM_DIR.parent  # the repository in an editable install, site-packages/fedray else
ALGORITHMS_DIR = PACKAGE_ROOT / "algorithms"
# the standard library (installed packages are told by their site-packages folder, whichever environment)
LIBRARY_DIRS = tuple({Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib")})
# a frame of a traceback as Python prints it (and as Ray's RayTaskError carries a worker's)
ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
FRAME_LINE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)', re.MULTILINE)
# a traceback beyond this is cut to its end (a deep recursion's): it travels with an event
MAX_TRACEBACK_CHARS = 20_000

Frame = tuple[str, int, str]  # file, line, function


@dataclass(frozen=True)
class Failure:
    """A client's (or an evaluation job's) own error: ``line`` for the display and the round's
    report; ``origin``, its type and the place it was raised, which tells one error from another
    when the message differs per client; ``traceback`` (empty when there is none, or once the
    Coordinator has passed on the first of that origin)."""

    line: str
    origin: str = ""
    traceback: str = ""


class ClientCodeError(Exception):
    """A worker's job whose own code raised, carrying the :class:`Failure` the worker built (its
    frames' paths are that node's): the pool reports it and does not retry the job."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure)  # the args a pickled copy is rebuilt from
        self.failure = failure

    def __str__(self) -> str:
        return self.failure.line


def algorithm_files(*classes: type) -> tuple[Path, ...]:
    """The files of the modules that define ``classes`` (an algorithm's server, client and config),
    the platform's own base classes left out: their frames are the algorithm's wherever it is
    installed (a package in site-packages, through the registry's entry points)."""
    files = {Path(inspect.getfile(cls)).resolve() for cls in classes}
    return tuple(sorted(f for f in files if not f.is_relative_to(PLATFORM_DIR)))


def failure_of(err: BaseException, hint: str = "", own: tuple[Path, ...] = ()) -> Failure:
    """An exception raised in this process; ``hint`` is added to its message (what to do), ``own``
    are the algorithm's module files (:func:`algorithm_files`)."""
    frames = [(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(err.__traceback__)]
    where = place(frames, own)
    text = "".join(traceback.format_exception(err))[-MAX_TRACEBACK_CHARS:]
    return Failure(f"{described(err)}{hint}{where}", f"{type(err).__name__}{where}", text)


def remote_failure(err: BaseException) -> Failure:
    """An exception a worker raised that is not a :class:`ClientCodeError` (Ray's ``RayTaskError``):
    its text carries the worker's traceback (its header in terminal colours, dropped), read for the
    frames; the line is the original exception's."""
    text = ANSI_COLOUR.sub("", str(err))[-MAX_TRACEBACK_CHARS:]
    frames = [(m["file"], int(m["line"]), m["name"]) for m in FRAME_LINE.finditer(text)]
    cause = getattr(err, "cause", None)
    original = cause if isinstance(cause, BaseException) else err
    where = place(frames, ())
    return Failure(f"{described(original)}{where}", f"{type(original).__name__}{where}", text)


def described(err: BaseException) -> str:
    """``Type: message`` (a KeyError's message alone is the key, quoted), or ``Type`` when it has
    none (a bare ``assert``)."""
    name = type(err).__name__
    if not str(err).strip():
        return name
    message = first_line(err)
    return message if message.startswith(f"{name}:") else f"{name}: {message}"


def place(frames: list[Frame], own: tuple[Path, ...]) -> str:
    """`` (at <file>:<line> in <function>)`` of the frame the algorithm's code raised in, or ``""``."""
    kinds = [kind_of(f[0], own) for f in frames]
    for wanted in ("algorithm", "platform"):
        for frame, kind in zip(reversed(frames), reversed(kinds), strict=True):
            if kind == wanted:
                return f" (at {shown_path(frame[0])}:{frame[1]} in {frame[2]})"
    return ""


def kind_of(filename: str, own: tuple[Path, ...] = ()) -> Literal["algorithm", "platform", "library"]:
    """``algorithm`` (one of the ``own`` files or in ``algorithms/``, or any code of the user's: a test, a script),
    ``platform`` or ``library`` (torch, Lightning, Ray, the standard library, Python's own
    ``<frozen ...>``, and Cython's modules, whose frames name their source relative to nothing)."""
    if filename.startswith("<") or not Path(filename).is_absolute():
        return "library"
    path = Path(filename).resolve()
    if path in own or path.is_relative_to(ALGORITHMS_DIR):
        return "algorithm"
    if path.is_relative_to(PLATFORM_DIR):
        return "platform"
    installed = "site-packages" in path.parts or "dist-packages" in path.parts
    return "library" if installed or any(path.is_relative_to(d) for d in LIBRARY_DIRS) else "algorithm"


def shown_path(filename: str) -> str:
    path = Path(filename).resolve()
    return str(path.relative_to(PACKAGE_ROOT)) if path.is_relative_to(PACKAGE_ROOT) else str(path)

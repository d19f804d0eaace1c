"""A client's own error, as the display and MLflow report it: one line that names the exception and
where the algorithm's code raised it, and the whole traceback beside it.

A client whose code raises is skipped and the run goes on (a round in which every client fails stops
it), so the line is often all an algorithm's author sees of a bug: ``'nope'`` says nothing, while
``KeyError: 'nope' (at algorithms/scaffold.py:74 in upload)`` says where to look. The place is the
innermost frame in code that is neither the platform's nor a library's (torch, Lightning, the
standard library): the algorithm's module, or a test's; failing that, the innermost of the
platform's own frames.
"""

from __future__ import annotations

import re
import sysconfig
import traceback
from dataclasses import dataclass
from pathlib import Path

from fedray.platform.errors import first_line

PLATFORM_DIR = Path(__file__).resolve().parents[1]
PACKAGE_ROOT = PLATFORM_DIR.parent  # the repository in an editable install, site-packages/fedray else
ALGORITHMS_DIR = PACKAGE_ROOT / "algorithms"
# the standard library (installed packages are told by their site-packages folder, whichever environment)
LIBRARY_DIRS = tuple({Path(sysconfig.get_paths()[k]).resolve() for k in ("stdlib", "platstdlib")})
# a frame of a traceback as Python prints it (and as Ray's RayTaskError carries a worker's)
ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
FRAME_LINE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<name>\S+)', re.MULTILINE)


@dataclass(frozen=True)
class Failure:
    """A client's (or an evaluation job's) own error: ``line`` for the display and the round's
    report, ``traceback`` (empty when there is none, a worker lost) for a reader who debugs it."""

    line: str
    traceback: str = ""

    def prefixed(self, prefix: str) -> Failure:
        return Failure(prefix + self.line, self.traceback)


def failure_of(err: BaseException, line: str | None = None) -> Failure:
    """An exception raised in this process; ``line`` replaces its message (an explained one)."""
    frames = [(f.filename, f.lineno or 0, f.name) for f in traceback.extract_tb(err.__traceback__)]
    text = "".join(traceback.format_exception(err))
    return Failure(located(described(err, line), frames), text)


def remote_failure(err: BaseException) -> Failure:
    """An exception a worker raised and Ray handed back (a ``RayTaskError``): its text carries the
    worker's traceback (its header in terminal colours, dropped), and its last line is the original
    exception's."""
    text = ANSI_COLOUR.sub("", str(err))
    frames = [(m["file"], int(m["line"]), m["name"]) for m in FRAME_LINE.finditer(text)]
    return Failure(located(first_line(err), frames), text)


def described(err: BaseException, line: str | None = None) -> str:
    """``Type: message``: a KeyError's message alone is the key, quoted."""
    name = type(err).__name__
    if line is None and not str(err).strip():
        return name
    message = first_line(err) if line is None else line
    return message if message.startswith(f"{name}:") else f"{name}: {message}"


def located(line: str, frames: list[tuple[str, int, str]]) -> str:
    """``line`` with the place the algorithm's code raised it, where a frame shows one."""
    frame = next((f for f in reversed(frames) if kind_of(f[0]) == "algorithm"), None)
    frame = frame or next((f for f in reversed(frames) if kind_of(f[0]) == "platform"), None)
    if frame is None:
        return line
    return f"{line} (at {shown_path(frame[0])}:{frame[1]} in {frame[2]})"


def kind_of(filename: str) -> str:
    """``algorithm`` (an algorithm's module, a test, any code of the user's), ``platform`` or
    ``library`` (torch, Lightning, Ray, the standard library; Python's own ``<frozen ...>``)."""
    if filename.startswith("<"):
        return "library"
    path = Path(filename).resolve()
    if path.is_relative_to(ALGORITHMS_DIR):
        return "algorithm"
    if path.is_relative_to(PLATFORM_DIR):
        return "platform"
    installed = "site-packages" in path.parts or "dist-packages" in path.parts
    return "library" if installed or any(path.is_relative_to(d) for d in LIBRARY_DIRS) else "algorithm"


def shown_path(filename: str) -> str:
    path = Path(filename).resolve()
    return str(path.relative_to(PACKAGE_ROOT)) if path.is_relative_to(PACKAGE_ROOT) else str(path)

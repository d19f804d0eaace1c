"""The error a user fixes in their config. Its own module so every part of fedray can raise it
without importing the config machinery."""

import argparse
from typing import NoReturn


class ConfigError(ValueError):
    """A config value a user has to fix. The message is one line."""


def unknown_algorithm(name: str, available: list[str]) -> ConfigError:
    return ConfigError(f"algorithm={name!r}: unknown algorithm; available: {', '.join(available)}")


class ContractError(ConfigError):
    """An algorithm that breaks a rule of the platform's contract (a hook the worker loop does not
    call, a client that says it keeps nothing but does). The message is one line naming the rule;
    raised before the run starts where the rule can be checked then, else in the first round."""


class CheckpointError(ConfigError):
    """A checkpoint or stored state that cannot be used as it is (altered, or not fedray's)."""


class RoundFailed(RuntimeError):
    """Every client selected for a round failed: the algorithm's code or the device is broken, not a
    client's data, and aggregating nothing round after round would log a run that learnt nothing as
    if it had gone well. The run stops with one line; its checkpoints stay, to resume once fixed."""


class ServerFailed(RoundFailed):
    """The algorithm's server half raised (in ``__init__``, ``configure``, ``uplinks_arrived``,
    ``aggregate``, or ``eval_payload`` / ``global_model`` for an evaluation): its code is broken, so the run stops with one line naming the method and the place
    (the traceback goes to the run's ``failures/`` artifacts); its checkpoints stay, to resume once fixed."""


class Diverged(RoundFailed):
    """Every client that trained in a round ended it with a non-finite training loss: its model is
    NaN or infinite, and an average spreads that to every client, so the rest of the run (or of a
    sweep's trial) would train nothing. The run stops with one line, before the round is aggregated;
    a resume would diverge again, so a new run with other settings (a lower ``train.lr``) is the fix."""

    MARK = "training diverged"  # in its line, after the round: how a sweep tells it from a crash


# the algorithm's own errors, which a run's processes answer with and stay sound after
ALGORITHM_ERRORS = (ConfigError, RoundFailed)


def last_line(text: str) -> str:
    """The last line of a message (a remote traceback's is its cause), or "" if it has none."""
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def first_line(err: BaseException) -> str:
    """An exception as one line: the last line of its message (a remote traceback's cause), capped."""
    return (last_line(str(err)) or type(err).__name__)[:300]


class OneLineParser(argparse.ArgumentParser):
    """A command line's mistake as one line, naming the command's ``--help`` for the usage, where
    argparse prints the whole usage first; exit status 2, as argparse's."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

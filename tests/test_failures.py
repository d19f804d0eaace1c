"""A client's own error as it is reported: the exception's type and message, and where the
algorithm's code raised it (not torch's frames, not the worker's loop), with the whole traceback."""

from __future__ import annotations

import ray
import torch

from fedray.platform.runtime.failures import (
    PLATFORM_DIR,
    Failure,
    failure_of,
    kind_of,
    remote_failure,
    shown_path,
)


def wrong_shapes():
    return torch.nn.functional.cross_entropy(torch.zeros(4, 3), torch.zeros(5, dtype=torch.long))


def throw_bare():
    raise AssertionError


def raised(fn) -> BaseException:
    try:
        fn()
    except Exception as err:
        return err
    raise AssertionError("it did not raise")


def test_the_line_names_the_type_and_the_algorithms_frame_under_the_library_frames():
    failure = failure_of(raised(wrong_shapes))
    where = f"(at tests/test_failures.py:{wrong_shapes.__code__.co_firstlineno + 1} in wrong_shapes)"
    assert failure.line.startswith("ValueError: Expected input batch_size (4) to match target batch_size (5)")
    assert failure.line.endswith(where) and "\n" not in failure.line
    assert failure.traceback.startswith("Traceback (most recent call last):")
    assert "torch/nn/functional.py" in failure.traceback  # the whole of it, library frames too


def test_a_message_that_is_only_a_key_gets_its_type_and_an_empty_one_its_type_alone():
    assert failure_of(raised(lambda: {}["nope"])).line.startswith(
        "KeyError: 'nope' (at tests/test_failures.py:"
    )
    assert failure_of(raised(throw_bare)).line.startswith("AssertionError (at tests/test_failures.py:")
    explained = failure_of(raised(lambda: {}["x"]), line="x, and what to do")
    assert explained.line.startswith("KeyError: x, and what to do (at tests/test_failures.py:")


def test_frames_are_told_apart_by_where_their_file_lives():
    assert kind_of(torch.__file__) == "library"
    assert kind_of(ray.__file__) == "library"
    assert kind_of(str(PLATFORM_DIR / "runtime" / "worker.py")) == "platform"
    assert kind_of(str(PLATFORM_DIR.parent / "algorithms" / "fedavg.py")) == "algorithm"
    assert kind_of(__file__) == "algorithm"  # a test's module, a user's own
    assert kind_of("<frozen importlib._bootstrap>") == "library"
    assert kind_of(torch.__file__.replace("site-packages", "dist-packages")) == "library"
    assert shown_path(str(PLATFORM_DIR / "runtime" / "worker.py")) == "platform/runtime/worker.py"


def test_a_workers_traceback_from_ray_is_read_from_its_text():
    algo = PLATFORM_DIR.parent / "algorithms" / "mine.py"
    text = (
        "\x1b[36mray::ClientActor.evaluate()\x1b[39m (pid=1, ip=127.0.0.1, actor_id=ab)\n"
        f'  File "{PLATFORM_DIR / "runtime" / "worker.py"}", line 500, in evaluate\n'
        "    logits = module.eval_logits(x)\n"
        f'  File "{algo}", line 12, in eval_logits\n'
        '    return self.head(x)["missing"]\n'
        f'  File "{torch.__file__}", line 99, in __getitem__\n'
        "IndexError: too many indices"
    )

    class RemoteError(Exception):
        def __str__(self) -> str:
            return text

    failure = remote_failure(RemoteError())
    plain = text.replace("\x1b[36m", "").replace("\x1b[39m", "")  # Ray's colours, not in an artifact
    assert failure == Failure("IndexError: too many indices (at algorithms/mine.py:12 in eval_logits)", plain)
    only_platform = text.replace(str(algo), torch.__file__)
    assert remote_failure(type("E", (RemoteError,), {"__str__": lambda self: only_platform})()).line.endswith(
        "(at platform/runtime/worker.py:500 in evaluate)"
    )
    assert Failure("x").prefixed("evaluation: ") == Failure("evaluation: x")

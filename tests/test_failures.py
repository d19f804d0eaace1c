"""A client's own error as it is reported: the exception's type and message, and where the
algorithm's code raised it (not torch's frames, not the worker's loop), with the whole traceback."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch

from fedray.platform.errors import RoundFailed
from fedray.platform.runtime import failures
from fedray.platform.runtime.evaluation import stop_if_every_job_failed
from fedray.platform.runtime.events import ClientFailed, EventQueue
from fedray.platform.runtime.failures import (
    PLATFORM_DIR,
    ClientCodeError,
    Failure,
    algorithm_files,
    failure_of,
    kind_of,
    remote_failure,
    shown_path,
)

HERE = "tests/test_failures.py"


def wrong_shapes():
    return torch.nn.functional.cross_entropy(torch.zeros(4, 3), torch.zeros(5, dtype=torch.long))


def bare_assert():
    raise AssertionError  # as a bare assert raises it (pytest rewrites a test module's asserts)


def raised(fn) -> BaseException:
    try:
        fn()
    except Exception as err:
        return err
    raise AssertionError("it did not raise")


def line_of(fn, offset: int = 1) -> int:
    return fn.__code__.co_firstlineno + offset


def test_the_line_names_the_type_and_the_algorithms_frame_under_the_library_frames():
    failure = failure_of(raised(wrong_shapes))
    where = f" (at {HERE}:{line_of(wrong_shapes)} in wrong_shapes)"
    assert failure.line.startswith("ValueError: Expected input batch_size (4) to match target batch_size (5)")
    assert failure.line.endswith(where) and "\n" not in failure.line
    assert failure.origin == f"ValueError{where}"  # the same error whatever the sizes in its message
    assert failure.traceback.startswith("Traceback (most recent call last):")
    assert "torch/nn/functional.py" in failure.traceback  # the whole of it, library frames too


def test_a_message_that_is_only_a_key_gets_its_type_a_bare_assert_its_type_once_and_a_hint_its_place():
    assert failure_of(raised(lambda: {}["nope"])).line.startswith(f"KeyError: 'nope' (at {HERE}:")
    assert (
        failure_of(raised(bare_assert)).line
        == f"AssertionError (at {HERE}:{line_of(bare_assert)} in bare_assert)"
    )
    hinted = failure_of(raised(lambda: {}["x"]), hint=" (what to do)")
    assert hinted.line.startswith(f"KeyError: 'x' (what to do) (at {HERE}:")


def test_frames_are_told_apart_by_where_their_file_lives():
    assert kind_of(torch.__file__) == "library"
    assert kind_of(ray.__file__) == "library"
    assert kind_of(str(PLATFORM_DIR / "runtime" / "worker.py")) == "platform"
    assert kind_of(__file__) == "algorithm"  # a test's module, a user's own
    assert kind_of("<frozen importlib._bootstrap>") == "library"
    assert kind_of("numpy/random/_generator.pyx") == "library"  # Cython names its source relative to nothing
    assert kind_of(torch.__file__.replace("site-packages", "dist-packages")) == "library"
    assert shown_path(str(PLATFORM_DIR / "runtime" / "worker.py")) == "platform/runtime/worker.py"


def test_an_installed_algorithm_is_the_algorithms_code_in_site_packages_too(monkeypatch, tmp_path):
    """fedray installed (not editable): its algorithms/ beside platform/ in site-packages; a third
    party's algorithm, registered through an entry point, is a module of its own there."""
    root = tmp_path / "lib" / "site-packages" / "fedray"
    monkeypatch.setattr(failures, "PLATFORM_DIR", root / "platform")
    monkeypatch.setattr(failures, "PACKAGE_ROOT", root)
    monkeypatch.setattr(failures, "ALGORITHMS_DIR", root / "algorithms")
    assert kind_of(str(root / "algorithms" / "fedavg.py")) == "algorithm"
    assert kind_of(str(root / "platform" / "runtime" / "worker.py")) == "platform"
    theirs = tmp_path / "lib" / "site-packages" / "their_algos" / "scaffold.py"
    assert kind_of(str(theirs)) == "library"
    assert kind_of(str(theirs), own=(theirs,)) == "algorithm"
    assert shown_path(str(root / "algorithms" / "fedavg.py")) == "algorithms/fedavg.py"


def test_an_algorithms_files_leave_the_platforms_base_classes_out():
    from fedray.algorithms.fedavg import FedAvgConfig, FedAvgServer
    from fedray.platform.api import ClientModule

    (fedavg,) = algorithm_files(FedAvgServer, ClientModule, FedAvgConfig)
    assert fedavg == Path(failures.ALGORITHMS_DIR / "fedavg.py").resolve()


def test_a_workers_error_from_ray_is_its_causes_line_and_its_texts_frames():
    algo = PLATFORM_DIR.parent / "algorithms" / "mine.py"
    text = (
        "Traceback (most recent call last):\n"
        f'  File "{PLATFORM_DIR / "runtime" / "worker.py"}", line 500, in evaluate\n'
        "    logits = module.eval_logits(x)\n"
        f'  File "{algo}", line 12, in eval_logits\n'
        '    return self.head(x)["missing"]\n'
        f'  File "{torch.__file__}", line 99, in __getitem__\n'
        "IndexError: too many indices"
    )
    err = ray.exceptions.RayTaskError(
        "evaluate", text, IndexError("too many indices"), proctitle="ray::ClientActor.evaluate()", pid=1
    )
    failure = remote_failure(err)
    where = " (at algorithms/mine.py:12 in eval_logits)"
    assert failure.line == f"IndexError: too many indices{where}" and failure.origin == f"IndexError{where}"
    assert "\x1b[" not in failure.traceback and 'mine.py", line 12, in eval_logits' in failure.traceback
    only_platform = ray.exceptions.RayTaskError(
        "evaluate", text.replace(str(algo), torch.__file__), KeyError("x")
    )
    assert (
        remote_failure(only_platform).line == "KeyError: 'x' (at platform/runtime/worker.py:500 in evaluate)"
    )


def test_a_client_code_error_carries_its_failure_through_pickling():
    import pickle

    failure = Failure(
        "KeyError: 'x' (at algorithms/a.py:3 in upload)", "KeyError (at algorithms/a.py:3 in upload)"
    )
    again = pickle.loads(pickle.dumps(ClientCodeError(failure)))
    assert again.failure == failure and str(again) == failure.line


def test_only_the_first_failure_of_an_origin_carries_its_traceback():
    events = EventQueue()
    first = Failure("ValueError: batch 4 (at a.py:3 in f)", "ValueError (at a.py:3 in f)", "Traceback ...")
    events.client_failed(0, (3,), first)
    events.client_failed(
        0, (5,), Failure("ValueError: batch 7 (at a.py:3 in f)", first.origin, "Traceback ...")
    )
    events.client_failed(
        1, ("clients", 2), Failure("KeyError: 'y' (at a.py:9 in g)", "KeyError (at a.py:9 in g)", "T")
    )
    events.client_failed(1, ("global", 1), Failure("its worker died 4 times: gone"))
    got = events.poll(0)
    assert [(e.round, e.job, bool(e.failure.traceback)) for e in got] == [
        (1, "client 3", True),
        (1, "client 5", False),  # another message, the same error
        (2, "evaluation from client 2", True),
        (2, "global test chunk 1", False),
    ]
    assert all(isinstance(e, ClientFailed) for e in got) and got[1].failure.line.startswith(
        "ValueError: batch 7"
    )


def fedavg_worker(tmp_path):
    """A FedAvg worker (ClientHost, no Ray) and its first client's task and downlink."""
    from conftest import tiny_overrides
    from in_process import client_task

    from fedray.platform.catalog import load_config
    from fedray.platform.runtime.coordinator import build_server
    from fedray.platform.runtime.driver import federation_meta, prepare_federation
    from fedray.platform.runtime.worker import ClientHost

    cfg = load_config(None, tiny_overrides())
    fed = prepare_federation(cfg)
    host = ClientHost(cfg, num_threads=1)
    host.setup(federation_meta(fed))
    payload = build_server(cfg, federation_meta(fed)).configure(0, [0])[0]
    return host, client_task(0, fed.shards[0], str(tmp_path)), payload


@pytest.mark.parametrize("stage", ["train", "evaluate"])
def test_a_workers_client_error_is_reported_at_the_algorithms_line(stage, monkeypatch, tmp_path):
    """A training error is the client's result; an evaluation error is raised as a ClientCodeError
    carrying the same kind of failure (the pool reports it), and the client's module is dropped
    (it may hold the evaluation's weights)."""
    from fedray.algorithms.fedavg import FedAvgClient

    def broken(self, *args):
        raise AssertionError("broken")  # the line the report must name

    monkeypatch.setattr(FedAvgClient, "training_step" if stage == "train" else "eval_logits", broken)
    monkeypatch.setattr(FedAvgClient, "eval_mode", "own")
    host, task, payload = fedavg_worker(tmp_path)
    where = f"AssertionError: broken (at {HERE}:{line_of(broken)} in broken)"
    if stage == "train":
        (result,) = host.train(0, [task], [[payload]])
        assert result.error.line.startswith(where)
    else:
        host.module(task)  # cached, as after its training
        with pytest.raises(ClientCodeError) as err:
            host.evaluate([task], None)
        assert err.value.failure.line.startswith(where)
        assert "in evaluate" in err.value.failure.traceback
        assert 0 not in host.modules


def test_an_evaluations_device_error_breaks_the_worker_and_out_of_memory_is_tried_once_more(
    monkeypatch, tmp_path
):
    from fedray.algorithms.fedavg import FedAvgClient
    from fedray.platform.runtime.devices import DeviceError

    calls = []

    def short_of_memory_once(self, x):
        calls.append(len(x))
        if len(calls) == 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.model(x)

    monkeypatch.setattr(FedAvgClient, "eval_mode", "own")
    monkeypatch.setattr(FedAvgClient, "eval_logits", short_of_memory_once)
    host, task, _ = fedavg_worker(tmp_path)
    ((client, _, total, _),) = host.evaluate([task], None)
    assert client == 0 and total > 0 and sum(calls[1:]) == total  # tried again, on every test sample

    def broken_device(self, x):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(FedAvgClient, "eval_logits", broken_device)
    with pytest.raises(DeviceError, match=r"^evaluation from client 0: CUDA error: an illegal memory access"):
        host.evaluate([task], None)


def test_a_round_stops_when_every_job_of_a_kind_failed_and_not_when_one_answered():
    failed = Failure("KeyError: 'logits' (at algorithms/x.py:3 in eval_logits)")
    other = Failure("ValueError: other")
    # every client's evaluation failed; the global test answered: the lowest client's error is the line
    with pytest.raises(RoundFailed) as err:
        stop_if_every_job_failed(4, {("clients", 7): other, ("clients", 2): failed}, {("global", 0): []})
    assert str(err.value) == (
        "round 5: all 2 client evaluation jobs failed "
        "(evaluation from client 2: KeyError: 'logits' (at algorithms/x.py:3 in eval_logits))"
    )
    # every global test chunk failed, the clients answered
    with pytest.raises(RoundFailed, match=r"^round 1: all 1 global test jobs failed \(global test chunk 0: "):
        stop_if_every_job_failed(0, {("global", 0): other}, {("clients", 0): []})
    # one job of each kind answered: the run goes on without the failed ones
    stop_if_every_job_failed(
        0, {("clients", 0): failed, ("global", 1): other}, {("clients", 3): [], ("global", 0): []}
    )
    stop_if_every_job_failed(0, {}, {})  # nothing to evaluate

"""A FedAvg whose client breaks its worker once, at a chosen round and client: SIGKILL of its own
process (``train``, ``eval``), a CUDA runtime error (``cuda_error``: the device is gone, the worker
must be replaced) or CUDA's out-of-memory error (``oom``: freed and tried again in place); or,
``fail_while``, every client's error at a chosen round for as long as a marker file exists (the run
fails; a test removes the marker to let it pass again).

Registered as ``fedavg_killer`` when this module is imported: in the test process by the tests, and in
a worker when it unpickles the config's ``KillerConfig`` (Ray ships the driver's ``sys.path``).
A marker file makes the kill happen once: the re-run of the client on a fresh worker goes through.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass
from pathlib import Path

import torch

from fedray.algorithms.fedavg import FedAvgClient, FedAvgServer
from fedray.platform.api.registry import register
from fedray.platform.config.algorithm_config import AlgorithmConfig


class KillerClient(FedAvgClient):
    eval_mode = "own"  # each client tests its own module after load_for_eval, where the kill waits

    def kill_once(self, stage: str) -> None:
        hp = self.hp
        right_round = stage == "eval" or self.rnd == hp.round  # evaluation: the client's first one
        if hp.stage == stage and right_round and self.ctx.client_id == hp.client:
            marker = Path(hp.marker)
            if not marker.exists():
                marker.write_text(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)

    def fail_once(self, stage: str, error: BaseException) -> None:
        hp = self.hp
        if hp.stage == stage and self.rnd == hp.round and self.ctx.client_id == hp.client:
            marker = Path(hp.marker)
            if not marker.exists():
                marker.write_text(str(os.getpid()))
                raise error

    def training_step(self, batch, batch_idx):
        hp = self.hp
        if hp.stage == "fail_while" and self.rnd == hp.round and Path(hp.marker).exists():
            raise OSError(f"the disk under {hp.marker} is gone")  # every client, while the marker is there
        if batch_idx == 1:  # mid-fit: one optimiser step already taken
            self.kill_once("train")
            self.fail_once("cuda_error", RuntimeError("CUDA error: an illegal memory access was encountered"))
            self.fail_once(
                "oom", torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            )
        return super().training_step(batch, batch_idx)

    def load_for_eval(self, payload) -> None:
        self.kill_once("eval")
        super().load_for_eval(payload)


@register("fedavg_killer", server=FedAvgServer, client=KillerClient)
@dataclass
class KillerConfig(AlgorithmConfig):
    stage: str = "none"  # train | eval | cuda_error | oom | fail_while (the marker exists) | none
    round: int = 1  # 0-based round of a training kill
    client: int = 0
    marker: str = ""


def run_trial(*args, **kwargs):
    """The sweep's Tune trainable, importing this module first: a trial's process builds its config
    from a plain dict, so it would not know ``fedavg_killer`` otherwise (a test puts this in place of
    ``fedray.sweeps.tune_sweep.run_trial``; Ray pickles it by reference, and the trial's process finds
    this module on the tests' PYTHONPATH). Named as the real one, so trials are named alike."""
    from fedray.sweeps import tune_sweep

    return tune_sweep.run_trial(*args, **kwargs)

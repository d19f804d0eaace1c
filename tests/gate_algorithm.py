"""A FedAvg whose server stops in the middle of a chosen round until the test lets it go.

At ``round`` (0-based), after the clients were chosen and before anything is sent to them, the
server writes ``<gate>.reached`` (its process id) and waits for ``<gate>.open``: a test that stops the run from
outside (SIGTERM, SIGKILL of the driver or of the Coordinator) knows the stop lands mid-round, with
the rounds since the last checkpoint still to be replayed, however fast or loaded the machine is.
A replay of the round finds the gate open (the test opens it after the stop). It draws no random
numbers, so a gated run computes exactly what plain FedAvg does.

Registered as ``fedavg_gate`` when imported: in a test process by the test, in ``fedray run`` started
with ``python -c "import gate_algorithm; ..."``, and in Ray's processes when they unpickle the config.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from fedray.algorithms.fedavg import FedAvgClient, FedAvgServer
from fedray.platform.api.registry import register
from fedray.platform.config.algorithm_config import AlgorithmConfig

GATE_WAIT_S = 600  # a test that never opens the gate fails on its own timeout, well before this


class GateServer(FedAvgServer):
    def configure(self, rnd, selected):
        hp = self.hp
        if rnd == hp.round and hp.gate:
            Path(f"{hp.gate}.reached").write_text(str(os.getpid()))  # the Coordinator's, for a test to kill
            deadline = time.monotonic() + GATE_WAIT_S
            while not Path(f"{hp.gate}.open").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return super().configure(rnd, selected)


@register("fedavg_gate", server=GateServer, client=FedAvgClient)
@dataclass
class GateConfig(AlgorithmConfig):
    round: int = -1  # 0-based round that waits; -1: none
    gate: str = ""  # path prefix of the two marker files

"""What the Coordinator hands the driver when its rounds end: the run's summary (its rounds' metrics,
each client's last accuracy, the global model) and the personalised client models worth logging."""

from __future__ import annotations

from typing import Any

import torch

from fedray.platform.api.algorithm import ClientModule, Server, tests_with_global_model
from fedray.platform.runtime.checkpoint import LoopRecord
from fedray.platform.runtime.state_store import StateStore
from fedray.platform.runtime.worker import client_model_state


def run_summary(finished: bool, server: Server, record: LoopRecord) -> dict[str, Any]:
    """The run as the driver logs it; ``finished`` is False when it stopped before its last round."""
    model = server.global_model()
    return {
        "finished": finished,
        "history": record.history,
        "client_acc": record.client_acc,
        "global_model": None if model is None else {k: v.cpu() for k, v in model.state_dict().items()},
        # the zoo architecture it is, where it is one (FML's global model is the group's smallest)
        "global_arch": getattr(model, "arch", None),
    }


def client_models(
    client_cls: type[ClientModule], server: Server, store: StateStore, num_clients: int, limit: int
) -> tuple[dict[int, dict[str, torch.Tensor]], str]:
    """The personalised models worth logging, and a line saying what was left out and why.

    Clients evaluated with the global model have nothing of their own to show; a client never
    selected still has its initial model; above ``limit`` clients none are logged."""
    if tests_with_global_model(client_cls, server.eval_payload()):
        return {}, "client models not logged: clients are evaluated with the global model"
    trained = store.clients()
    if len(trained) > limit:
        return (
            {},
            f"client models not logged: {len(trained)} trained clients > tracking.log_client_models={limit}",
        )
    never = num_clients - len(trained)
    note = (
        f"{never} never-selected clients still hold their initial model and are not logged" if never else ""
    )
    return {
        cid: client_model_state(s, client_cls.tested_model) for cid, s in store.states(trained).items()
    }, note

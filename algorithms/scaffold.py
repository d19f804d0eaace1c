"""SCAFFOLD: Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for Federated Learning"
(ICML 2020, arXiv:1910.06378), Alg. 1 with option II; a baseline of the FedCross paper (Sec. IV-A).

The server keeps the global model ``x`` and a control variate ``c``; client ``i`` keeps its own
``c_i`` (0 at the start). A selected client starts from ``y_i = x`` and takes its K local steps with
the gradient corrected for client drift

.. math::  y_i \\leftarrow y_i - \\eta_l \\big(g_i(y_i) - c_i + c\\big)

then updates its control variate (option II) and uploads ``y_i`` and ``\\Delta c_i = c_i^+ - c_i``

.. math::  c_i^+ = c_i - c + \\frac{1}{K \\eta_l} (x - y_i)

The server averages over the round's uploaders ``S`` and all ``N`` clients

.. math::  x \\leftarrow x + \\eta_g \\frac{1}{|S|} \\sum_{i \\in S} (y_i - x), \\qquad
           c \\leftarrow c + \\frac{1}{N} \\sum_{i \\in S} \\Delta c_i

Control variates cover the model's parameters (flattened in ``model.parameters()`` order); BatchNorm
statistics travel with ``y_i`` and are averaged like the weights.

Choices where the paper is silent:
- With SGD momentum (the FedCross paper trains every method with momentum 0.5) the divisor stays the
  paper's ``K eta_l``, as PFLlib's and FL-bench's SCAFFOLD have it. The distance a constant gradient
  moves the model in K momentum steps, ``eta_l sum_{k=1..K} (1 - beta^k) / (1 - beta)``, was tried
  as the divisor and trained worse: on the quickstart with momentum 0.5, seeds 0-2, the global model
  ended at 59 / 80 / 43 % against 95 / 97 / 96 % (docs/algorithms/scaffold.md). Momentum 0.9 (the
  quickstart's) diverges with either; ``configs/scaffold.yaml`` trains with plain SGD, as the paper.
- The correction is added to each parameter's gradient before the optimizer's step, so weight decay
  and gradient clipping act on the corrected gradient, as on any gradient.
- A client that takes no step in a round (``local_epochs`` 0, or fewer samples than one batch with
  ``train.drop_last``) keeps its ``c_i`` and uploads ``Delta c_i = 0``. K counts the optimizer's
  steps: a ``16-mixed`` step the loss scaler skips for an inf gradient is not one.
- ``train.optimizer`` other than sgd is refused: an Adam step is not ``lr`` times a gradient.
- ``train.keep_optimizer_state`` is refused: a momentum buffer carried in from the last round moves
  the model by more than the round's own gradients, and option II would count it as this round's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn
from torch.nn.utils import parameters_to_vector

from fedray.platform.api import (
    AlgorithmConfig,
    ClientModule,
    ConfigError,
    ExperimentConfig,
    Payload,
    RunningMean,
    Server,
    cpu_state,
    register,
    unweighted_models,
)

# ------------------------------------------------------------------------------------------- the math


def updated_control(anchor: Tensor, trained: Tensor, correction: Tensor, steps: int, lr: float) -> Tensor:
    """Option II's ``c_i^+ = c_i - c + (x - y_i) / (K eta_l)``, written with the round's correction
    ``c - c_i`` the client trained with: ``(x - y_i) / (K eta_l) - (c - c_i)``. All ``[P]``."""
    return (anchor - trained) / (steps * lr) - correction


def server_step(global_value: Tensor, mean_value: Tensor, server_lr: float) -> Tensor:
    """``x + eta_g (mean_i y_i - x)``: the server's step along the mean client update."""
    return global_value + server_lr * (mean_value - global_value)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ------------------------------------------------------------------------------------------- server half


class ScaffoldServer(Server):
    """Holds ``x`` (the global model) and ``c`` (``[P]``); sends both, folds in ``y_i`` and ``Delta c_i``."""

    hp: ScaffoldConfig
    UPLINK_KEYS: ClassVar[tuple[str, ...]] = ("model", "delta_control")
    STATE: ClassVar[tuple[str, ...]] = ("model", "control")

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.model = ctx.make_model(0)
        self.control = torch.zeros(parameter_count(self.model))
        self.summed = RunningMean()  # this round's uploaded models, summed as they arrive

    def configure(self, rnd: int, selected: list[int]) -> dict[int, Payload]:
        return self.broadcast(selected, {"model": cpu_state(self.model), "control": self.control.clone()})

    def uplinks_arrived(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        self.summed.add(rnd, unweighted_models(uplinks))

    def aggregate(self, rnd: int, uplinks: dict[int, Payload]) -> None:
        if not uplinks:
            return
        mean = self.summed.mean(rnd, unweighted_models(uplinks))  # 1/|S| sum_i y_i (Alg. 1, line 16)
        state = self.model.state_dict()
        self.model.load_state_dict(
            {
                k: server_step(v, mean[k], self.hp.server_lr) if v.is_floating_point() else mean[k]
                for k, v in state.items()
            }
        )
        total = torch.zeros_like(self.control, dtype=torch.float64)
        for uplink in uplinks.values():
            total += uplink["delta_control"]
        self.control = (self.control + total / self.ctx.num_clients).to(self.control.dtype)

    def global_model(self) -> nn.Module:
        return self.model


# ------------------------------------------------------------------------------------------- client half


class ScaffoldClient(ClientModule):
    """Trains the received ``x`` with drift-corrected gradients; keeps ``c_i`` across rounds."""

    hp: ScaffoldConfig
    control: Tensor  # c_i: a persistent buffer, in the client's committed state
    anchor: Tensor  # held: x, the model this round started from
    correction: Tensor  # held: c - c_i, added to every gradient
    delta_control: Tensor  # held: c_i^+ - c_i, set when local training ends

    def __init__(self, model, ctx) -> None:
        super().__init__(model, ctx)
        self.register_buffer("control", torch.zeros(parameter_count(model)))  # c_i, checkpointed

    def receive(self, rnd: int, payload: Payload) -> None:
        super().receive(rnd, payload)
        self.hold("anchor", parameters_to_vector(self.model.parameters()).detach())
        self.hold("correction", payload["control"].to(self.control.device) - self.control)
        self.hold("delta_control", torch.zeros_like(self.control))  # unless it trains

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # K is the steps the optimizer took: a 16-mixed step the loss scaler skips (an inf gradient)
        # moves nothing, and Lightning's global_step, which counts it, would shrink option II's c_i^+
        optimizer = super().configure_optimizers()
        self.steps_taken = 0
        optimizer.register_step_post_hook(self.count_step)
        return optimizer

    def count_step(self, optimizer, args, kwargs) -> None:
        self.steps_taken += 1

    def on_before_optimizer_step(self, optimizer) -> None:
        start = 0
        for p in self.model.parameters():
            n = p.numel()
            if p.grad is not None:
                p.grad.add_(self.correction[start : start + n].view_as(p))
            start += n

    def on_train_end(self) -> None:
        steps = self.steps_taken
        if steps == 0:
            return
        trained = parameters_to_vector(self.model.parameters()).detach()
        new_control = updated_control(self.anchor, trained, self.correction, steps, self.round_lr())
        self.hold("delta_control", new_control - self.control)
        self.control.copy_(new_control)

    def upload(self) -> Payload:
        return {
            "model": cpu_state(self.model),
            "delta_control": self.delta_control.detach().to("cpu", copy=True),
        }


@register("scaffold", server=ScaffoldServer, client=ScaffoldClient)
@dataclass
class ScaffoldConfig(AlgorithmConfig):
    WHOLE_MODEL: ClassVar[bool] = True  # x, c and every c_i are over one architecture's parameters
    server_lr: float = 1.0  # eta_g, the global step size (Alg. 1); 1 makes x the uploaders' mean

    def validate(self, cfg: ExperimentConfig) -> None:
        if not self.server_lr > 0:
            raise ConfigError(f"scaffold.server_lr={self.server_lr}: must be > 0")
        if cfg.train.optimizer != "sgd":
            raise ConfigError(
                f"train.optimizer={cfg.train.optimizer} with algorithm=scaffold: option II reads the "
                "displacement over K * lr as the mean gradient, which only an SGD step makes it; use sgd"
            )
        if cfg.train.keep_optimizer_state:
            raise ConfigError(
                "train.keep_optimizer_state=true with algorithm=scaffold: a momentum buffer carried across "
                "rounds breaks option II's control-variate estimate (the control variates are its memory)"
            )

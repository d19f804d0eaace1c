"""Local training: the worker's own loop over a ClientModule's Lightning hooks.

An algorithm's client half is a LightningModule; what drives it is this loop, built once per worker
and used for every client the worker trains. It calls the hooks Lightning's automatic optimisation
calls, in Lightning's order (``configure_optimizers``, ``train_dataloader``, ``on_train_start``,
``on_train_epoch_start``, the batch-transfer hooks, ``training_step``, ``on_before_zero_grad``,
``on_before_backward``, ``on_after_backward``, ``on_before_optimizer_step``, ``on_train_batch_end``,
``on_train_epoch_end``, ``on_train_end``), with ``train.grad_clip``, ``train.precision`` and
``train.keep_optimizer_state`` applied by the platform.

Why not ``lightning.Trainer``: a fit through it costs a client about 25-30 ms of set-up and hook
dispatch on this project's CPU (measured in one process on the cross-device shape, 5 steps of the
FedAvg CNN at batch 10: 75 ms a client through the Trainer, 46 ms through this loop, 45 ms for a
hand-written loop; Lightning Fabric's ``setup`` per client was 50 ms), and a cross-device client
trains for about 30 ms. A Trainer also moves the module between devices and empties the CUDA cache
around every fit. Hooks this loop does not call are refused up front (:mod:`fedray.platform.api.contract`),
so an algorithm never silently loses one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import torch

from fedray.platform.config import TrainConfig
from fedray.platform.data.augment import crop_flip
from fedray.platform.errors import ContractError


def single_optimizer(configured: Any, who: str) -> tuple[torch.optim.Optimizer, list[dict[str, Any]]]:
    """The optimizer and its schedulers from ``configure_optimizers``'s return value, in the forms
    Lightning accepts for one optimizer: an optimizer, ``[opt]``, ``([opt], [sched])`` or
    ``{"optimizer": opt, "lr_scheduler": sched | {"scheduler": sched, "interval": ..., "frequency": ...}}``."""
    schedulers: list[Any] = []
    if isinstance(configured, dict):
        opt, sched = configured.get("optimizer"), configured.get("lr_scheduler")
        schedulers = [] if sched is None else [sched]
    elif isinstance(configured, (list, tuple)) and len(configured) == 2 and isinstance(configured[0], list):
        (opts, schedulers) = configured
        opt = opts[0] if len(opts) == 1 else None
    elif isinstance(configured, (list, tuple)):
        opt = configured[0] if len(configured) == 1 else None
    else:
        opt = configured
    if not isinstance(opt, torch.optim.Optimizer):
        raise ContractError(f"{who}.configure_optimizers must return one optimizer, got {configured!r:.80}")
    specs = []
    for sched in schedulers:
        spec = dict(sched) if isinstance(sched, dict) else {"scheduler": sched}
        specs.append({"interval": "epoch", "frequency": 1, **spec})
    return opt, specs


def training_loss(output: Any, who: str) -> torch.Tensor | None:
    """The loss a ``training_step`` returned: a tensor, a dict with ``loss``, or None (skip the step)."""
    if output is None or torch.is_tensor(output):
        return output
    if isinstance(output, dict) and torch.is_tensor(output.get("loss")):
        return output["loss"]
    raise ContractError(f"{who}.training_step must return a loss tensor, a dict with 'loss', or None")


class LocalTraining:
    """One worker's training loop: its device and precision, shared by every client it trains."""

    def __init__(self, train: TrainConfig, device: torch.device) -> None:
        self.cfg = train
        self.device = device
        self.autocast_dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(train.precision)

    def autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def fit(self, module, epochs: int, augment_gen: torch.Generator | None = None) -> None:
        """``epochs`` epochs of ``module``'s ``training_step`` over its ``train_dataloader``; with
        ``augment_gen``, every training batch is ``crop_flip``ped with draws from it (``data.augment``)."""
        who = type(module).__name__
        optimizer, schedulers = single_optimizer(module.configure_optimizers(), who)
        if self.cfg.keep_optimizer_state and module._optimizer_state is not None:
            optimizer.load_state_dict(module._optimizer_state)
        # a fresh loss scale per fit, as a fresh Trainer had: it never depends on the worker's history
        scaler = torch.amp.GradScaler(self.device.type) if self.cfg.precision == "16-mixed" else None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        batches: Iterable = module.train_dataloader()
        module.train()
        module.on_train_start()
        step = 0
        for epoch in range(epochs):
            module.on_train_epoch_start()
            for batch_idx, batch in enumerate(batches):
                batch = module.on_before_batch_transfer(batch, 0)
                batch = module.transfer_batch_to_device(batch, self.device, 0)
                batch = module.on_after_batch_transfer(batch, 0)
                if module.on_train_batch_start(batch, batch_idx) == -1:
                    break  # Lightning's meaning: skip the rest of this epoch
                if augment_gen is not None:
                    x, y = batch
                    batch = (crop_flip(x, augment_gen), y)
                self.step(module, optimizer, scaler, params, batch, batch_idx, who)
                step += 1
                step_schedulers(schedulers, "step", step)
            module.on_train_epoch_end()
            step_schedulers(schedulers, "epoch", epoch + 1)
        module.on_train_end()
        if self.cfg.keep_optimizer_state:
            module._optimizer_state = optimizer.state_dict()

    def step(self, module, optimizer, scaler, params, batch, batch_idx: int, who: str) -> None:
        """One optimisation step, in the order of Lightning's automatic optimisation."""
        with self.autocast():
            output = module.training_step(batch, batch_idx)
        loss = training_loss(output, who)
        if loss is None:
            return
        module.on_before_zero_grad(optimizer)
        optimizer.zero_grad()
        module.on_before_backward(loss)
        (loss if scaler is None else scaler.scale(loss)).backward()
        module.on_after_backward()
        if scaler is not None:
            scaler.unscale_(optimizer)
        module.on_before_optimizer_step(optimizer)
        if self.cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, self.cfg.grad_clip)
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        module.on_train_batch_end(output, batch, batch_idx)


def step_schedulers(schedulers: list[dict[str, Any]], interval: str, count: int) -> None:
    for spec in schedulers:
        if spec["interval"] == interval and count % spec["frequency"] == 0:
            spec["scheduler"].step()

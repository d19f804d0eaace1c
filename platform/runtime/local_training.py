"""Local training: the worker's own loop over a ClientModule's Lightning hooks.

An algorithm's client half is a LightningModule; what drives it is this loop, built once per worker
and used for every client the worker trains. It calls what a fresh ``Trainer(max_epochs=E).fit``
with automatic optimisation calls, in Lightning's order: ``setup("fit")``, ``configure_optimizers``,
``on_fit_start``, ``train_dataloader``, ``on_train_start``, then per epoch ``on_train_epoch_start``
and per batch the batch-transfer hooks, ``on_train_batch_start`` (-1 ends the epoch),
``training_step``, ``on_before_zero_grad``, ``on_before_backward``, ``on_after_backward``,
``on_before_optimizer_step``, the schedulers (Lightning's intervals and frequencies),
``on_train_batch_end``; then ``on_train_epoch_end``, ``on_train_end``, ``on_fit_end`` and
``teardown("fit")``. ``current_epoch`` and ``global_step`` count as that Trainer's would, from 0 in
every fit. ``train.grad_clip``, ``train.precision`` and ``train.keep_optimizer_state`` are applied by
the platform. ``tests/test_local_training.py`` holds the loop to a real ``Trainer``, hook by hook.

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
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch

from fedray.platform.config import TrainConfig
from fedray.platform.data.augment import crop_flip
from fedray.platform.errors import ContractError


def single_optimizer(configured: Any, who: str) -> tuple[torch.optim.Optimizer, list[dict[str, Any]]]:
    """The optimizer and its schedulers from ``configure_optimizers``'s return value, in the forms
    Lightning accepts for one optimizer: an optimizer, ``[opt]``, ``([opt], [sched])`` (or a bare
    ``sched``) or ``{"optimizer": opt, "lr_scheduler": sched | {"scheduler": sched, "interval": ...,
    "frequency": ...}}``. What this loop cannot step as Lightning would is refused in one line."""
    schedulers: list[Any] = []
    if isinstance(configured, dict):
        opt, sched = configured.get("optimizer"), configured.get("lr_scheduler")
        schedulers = [] if sched is None else [sched]
    elif isinstance(configured, (list, tuple)) and len(configured) == 2 and isinstance(configured[0], list):
        (opts, sched) = configured
        schedulers = list(sched) if isinstance(sched, (list, tuple)) else [sched]
        opt = opts[0] if len(opts) == 1 else None
    elif isinstance(configured, (list, tuple)):
        opt = configured[0] if len(configured) == 1 else None
    else:
        opt = configured
    if not isinstance(opt, torch.optim.Optimizer):
        raise ContractError(f"{who}.configure_optimizers must return one optimizer, got {kinds(configured)}")
    return opt, [scheduler_spec(sched, who) for sched in schedulers]


def kinds(value: Any) -> str:
    """What a value is, in one line (an optimizer's repr spans many)."""
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {len(value)} ({', '.join(type(v).__name__ for v in value)})"
    return "None" if value is None else f"a {type(value).__name__}"


def scheduler_spec(sched: Any, who: str) -> dict[str, Any]:
    """A scheduler with Lightning's defaults (``interval="epoch"``, ``frequency=1``), checked."""
    spec = dict(sched) if isinstance(sched, dict) else {"scheduler": sched}
    spec = {"interval": "epoch", "frequency": 1, **spec}
    where = f"{who}.configure_optimizers"
    scheduler = spec.get("scheduler")
    if not callable(getattr(scheduler, "step", None)):
        raise ContractError(
            f"{where}: a learning-rate scheduler must have a step() method, got {kinds(scheduler)}"
        )
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) or spec.get("reduce_on_plateau"):
        raise ContractError(
            f"{where}: ReduceLROnPlateau steps on a monitored metric, which fedray's worker loop does not "
            "track (there is no validation loop); use a scheduler that steps on its own"
        )
    if spec["interval"] not in ("step", "epoch"):
        raise ContractError(f"{where}: scheduler interval {spec['interval']!r} must be 'step' or 'epoch'")
    frequency = spec["frequency"]
    if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
        raise ContractError(f"{where}: scheduler frequency {frequency!r} must be a whole number >= 1")
    return spec


def carry_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """``train.keep_optimizer_state``: the client's per-parameter state from its last round (SGD's
    momentum buffers, Adam's moments) goes into this round's optimizer, whose settings (the learning rate, as this
    round's ``configure_optimizers`` and schedulers set it) stay as they are."""
    optimizer.load_state_dict(
        {"state": saved["state"], "param_groups": optimizer.state_dict()["param_groups"]}
    )


def batch_outputs(output: Any, loss: torch.Tensor | None) -> dict[str, Any]:
    """What ``on_train_batch_end`` receives, as Lightning builds it: ``{"loss": <detached>}`` plus the
    other keys of a returned dict; ``{}`` for a step ``training_step`` skipped (returned None)."""
    if loss is None:
        return {}
    extra = {k: v for k, v in output.items() if k != "loss"} if isinstance(output, dict) else {}
    return {"loss": loss.detach(), **extra}


_END = object()


def with_last(batches: Iterable) -> Iterator[tuple[int, Any, bool]]:
    """``(batch_idx, batch, is_last)``: one batch read ahead, as Lightning's data fetcher does, so the
    last batch of an epoch is known when it is trained (epoch schedulers step in it)."""
    iterator = iter(batches)
    ahead = next(iterator, _END)
    batch_idx = 0
    while ahead is not _END:
        batch, ahead = ahead, next(iterator, _END)
        yield batch_idx, batch, ahead is _END
        batch_idx += 1


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
        """``epochs`` epochs of ``module``'s ``training_step`` over its ``train_dataloader``, with the
        hooks a fresh ``Trainer(max_epochs=epochs).fit(module)`` calls, in its order; with
        ``augment_gen``, every training batch is ``crop_flip``ped with draws from it (``data.augment``)."""
        who = type(module).__name__
        if not module.automatic_optimization:  # set in __init__ or a property: the class check misses it
            raise ContractError(
                f"{who}.automatic_optimization is False; fedray's worker loop runs automatic optimisation "
                "only (return the loss from training_step)"
            )
        # current_epoch and global_step as a fresh Trainer's, written past nn.Module.__setattr__
        # (about 3 us a write, once a step)
        progress = module.__dict__
        progress.update(_fit_epoch=0, _fit_step=0)
        module.setup("fit")
        optimizer, schedulers = single_optimizer(module.configure_optimizers(), who)
        if self.cfg.keep_optimizer_state and module._optimizer_state is not None:
            carry_optimizer_state(optimizer, module._optimizer_state)
        # a fresh loss scale per fit, as a fresh Trainer had: it never depends on the worker's history
        scaler = torch.amp.GradScaler(self.device.type) if self.cfg.precision == "16-mixed" else None
        params = [p for group in optimizer.param_groups for p in group["params"]]
        module.on_fit_start()
        module.zero_grad()  # as a Trainer's fit starts: no gradient left by the model's last client
        batches: Iterable = module.train_dataloader()
        if isinstance(batches, Sized) and len(batches) == 0:
            epochs = 0  # Lightning skips the training loop, its hooks with it: fewer samples than a batch
        else:
            module.on_train_start()  # each submodule in the mode it is in, as Lightning leaves them
        for epoch in range(epochs):
            progress["_fit_epoch"] = epoch
            module.on_train_epoch_start()
            for batch_idx, batch, last in with_last(batches):
                batch = module.on_before_batch_transfer(batch, 0)
                batch = module.transfer_batch_to_device(batch, self.device, 0)
                batch = module.on_after_batch_transfer(batch, 0)
                # -1: Lightning's "skip the rest of this epoch"
                stop = module.on_train_batch_start(batch, batch_idx) == -1
                if not stop:
                    if augment_gen is not None:
                        x, y = batch
                        batch = (crop_flip(x, augment_gen), y)
                    outputs = self.step(module, optimizer, scaler, params, batch, batch_idx, who)
                    progress["_fit_step"] += 1
                # Lightning steps schedulers after each batch, the epoch's in its last (or a stopped) one
                step_schedulers(schedulers, "step", batch_idx + 1)
                if last or stop:
                    step_schedulers(schedulers, "epoch", epoch + 1)
                if stop:
                    break
                module.on_train_batch_end(outputs, batch, batch_idx)
            module.on_train_epoch_end()
        if epochs:
            progress["_fit_epoch"] = epochs
            module.on_train_end()
        if self.cfg.keep_optimizer_state:
            module._optimizer_state = optimizer.state_dict()
        module.on_fit_end()
        module.teardown("fit")

    def step(self, module, optimizer, scaler, params, batch, batch_idx: int, who: str) -> dict[str, Any]:
        """One optimisation step, in the order of Lightning's automatic optimisation; returns what
        ``on_train_batch_end`` gets. A step whose ``training_step`` returned None runs the hooks
        around the backward it skips, and changes no parameter (none has a gradient)."""
        with self.autocast():
            output = module.training_step(batch, batch_idx)
        loss = training_loss(output, who)
        module.on_before_zero_grad(optimizer)
        optimizer.zero_grad()
        if loss is not None:
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
        elif loss is not None:
            scaler.step(optimizer)
            scaler.update()
        return batch_outputs(output, loss)


def step_schedulers(schedulers: list[dict[str, Any]], interval: str, count: int) -> None:
    for spec in schedulers:
        if spec["interval"] == interval and count % spec["frequency"] == 0:
            spec["scheduler"].step()

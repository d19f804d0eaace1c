"""The worker's own training loop held to a real ``lightning.Trainer``: the same module, fitted once by
each, must call the same hooks in the same order with the same ``current_epoch``, ``global_step``,
learning rate and ``on_train_batch_end`` outputs, and end with the same weights, bit for bit.

Without Ray: the loop is :class:`fedray.platform.runtime.local_training.LocalTraining`, as a worker
builds it; the Trainer is Lightning's, on the CPU, with everything it would add switched off.
"""

from __future__ import annotations

import logging
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedray.algorithms.fedavg import FedAvgClient
from fedray.platform.api.algorithm import ClientContext, FitProgress
from fedray.platform.api.lightning_import import lightning as L
from fedray.platform.catalog import load_config
from fedray.platform.config import TrainConfig
from fedray.platform.data import ArrayDataset
from fedray.platform.errors import ContractError
from fedray.platform.models import FedModel
from fedray.platform.runtime.local_training import LocalTraining, carry_optimizer_state
from fedray.platform.tracking.descriptions import run_description

RECORDED = (
    "setup", "configure_optimizers", "on_fit_start", "train_dataloader", "on_train_start",
    "on_train_epoch_start", "on_before_batch_transfer", "transfer_batch_to_device",
    "on_after_batch_transfer", "on_train_batch_start", "training_step", "on_before_zero_grad",
    "on_before_backward", "on_after_backward", "on_before_optimizer_step", "on_train_batch_end",
    "on_train_epoch_end", "on_train_end", "on_fit_end", "teardown",
)  # fmt: skip


class Batches:
    """Eleven samples in batches of 3 (the last one short), the same every epoch; ``empty``: none (a
    client with fewer samples than a batch, whose last batch is dropped)."""

    def __init__(self, empty: bool = False) -> None:
        g = torch.Generator().manual_seed(1)
        self.x, self.y = torch.randn(11, 4, generator=g), torch.randint(0, 3, (11,), generator=g)
        self.empty = empty

    def __len__(self) -> int:
        return 0 if self.empty else 4

    def __iter__(self):
        if self.empty:
            return iter([])
        return iter([(self.x[i : i + 3], self.y[i : i + 3]) for i in range(0, 11, 3)])


class Probe(L.LightningModule):
    """A module that writes down every hook either driver calls, with what it sees there.

    ``variant`` picks what it does: ``schedulers`` (a step scheduler every 3 batches and an epoch
    one), ``skips`` (training_step returns None once and a dict with an extra key once), ``stops``
    (on_train_batch_start returns -1 in the second epoch), ``frozen`` (a BatchNorm its __init__ puts
    in eval mode), ``empty`` (no batch at all), ``plain``."""

    def __init__(self, variant: str = "plain") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.variant = variant
        self.norm = torch.nn.BatchNorm1d(4)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        if variant == "frozen":
            self.norm.running_mean.fill_(0.5)
            self.norm.eval()
        self.calls: list[tuple] = []
        self._optimizer_state = None  # what the worker's loop keeps with train.keep_optimizer_state

    def note(self, hook: str, *seen) -> None:
        lr = self.opt.param_groups[0]["lr"] if hasattr(self, "opt") else None
        self.calls.append((hook, self.current_epoch, self.global_step, lr, self.norm.training, *seen))

    def setup(self, stage):
        self.note("setup", stage)

    def teardown(self, stage):
        self.note("teardown", stage)

    def configure_optimizers(self):
        self.note("configure_optimizers")
        self.opt = torch.optim.SGD(self.parameters(), lr=0.5, momentum=0.9, weight_decay=1e-3)
        if self.variant != "schedulers":
            return self.opt
        every_3_steps = torch.optim.lr_scheduler.StepLR(self.opt, 1, gamma=0.5)
        per_epoch = torch.optim.lr_scheduler.ExponentialLR(self.opt, gamma=0.9)
        return [self.opt], [{"scheduler": every_3_steps, "interval": "step", "frequency": 3}, per_epoch]

    def train_dataloader(self):
        self.note("train_dataloader")
        return Batches(empty=self.variant == "empty")

    def training_step(self, batch, batch_idx):
        self.note("training_step", batch_idx, torch.is_grad_enabled())
        x, y = batch
        loss = F.cross_entropy(self.net(self.norm(x)), y)
        if self.variant == "skips" and self.current_epoch == 0 and batch_idx == 1:
            return None
        if self.variant == "skips" and batch_idx == 2:
            return {"loss": loss, "seen": batch_idx}
        return loss

    def on_train_batch_start(self, batch, batch_idx):
        self.note("on_train_batch_start", batch_idx)
        if self.variant == "stops" and self.current_epoch == 1 and batch_idx == 2:
            return -1
        return None

    def on_train_batch_end(self, outputs, batch, batch_idx):
        shown = {k: (round(v.item(), 6) if torch.is_tensor(v) else v) for k, v in outputs.items()}
        self.note(
            "on_train_batch_end",
            batch_idx,
            shown,
            all(not torch.is_tensor(v) or not v.requires_grad for v in outputs.values()),
        )

    def on_before_backward(self, loss):
        self.note("on_before_backward", round(loss.item(), 6))

    def on_before_optimizer_step(self, optimizer):
        norms = [p.grad.norm().item() if p.grad is not None else None for p in self.parameters()]
        self.note("on_before_optimizer_step", [None if n is None else round(n, 5) for n in norms])


def _record(name: str):
    def hook(self, *args):
        self.note(name)
        return getattr(L.LightningModule, name)(self, *args)

    return hook


for _hook in ("on_fit_start", "on_train_start", "on_train_epoch_start", "on_before_zero_grad",
              "on_after_backward", "on_train_epoch_end", "on_train_end", "on_fit_end",
              "on_before_batch_transfer", "transfer_batch_to_device", "on_after_batch_transfer"):  # fmt: skip
    setattr(Probe, _hook, _record(_hook))


class FedProbe(FitProgress, Probe):
    """The same probe as the worker's loop sees a ClientModule: with its epoch and step counters."""


def quietly():
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


def by_trainer(variant: str, epochs: int = 2, grad_clip: float | None = None, precision: str = "32") -> Probe:
    quietly()
    module = Probe(variant)
    trainer = L.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        gradient_clip_val=grad_clip, precision=precision,
    )  # fmt: skip
    trainer.fit(module)
    return module


def by_loop(
    variant: str,
    epochs: int = 2,
    grad_clip: float | None = None,
    module: Probe | None = None,
    precision: str = "32",
) -> Probe:
    module = module if module is not None else FedProbe(variant)
    train = TrainConfig(grad_clip=grad_clip, precision=precision)  # type: ignore[arg-type]
    LocalTraining(train, torch.device("cpu")).fit(module, epochs)
    return module


@pytest.mark.parametrize(
    "variant,grad_clip",
    [
        ("plain", None),
        ("schedulers", None),
        ("skips", None),
        ("stops", None),
        ("frozen", None),
        ("plain", 0.05),
        ("empty", None),
    ],
)
def test_the_loop_calls_what_a_trainer_calls_in_its_order_and_ends_with_its_weights(variant, grad_clip):
    trainer, loop = by_trainer(variant, grad_clip=grad_clip), by_loop(variant, grad_clip=grad_clip)
    assert [c[0] for c in loop.calls] == [c[0] for c in trainer.calls]  # the order first: a clearer diff
    assert loop.calls == trainer.calls  # then what each hook saw: epoch, step, lr, modes, outputs
    if variant == "empty":  # no batch: the Trainer skips its training loop, and its hooks
        assert [c[0] for c in loop.calls] == [
            "setup", "configure_optimizers", "on_fit_start", "train_dataloader", "on_fit_end", "teardown"
        ]  # fmt: skip
    else:
        assert {c[0] for c in loop.calls} == set(RECORDED)  # the probe reached every hook it records
    for (name, mine), theirs in zip(loop.state_dict().items(), trainer.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs), name


def test_bf16_autocast_trains_as_a_bf16_mixed_trainer_does_and_not_as_float32():
    # the CPU's mixed precision (16-mixed needs a GPU, for the loop and for Lightning alike)
    trainer = by_trainer("plain", precision="bf16-mixed")
    loop = by_loop("plain", precision="bf16-mixed")
    assert loop.calls == trainer.calls
    for (name, mine), theirs in zip(loop.state_dict().items(), trainer.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs), name
    full = by_loop("plain").state_dict()
    assert not torch.equal(full["net.0.weight"], loop.state_dict()["net.0.weight"])  # autocast ran


def test_modes_are_the_authors_a_frozen_part_stays_frozen_through_the_platforms_evaluation():
    from fedray.platform.runtime.worker import evaluate_model

    module = by_loop("frozen")
    evaluate_model(module, torch.randn(5, 4), torch.zeros(5, dtype=torch.long), "cpu", scores=module.net)
    assert not module.norm.training and module.net.training and module.training  # each its own back
    module.calls.clear()
    by_loop("frozen", module=module)
    assert {c[4] for c in module.calls if c[0] == "training_step"} == {False}  # the BatchNorm: eval
    module.norm.train()  # what an author's receive() may do between rounds: the loop leaves it so
    module.calls.clear()
    by_loop("frozen", module=module)
    assert {c[4] for c in module.calls if c[0] == "training_step"} == {True}


def test_kept_optimizer_state_carries_momentum_but_not_last_rounds_learning_rate():
    class Decaying(FedProbe):
        round_lr = 0.5

        def configure_optimizers(self):
            self.opt = torch.optim.SGD(self.parameters(), lr=self.round_lr, momentum=0.9)
            return self.opt

    module = Decaying()
    loop = LocalTraining(TrainConfig(keep_optimizer_state=True), torch.device("cpu"))
    loop.fit(module, 1)
    saved = module._optimizer_state
    momentum = {i: s["momentum_buffer"].clone() for i, s in saved["state"].items()}
    module.round_lr = 0.05  # this round's configure_optimizers says so
    seen = {}
    module.on_train_start = lambda: seen.update(
        lr=module.opt.param_groups[0]["lr"],
        momentum={
            i: module.opt.state[p]["momentum_buffer"].clone() for i, p in enumerate(module.parameters())
        },
    )
    loop.fit(module, 1)
    assert seen["lr"] == 0.05  # not the 0.5 the saved state holds
    assert seen["momentum"].keys() == momentum.keys()
    assert all(torch.equal(seen["momentum"][i], momentum[i]) for i in momentum)


@pytest.mark.parametrize(
    "configured,message",
    [
        (lambda opt: {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt)},
         "ReduceLROnPlateau steps on a monitored metric"),
        (lambda opt: {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1), "interval": "batch"}},
         "scheduler interval 'batch' must be 'step' or 'epoch'"),
        (lambda opt: {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1), "frequency": 0}},
         "scheduler frequency 0 must be a whole number >= 1"),
        (lambda opt: {"optimizer": opt, "lr_scheduler": {"interval": "step"}},
         "a learning-rate scheduler must have a step\\(\\) method"),
        (lambda opt: [opt, opt], "must return one optimizer"),
    ],
)  # fmt: skip
def test_what_the_loop_cannot_step_as_lightning_would_is_refused_in_one_line(configured, message):
    class Configured(FedProbe):
        def configure_optimizers(self):
            return configured(torch.optim.SGD(self.parameters(), lr=0.1))

    with pytest.raises(ContractError, match=message) as err:
        by_loop("plain", module=Configured())
    assert "\n" not in str(err.value) and str(err.value).startswith("Configured.configure_optimizers")


def test_a_bare_scheduler_beside_the_optimizer_list_steps_as_lightning_steps_it():
    class Bare(Probe):
        def configure_optimizers(self):
            self.opt = torch.optim.SGD(self.parameters(), lr=0.5)
            return [self.opt], torch.optim.lr_scheduler.ExponentialLR(self.opt, gamma=0.5)

    class FedBare(FitProgress, Bare):
        pass

    quietly()
    trainer = Bare()
    L.Trainer(max_epochs=3, accelerator="cpu", logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(trainer)  # fmt: skip
    loop = by_loop("plain", epochs=3, module=FedBare())
    assert loop.opt.param_groups[0]["lr"] == trainer.opt.param_groups[0]["lr"] == 0.0625
    assert loop.calls == trainer.calls


def test_manual_optimisation_set_in_init_is_refused_when_the_fit_starts():
    class Manual(FedProbe):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(
        ContractError, match=r"^Manual\.automatic_optimization is False; fedray's worker loop"
    ):
        by_loop("plain", module=Manual())


@pytest.mark.parametrize(
    "hook", ["on_save_checkpoint", "configure_model", "on_validation_epoch_end", "val_dataloader"]
)
def test_a_hook_no_fit_of_the_loop_calls_is_refused_by_name(hook):
    from fedray.platform.api.algorithm import ClientModule
    from fedray.platform.api.contract import check_client_class

    client = type("HookedClient", (ClientModule,), {hook: lambda self, *args: None})
    with pytest.raises(ContractError) as err:
        check_client_class("hooked", client, ClientModule)
    assert str(err.value).startswith(
        f"algorithm 'hooked': HookedClient overrides LightningModule.{hook}, which fedray's worker loop does not call ("
    )
    check_client_class("hooked", type("Plain", (ClientModule,), {}), ClientModule)  # the base passes


@pytest.mark.parametrize(
    "value,shown",
    [
        (torch.ones(3), "a tensor of shape (3,)"),
        ([1.0, 2.0], "[1.0, 2.0]"),
        (np.ones((2, 2)), "array([[1., 1.], [1., 1.]])"),  # its repr spans two lines; the error one
    ],
)
def test_a_statistic_that_is_not_one_number_is_refused_where_it_is_recorded(value, shown):
    from fedray.platform.api.algorithm import ClientModule

    module = ClientModule.__new__(ClientModule)  # record() needs only its statistics
    module._stats = {}
    with pytest.raises(
        ContractError,
        match="^" + re.escape(f"ClientModule: statistic 'loss/x' must be one number, got {shown}"),
    ):
        module.record("loss/x", value)
    module.record("loss/x", torch.tensor([2.0]))  # one number, whatever its shape
    module.record("loss/x", 4)
    assert module.pop_stats() == {"loss/x": 3.0}


def test_the_clients_lr_decays_by_round_and_a_carried_optimizer_state_keeps_the_rounds_lr():
    cfg = load_config(None, ["train.lr=0.08", "train.lr_decay=0.5", "train.keep_optimizer_state=true"])
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    fed = FedModel(model, 3, 3, arch="flat", in_channels=1, image_size=2)
    client = FedAvgClient(
        fed, ClientContext(0, cfg, 3, ArrayDataset(torch.zeros(2, 1, 2, 2), torch.tensor([0, 1])))
    )
    client.begin_round(1, {"model": fed.state_dict()})
    earlier = client.configure_optimizers()
    assert earlier.param_groups[0]["lr"] == pytest.approx(0.04)
    client.begin_round(3, {"model": fed.state_dict()})
    now = client.configure_optimizers()
    assert client.round_lr() == pytest.approx(0.01) and now.param_groups[0]["lr"] == pytest.approx(0.01)
    carry_optimizer_state(now, earlier.state_dict())  # round 1's momentum, round 3's lr
    assert now.param_groups[0]["lr"] == pytest.approx(0.01)


@pytest.mark.parametrize(
    "name,kind", [("sgd", torch.optim.SGD), ("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)]
)
def test_the_clients_optimizer_is_train_optimizer_with_momentum_as_adams_beta1(name, kind):
    settings = ["train.lr=0.003", "train.momentum=0.8", "train.weight_decay=0.01"]
    cfg = load_config(None, [f"train.optimizer={name}", *settings])
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    fed = FedModel(model, 3, 3, arch="flat", in_channels=1, image_size=2)
    client = FedAvgClient(
        fed, ClientContext(0, cfg, 3, ArrayDataset(torch.zeros(2, 1, 2, 2), torch.tensor([0, 1])))
    )
    optimizer = client.configure_optimizers()
    assert type(optimizer) is kind
    group = optimizer.param_groups[0]
    assert group["lr"] == 0.003 and group["weight_decay"] == 0.01
    if name == "sgd":
        assert group["momentum"] == 0.8
    else:
        assert group["betas"] == (0.8, 0.999)
    assert [p for g in optimizer.param_groups for p in g["params"]] == list(client.parameters())


def test_the_run_description_names_the_optimizer_and_its_settings():
    adamw = load_config(None, ["train.optimizer=adamw", "train.lr=0.001", "train.weight_decay=0.01"])
    assert "AdamW lr 0.001 beta1 0.9 weight decay 0.01;" in run_description(adamw)
    sgd = load_config(None, ["train.lr=0.05", "train.lr_decay=0.99"])
    assert "SGD lr 0.05 x 0.99^round momentum 0.9;" in run_description(sgd)

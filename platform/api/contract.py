"""The rules of the algorithm contract, each failure one line (:class:`ContractError`) naming the rule.

What a client class shows in its code is checked once per process when its algorithm is looked up,
before the run starts (:func:`check_client_class`): the worker drives a client with its own loop
over Lightning's hooks (:mod:`fedray.platform.runtime.local_training`), so the hooks that loop does
not call, manual optimisation and an override of the platform's entry point are refused, and the
evaluation mode must agree with the methods the class overrides. What only a running client shows
is checked on the first client each worker trains (:func:`check_downlink_read`,
:func:`check_held_tensors`), on every client (:func:`check_parameters_apart`) and on every round's
uplinks (:func:`check_uplinks`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from fedray.platform.api.lightning_import import lightning as L
from fedray.platform.data import ArrayDataset
from fedray.platform.errors import ContractError

BUILT_ONCE = "the worker builds a client's module once and reuses it: build the model in __init__"
CLIENT_STATE = "a client's checkpointed state is its state_dict and, with train.keep_optimizer_state, its optimizer's state"
EVALUATED = "evaluation is the platform's: override eval_logits"

# Lightning hooks whose overrides the loop would not honour: an algorithm that overrides one is
# refused with one line when the run is configured (not half-way through a round).
UNSUPPORTED_HOOKS = {
    "optimizer_step": "the platform steps the optimizer (train.grad_clip, train.precision)",
    "optimizer_zero_grad": "the platform zeroes the gradients before backward",
    "backward": "the platform calls loss.backward() (scaled under train.precision=16-mixed)",
    "configure_gradient_clipping": "set train.grad_clip instead",
    "lr_scheduler_step": "schedulers from configure_optimizers step by their interval",
    "configure_callbacks": "there is no Trainer to attach callbacks to",
    "validation_step": EVALUATED,
    "test_step": EVALUATED,
    "predict_step": EVALUATED,
    "configure_model": BUILT_ONCE,
    "configure_sharded_model": BUILT_ONCE,
    "prepare_data": "the platform prepares the data (the config's data section)",
    "on_save_checkpoint": CLIENT_STATE,
    "on_load_checkpoint": CLIENT_STATE,
}
# the evaluation loops' hooks and loaders: the platform evaluates (eval_logits, load_for_eval)
UNSUPPORTED_HOOKS.update(
    {
        name: EVALUATED
        for name in dir(L.LightningModule)
        if name.startswith(("on_validation", "on_test", "on_predict"))
        or name in ("val_dataloader", "test_dataloader", "predict_dataloader")
    }
)


# methods of ClientModule the platform calls and an algorithm does not override
PLATFORM_METHODS = {
    "begin_round": "override receive, which it calls after setting self.rnd",
    "hold": "it registers the buffer that moves with the module",
    "restore_held": "it puts every held tensor back as the module's construction held it, each call",
    "record": "it keeps the statistic for this round's mean",
    "pop_stats": "the worker reads the round's statistics with it",
}
EVAL_MODES = ("global", "own")


def check_client_class(name: str, client_cls: Any, base: Any) -> None:
    """One line naming the first rule ``client_cls`` (a subclass of ``base``, ClientModule) breaks: a
    platform method overridden, a hook the loop does not call, manual optimisation
    (``automatic_optimization = False``), or an evaluation mode its methods contradict."""
    for method, why in PLATFORM_METHODS.items():
        if getattr(client_cls, method) is not getattr(base, method):
            raise ContractError(
                f"algorithm {name!r}: {client_cls.__name__} overrides ClientModule.{method}, which the "
                f"platform owns ({why})"
            )
    for hook, why in UNSUPPORTED_HOOKS.items():
        if getattr(client_cls, hook, None) is not getattr(L.LightningModule, hook, None):
            raise ContractError(
                f"algorithm {name!r}: {client_cls.__name__} overrides LightningModule.{hook}, which "
                f"fedray's worker loop does not call ({why})"
            )
    if getattr(client_cls, "automatic_optimization", True) is False:
        raise ContractError(
            f"algorithm {name!r}: {client_cls.__name__} sets automatic_optimization=False; fedray's "
            "worker loop runs automatic optimisation only (return the loss from training_step)"
        )
    mode = getattr(client_cls, "eval_mode", None)
    if mode not in EVAL_MODES:
        raise ContractError(
            f"algorithm {name!r}: {client_cls.__name__}.eval_mode={mode!r}: must be one of {EVAL_MODES}"
        )
    if mode == "global" and client_cls.load_for_eval is not base.load_for_eval:
        raise ContractError(
            f"algorithm {name!r}: {client_cls.__name__} overrides load_for_eval, which eval_mode='global' "
            "never calls (every client is tested with the server's one model): set eval_mode = 'own'"
        )


# ------------------------------------------------------------------------------ a running client


class ReadKeys(dict):
    """A downlink that remembers which of its keys were read: the first client a worker trains gets
    its downlink this way, so a key ``receive`` never looks at is found (:func:`check_downlink_read`)."""

    def __init__(self, payload: Mapping[str, Any]) -> None:
        super().__init__(payload)
        self.read: set[str] = set()

    def __getitem__(self, key: str) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __contains__(self, key: object) -> bool:
        self.read.add(key)  # type: ignore[arg-type]
        return super().__contains__(key)

    def __iter__(self):
        self.read.update(super().keys())
        return super().__iter__()

    def items(self):  # type: ignore[override]
        self.read.update(super().keys())
        return super().items()

    def values(self):  # type: ignore[override]
        self.read.update(super().keys())
        return super().values()

    def unread(self) -> list[str]:
        return sorted(set(dict.keys(self)) - self.read)


def check_downlink_read(name: str, module: Any, payload: ReadKeys) -> None:
    """Every key of a downlink is read by ``receive``: one it never looks at is a model it forgot to
    load (an override that skipped ``super().receive``), or bytes sent for nothing."""
    for key in payload.unread():
        hint = (
            "call super().receive(rnd, payload), which loads it"
            if key == "model"
            else "read it, or stop sending it"
        )
        raise ContractError(
            f"algorithm {name!r}: {type(module).__name__}.receive never read downlink key {key!r} ({hint})"
        )


def storages(tree: Any) -> set[int]:
    """The memory of every tensor in a payload (nested mappings, lists and tuples), by address."""
    if torch.is_tensor(tree):
        if tree.layout != torch.strided:  # a sparse tensor has no storage of its own to share
            return set()
        address = tree.untyped_storage().data_ptr()
        return {address} if address else set()  # an empty tensor has none
    if isinstance(tree, Mapping):
        return {a for value in tree.values() for a in storages(value)}
    if isinstance(tree, (list, tuple)):
        return {a for value in tree for a in storages(value)}
    return set()


def check_parameters_apart(name: str, module: Any, sent: set[int], when: str) -> None:
    """No parameter, and no buffer of the model, shares memory with the downlink: a worker's clients
    share one downlink, and training writes into them, so one made a view of a downlink tensor
    (``vector_to_parameters(payload[...])``, ``p.data = payload[...]``) would change what the next
    client receives. ``.data`` keeps no version counter, so the worker's check of the downlink's
    versions after training cannot see it; this can. (Held tensors, the module's own buffers, may
    be the downlink's: training does not write them.) ``sent``: the downlink's :func:`storages`."""
    if not sent:
        return
    for tensor in (*module.parameters(), *module.model.buffers()):  # names only for the line
        if tensor.layout == torch.strided and tensor.untyped_storage().data_ptr() in sent:
            named = [*module.named_parameters(), *module.model.named_buffers(prefix="model")]
            tname = next(n for n, t in named if t is tensor)
            raise ContractError(
                f"algorithm {name!r}: {type(module).__name__}.{tname} shares memory with the downlink {when} "
                "(vector_to_parameters or .data = on a downlink tensor), so training would change the "
                "downlink the worker's other clients get; copy it in (param.copy_ under torch.no_grad(), "
                "or load_state_dict)"
            )


# a ClientModule's own bookkeeping (`_built_held`: what its construction held, put back through hold(),
# which moves each to the module's device), and nn.Module's registries (parameters and buffers)
OWN_ATTRIBUTES = {
    "_parameters",
    "_buffers",
    "_modules",
    "_stats",
    "_optimizer_state",
    "_built_held",
    "ctx",
    "hp",
}


HELD_DEPTH = 12  # containers nested deeper than this are not looked into (the walk always ends)


def contents(value: Any) -> Iterable[Any] | None:
    """What a container holds, as the held-tensor check walks it: a mapping's values, the items of a
    list, tuple, set or frozenset, a dataclass instance's fields; None for anything else, and for the
    client's data (an :class:`ArrayDataset`: ``ctx.train`` or a subset of it, FedL2G's quiz batch),
    which the worker put on the training device with the module."""
    if isinstance(value, ArrayDataset):
        return None
    if isinstance(value, Mapping):
        return value.values()
    if isinstance(value, (list, tuple, set, frozenset)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (getattr(value, f.name, None) for f in dataclasses.fields(value))
    return None


def holds_tensor(value: Any, depth: int = 0, seen: dict[int, tuple[int, Any]] | None = None) -> bool:
    """Whether ``value`` is a tensor or holds one, however its containers nest (:func:`contents`), to
    ``HELD_DEPTH`` levels. ``seen`` (container id -> the shallowest depth it was walked at, and the
    container, kept alive so its id is not reused) walks a container met again only when it is met
    higher up, so a cycle or a shared container ends."""
    if torch.is_tensor(value):
        return True
    items = contents(value)
    if items is None or depth >= HELD_DEPTH:
        return False
    seen = {} if seen is None else seen
    if seen.get(id(value), (HELD_DEPTH, None))[0] <= depth:
        return False
    seen[id(value)] = (depth, value)
    return any(holds_tensor(v, depth + 1, seen) for v in items)


def check_held_tensors(name: str, module: Any) -> None:
    """A client keeps tensors between calls through ``hold()`` (a buffer that moves with the module to
    its GPU), never as a plain attribute, which stays where it was made and fails the next step on a
    device mismatch (on a GPU only, where the run would see every client fail)."""
    for attr, value in vars(module).items():
        if attr not in OWN_ATTRIBUTES and holds_tensor(value):
            raise ContractError(
                f"algorithm {name!r}: {type(module).__name__} keeps a tensor in the plain attribute "
                f"self.{attr}, which does not move with the module to its device; keep it with "
                f"self.hold({attr!r}, value)"
            )


def check_tested_model(name: str, module: Any) -> None:
    """``tested_model`` names a model of the client's architecture, which the run logs as the
    client's model: one line, on the first client a worker trains, if it does not."""
    attr = type(module).tested_model
    tested, model = getattr(module, attr, None), module.model
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    if not (
        isinstance(tested, type(model))
        and getattr(tested, "arch", None) == getattr(model, "arch", None)
        and {k: v.shape for k, v in tested.state_dict().items()} == shapes
    ):
        raise ContractError(
            f"algorithm {name!r}: {type(module).__name__}.tested_model={attr!r} names no model of "
            f"self.model's architecture and shapes: name the submodule eval_logits scores"
        )


def check_uplinks(name: str, server: Any, uplinks: Mapping[int, Any]) -> None:
    """Every uplink carries exactly the keys its server declares it reads (``Server.uplink_keys``):
    a key the client half dropped fails here, in one line, not as a KeyError inside ``aggregate``."""
    declared = set(server.uplink_keys())
    who = type(server).__name__
    for cid, uplink in uplinks.items():
        if not isinstance(uplink, Mapping):
            raise ContractError(
                f"algorithm {name!r}: client {cid}'s upload() returned a {type(uplink).__name__}, not a payload mapping"
            )
        keys = set(uplink)
        if keys == declared:
            continue
        missing, extra = sorted(declared - keys), sorted(keys - declared)
        if missing:
            raise ContractError(
                f"algorithm {name!r}: client {cid}'s uplink lacks {missing[0]!r}, which {who} declares it "
                f"reads (uplink_keys: {sorted(declared)})"
            )
        raise ContractError(
            f"algorithm {name!r}: client {cid}'s uplink carries {extra[0]!r}, which {who} does not declare "
            f"(uplink_keys: {sorted(declared)}): declare it, or stop sending it"
        )

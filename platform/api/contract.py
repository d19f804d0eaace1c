"""The rules of the algorithm contract that a client class shows in its code, checked once per process
when its algorithm is looked up (before the run starts), each failure one line naming the rule.

The worker drives a client with its own loop over Lightning's hooks
(:mod:`fedray.platform.runtime.local_training`); the hooks that loop does not call, manual
optimisation and an override of the platform's own entry point are refused here.
"""

from __future__ import annotations

import lightning as L

from fedray.platform.errors import ContractError

# Lightning hooks whose overrides the loop would not honour: an algorithm that overrides one is
# refused with one line when the run is configured (not half-way through a round).
UNSUPPORTED_HOOKS = {
    "optimizer_step": "the platform steps the optimizer (train.grad_clip, train.precision)",
    "optimizer_zero_grad": "the platform zeroes the gradients before backward",
    "backward": "the platform calls loss.backward() (scaled under train.precision=16-mixed)",
    "configure_gradient_clipping": "set train.grad_clip instead",
    "lr_scheduler_step": "schedulers from configure_optimizers step by their interval",
    "configure_callbacks": "there is no Trainer to attach callbacks to",
    "validation_step": "evaluation is the platform's: override eval_logits",
    "test_step": "evaluation is the platform's: override eval_logits",
    "predict_step": "evaluation is the platform's: override eval_logits",
}


def check_client_class(name: str, client_cls: type) -> None:
    """One line naming the first rule ``client_cls`` breaks: a hook the loop does not call, or manual
    optimisation (``automatic_optimization = False``)."""
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

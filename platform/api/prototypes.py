"""Per-class tensors that several algorithms exchange: class means of representations (FedProto's,
FD's and FedSC's prototypes, FedL2G's averaged rows), the dense ``[K, C, ...]`` view of per-client
class-indexed rows (FedProto's prototypes, FedSSA's header rows) and its mean over the clients that
hold each class (FedSSA's Eq. 3, FedSC's Eq. 5), and one eval-mode pass of a model over a client's
samples, where prototypes computed after training come from (FedProto's ``collect=after``, FedSC,
FedGH)."""

from __future__ import annotations

import torch
from torch import Tensor

from fedray.platform.api.algorithm import batch_loader
from fedray.platform.api.frozen import eval_mode
from fedray.platform.data import ArrayDataset
from fedray.platform.models import FedModel


@torch.no_grad()
def eval_pass(model: FedModel, data: ArrayDataset, batch: int = 1024) -> tuple[Tensor, Tensor, Tensor]:
    """The model's logits ``[N, C]`` and representations ``[N, d]`` of every sample of ``data``, in
    order, in eval mode (each submodule back in its own mode after), without gradient; and the labels
    ``[N]``. On the model's device."""
    device = next(model.parameters()).device
    logits, reps, labels = [], [], []
    with eval_mode(model):
        for x, y in batch_loader(data, batch, shuffle=False):
            out, z = model.forward_with_features(x.to(device))
            logits.append(out)
            reps.append(z)
            labels.append(y.to(device))
    return torch.cat(logits), torch.cat(reps), torch.cat(labels)


def class_prototypes(z: Tensor, y: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """Per-class mean of the representations, and the per-class sample counts.

    Shape: ``z [N, d]``, ``y [N]`` int64 -> ``protos [C, d]`` (zero rows for absent classes),
    ``counts [C]`` int64.
    """
    counts = torch.bincount(y, minlength=num_classes)
    sums = z.new_zeros(num_classes, z.shape[1]).index_add_(0, y, z)
    return sums / counts.clamp(min=1).unsqueeze(1).to(z.dtype), counts


def masked_mean(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Per-class mean over the clients whose ``mask`` holds the class, and how many do.

    Shape: ``values [K, C, m]``, ``mask [K, C]`` bool -> ``mean [C, m]`` (zero rows where no client
    holds the class), ``count [C]`` int64. Values where ``mask`` is False are ignored (even NaN).
    """
    count = mask.sum(0)
    total = torch.where(mask.unsqueeze(-1), values, 0).sum(0)
    return total / count.clamp(min=1).unsqueeze(1).to(values.dtype), count


def scatter_rows(rows: list[Tensor], classes: list[Tensor], num_classes: int) -> tuple[Tensor, Tensor]:
    """Dense ``[K, C, m]`` rows and a ``[K, C]`` bool mask of which are present, from K clients' rows
    ``[k_i, m]`` for their classes ``[k_i]``, with one indexed write."""
    who = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor([len(c) for c in classes]))
    cls = torch.cat(classes)
    dense = rows[0].new_zeros(len(rows), num_classes, rows[0].shape[1])
    dense[who, cls] = torch.cat(rows)
    present = torch.zeros(len(rows), num_classes, dtype=torch.bool)
    present[who, cls] = True
    return dense, present

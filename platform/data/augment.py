"""Data augmentation on a client's training batches (``data.augment``), seeded like everything else.

``crop_flip`` is the CIFAR recipe (torchvision's ``RandomCrop(32, padding=4)`` and
``RandomHorizontalFlip``; FedSC's official code trains with it), applied to a whole batch of
normalised images at once. The padding is zero after normalisation, i.e. the dataset's mean colour
(torchvision pads the raw image with black before normalising).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PAD = 4


def crop_flip(x: torch.Tensor, gen: torch.Generator, pad: int = PAD, flip_share: float = 0.5) -> torch.Tensor:
    """Each image of ``x [B, C, H, W]`` shifted by a random crop of its ``pad``-padded self (offsets
    uniform in ``0..2*pad`` each way) and mirrored left-right with probability ``flip_share`` (0 for
    images a mirror changes the class of: digits, letters). Draws come from ``gen`` (a CPU generator),
    so the result depends only on its seed."""
    b, _, h, w = x.shape
    dy, dx = (torch.randint(0, 2 * pad + 1, (b,), generator=gen) for _ in range(2))
    flip = torch.rand(b, generator=gen) < flip_share
    rows = dy[:, None] + torch.arange(h)  # [B, H] rows of the padded image
    cols = dx[:, None] + torch.arange(w)  # [B, W]
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    if x.is_cuda:  # one copy a step, from pinned memory: a copy from pageable memory waits for the GPU
        index = torch.cat([rows, cols], dim=1).pin_memory().to(x.device, non_blocking=True)
        rows, cols = index[:, :h], index[:, h:]
    padded = F.pad(x, (pad, pad, pad, pad))
    batch = torch.arange(b, device=x.device)[:, None, None]
    out = padded.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]]  # [B, H, W, C]
    # in the layout it came in: channels_last (a CPU worker's images) is this memory as it is
    channels_last = x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
    layout = torch.channels_last if channels_last else torch.contiguous_format
    return out.permute(0, 3, 1, 2).contiguous(memory_format=layout)

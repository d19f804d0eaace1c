"""LEAF's reference models: the FEMNIST CNN and the Shakespeare and Sent140 stacked LSTMs.

Caldas et al. 2018, "LEAF: A Benchmark for Federated Settings" (arXiv:1812.01097); the layer sizes are
those of the TensorFlow reference models in github.com/TalwalkarLab/leaf, ``models/femnist/cnn.py``,
``models/shakespeare/stacked_lstm.py`` and ``models/sent140/stacked_lstm.py``, with the hidden sizes of
``models/baseline_constants.py`` (Shakespeare 256, Sent140 100). LEAF's last dense layer is fedray's
``head``; everything before it is ``features``.

Initialisation follows TensorFlow 1's defaults, which LEAF leaves in place: Glorot-uniform kernels
(convolutions, dense layers and the head, embeddings) and zero biases; an LSTM layer's kernel is one
Glorot-uniform ``[input + hidden, 4 * hidden]`` matrix, and ``BasicLSTMCell`` adds ``forget_bias = 1.0``
to the forget gate, here the forget gate's initial bias (the same function and gradients; weight decay
would pull it to 0 rather than -1).

What differs from the TensorFlow models everywhere: PyTorch's LSTM has two bias vectors per layer
(``bias_ih``, ``bias_hh``), so each LSTM layer has ``4 * hidden`` more parameters than ``BasicLSTMCell``
(the two sum to TF's one; the extra one starts at 0). The loss, optimiser and label encoding (LEAF's
one-hot labels) are the training loop's, not the model's.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
from torch import Tensor, nn

from fedray.platform.models.base import conv_out
from fedray.platform.models.registry import register_model

SHAKESPEARE_EMBED = 8  # models/shakespeare/stacked_lstm.py: embedding [vocab, 8]
SHAKESPEARE_HIDDEN = 256  # baseline_constants.py: 'shakespeare.stacked_lstm' num_hidden
SENT140_EMBED = 100  # learned embedding width: LEAF's code uses n_hidden (given GloVe vectors keep theirs)
SENT140_HIDDEN = 100  # baseline_constants.py: 'sent140.stacked_lstm' num_hidden
SENT140_DENSE = 128  # models/sent140/stacked_lstm.py: fc1 = dense(128), no activation
FEMNIST_DENSE = 2048  # models/femnist/cnn.py: dense(2048, relu)


@torch.no_grad()
def tf_glorot_(module: nn.Module) -> None:
    """TF1's defaults on every conv, dense and embedding layer: Glorot-uniform weight, zero bias."""
    for m in module.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear, nn.Embedding)):
            nn.init.xavier_uniform_(m.weight)
            bias = getattr(m, "bias", None)
            if bias is not None:
                nn.init.zeros_(bias)


@torch.no_grad()
def tf_lstm_init_(lstm: nn.LSTM) -> None:
    """``BasicLSTMCell`` under TF1's defaults: each layer's ``[W_ih | W_hh]`` Glorot-uniform as one
    ``[input + hidden, 4 * hidden]`` kernel, biases 0 and the forget gate's 1 (``forget_bias=1.0``).
    PyTorch's gate order is (input, forget, cell, output), so the forget gate is rows ``[H, 2H)``."""
    hidden = lstm.hidden_size
    for layer in range(lstm.num_layers):
        w_ih: Tensor = getattr(lstm, f"weight_ih_l{layer}")
        w_hh: Tensor = getattr(lstm, f"weight_hh_l{layer}")
        limit = math.sqrt(6.0 / (w_ih.shape[1] + hidden + 4 * hidden))
        nn.init.uniform_(w_ih, -limit, limit)
        nn.init.uniform_(w_hh, -limit, limit)
        if lstm.bias:
            b_ih: Tensor = getattr(lstm, f"bias_ih_l{layer}")
            nn.init.zeros_(b_ih)
            nn.init.zeros_(getattr(lstm, f"bias_hh_l{layer}"))
            b_ih[hidden : 2 * hidden].fill_(1.0)


def _tf_dense_head(head: nn.Linear) -> None:
    tf_glorot_(head)


class LastStepLSTM(nn.Module):
    """Token ids ``[B, L]`` -> embedding -> stacked LSTM (batch first) -> the output at the last time
    step ``[B, hidden]`` (LEAF's ``outputs[:, -1, :]``, padding or not) -> ``fc`` (identity, or LEAF's
    Sent140 dense layer)."""

    def __init__(
        self, embedding: nn.Embedding | FrozenEmbedding, hidden: int, layers: int, dense: int = 0
    ) -> None:
        super().__init__()
        self.embedding = embedding
        self.lstm = nn.LSTM(embedding.embedding_dim, hidden, num_layers=layers, batch_first=True)
        self.fc: nn.Module = nn.Linear(hidden, dense) if dense else nn.Identity()
        self.out_dim = dense or hidden
        tf_lstm_init_(self.lstm)
        tf_glorot_(self.fc)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.lstm(self.embedding(x))
        return self.fc(out[:, -1])


def _learned_embedding(vocab: int, dim: int) -> nn.Embedding:
    embedding = nn.Embedding(vocab, dim)
    tf_glorot_(embedding)
    return embedding


class FrozenEmbedding(nn.Module):
    """Given word vectors ``[vocab, D]``, looked up and never trained. They are a buffer outside the
    ``state_dict`` (``persistent=False``): every model is built with them from the data, so they do not
    travel in payloads or checkpoints, and algorithms that compare or average weights (FedCross's
    similarity, FedProx's anchor) see only what is trained. On the CPU every model shares the one table
    (``.to(device)`` gives a GPU model its own copy)."""

    vectors: Tensor

    def __init__(self, vectors: Tensor) -> None:
        super().__init__()
        self.register_buffer("vectors", vectors.detach().to(torch.float32), persistent=False)
        self.num_embeddings, self.embedding_dim = vectors.shape

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.embedding(x, self.vectors)


@register_model("leaf_cnn", min_size=4, head_init=_tf_dense_head)
def leaf_cnn(in_channels: int, image_size: int) -> tuple[nn.Module, int]:
    """LEAF's FEMNIST CNN: conv5x5x32 (same), pool, conv5x5x64 (same), pool, FC2048 (d=2048).

    LEAF ``models/femnist/cnn.py``: both convs 'same'-padded with ReLU, 2x2/2 max-pools, dense 2048 ReLU,
    then dense ``num_classes`` (the head). Differences: any ``in_channels`` and square ``image_size`` (LEAF:
    1x28x28 given as a flat 784-vector), the flatten size by arithmetic (7*7*64 = 3136 at 28x28); PyTorch
    flattens channels-first where TF flattens channels-last, a fixed permutation of FC2048's inputs.
    """
    side = conv_out(conv_out(image_size, 2, 2), 2, 2)  # 'same' convs keep the size; two 2x2/2 pools
    layers: OrderedDict[str, nn.Module] = OrderedDict(
        conv1=nn.Conv2d(in_channels, 32, 5, padding=2),
        relu1=nn.ReLU(inplace=True),
        pool1=nn.MaxPool2d(2),
        conv2=nn.Conv2d(32, 64, 5, padding=2),
        relu2=nn.ReLU(inplace=True),
        pool2=nn.MaxPool2d(2),
        flatten=nn.Flatten(),
        fc1=nn.Linear(64 * side * side, FEMNIST_DENSE),
        relu3=nn.ReLU(inplace=True),
    )
    features = nn.Sequential(layers)
    tf_glorot_(features)
    return features, FEMNIST_DENSE


@register_model("leaf_lstm", modality="text", head_init=_tf_dense_head)
def leaf_lstm(vocab: int, length: int) -> tuple[nn.Module, int]:
    """LEAF's Shakespeare model: embedding 8, 2-layer LSTM 256, the last step's output (d=256).

    LEAF ``models/shakespeare/stacked_lstm.py``: ``embedding [num_classes, 8]`` (the 80 characters are
    both the vocabulary and the classes), two ``BasicLSTMCell(256)``, dense ``num_classes`` on
    ``outputs[:, -1, :]`` (the head). Differences: the embedding has ``vocab`` rows, not ``num_classes``
    (the two are 80 for LEAF's Shakespeare); the LSTM's second bias (module docstring).
    """
    return _leaf_lstm(_learned_embedding(vocab, SHAKESPEARE_EMBED), SHAKESPEARE_HIDDEN)


def _leaf_lstm(
    embedding: nn.Embedding | FrozenEmbedding, hidden: int, dense: int = 0
) -> tuple[nn.Module, int]:
    features = LastStepLSTM(embedding, hidden, layers=2, dense=dense)
    return features, features.out_dim


@register_model("sent140_lstm", modality="text", embeddings=True, head_init=_tf_dense_head)
def sent140_lstm(vocab: int, length: int, embeddings: Tensor | None = None) -> tuple[nn.Module, int]:
    """LEAF's Sent140 model: embedding (100 learned, or frozen vectors), 2-layer LSTM 100, dense 128 (d=128).

    LEAF ``models/sent140/stacked_lstm.py``: two ``BasicLSTMCell(100)``, ``fc1 = dense(128)`` on
    ``outputs[:, -1, :]`` with no activation, then dense ``num_classes`` (the head). Differences: LEAF's
    code learns a ``[vocab + 1, 100]`` embedding (its width is ``n_hidden``; the GloVe array it loads is
    used only for the word -> id table), while its docs describe pretrained 300-d GloVe vectors. Here the
    embedding is LEAF's code's (100-d, learned) when no vectors are given, or ``embeddings`` ``[vocab, D]``
    frozen (:class:`FrozenEmbedding`: outside the state dict), as FedProx's Sent140 port of this model
    keeps GloVe fixed (github.com/litian96/FedProx ``flearn/models/sent140/stacked_lstm.py``,
    ``trainable=False``); the unknown-word row is the data's to provide. The LSTM's second bias (module docstring).
    """
    embedding: nn.Embedding | FrozenEmbedding
    if embeddings is None:
        embedding = _learned_embedding(vocab, SENT140_EMBED)
    else:
        embedding = FrozenEmbedding(embeddings)
    return _leaf_lstm(embedding, SENT140_HIDDEN, dense=SENT140_DENSE)

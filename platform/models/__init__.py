"""Model zoo: every model is a feature extractor plus ``head = Linear(feature_dim, num_classes)``.

    from fedray.platform.models import InputShape, build_for, build_model, arch_for_client
    arch = arch_for_client("htfe8", client_id)         # group[client_id % len(group)]
    model = build_model(arch, in_channels=3, image_size=32, num_classes=10)
    logits, z = model.forward_with_features(x)
    lstm = build_for("leaf_lstm", InputShape.text(vocab=80, length=80), num_classes=80)

A model reads images (``[B, C, S, S]`` float) or text (``[B, L]`` int64 token ids); ``model_modality``
tells which, and :func:`build_for` refuses a model of the other kind. LEAF's models (:mod:`.leaf`):
``leaf_cnn`` (FEMNIST, images), ``leaf_lstm`` (Shakespeare) and ``sent140_lstm`` (Sent140; optional
frozen pretrained embeddings).

Names: ``base[:cifar|:imagenet][@K|@linK]`` (see :mod:`.registry`). Groups:

- ``fedssa_cnns``: FedSSA CNN-1..CNN-5 (paper Table 3); client k -> CNN-(k % 5 + 1)
  (docs/algorithms/fedssa.md, Model assignment and CNN sizes).
- ``htfe2/3/4/8/9``: FedL2G's heterogeneous extractors (FedL2G paper §4 and §4.2; pooling:
  docs/algorithms/fedl2g.md, Pooling features to K = 512), every member pooled to
  K = 512 by ``AdaptiveAvgPool1d`` and ResNets in their ``:imagenet`` layout, as in the FedL2G code
  (torchvision models unchanged at 32x32; ResNet-4..10 with the ImageNet stem).
- ``small_hetero``: three small CNNs (d = 128/256/64) pooled to 128, for CPU tests on 8x8 digits.
- ``fedsc_mobilenet``: FedSC's Tiny-ImageNet model, MobileNetV2 with a learned 1280 -> 512 projection
  (``mobilenet_v2@lin512``; docs/algorithms/fedsc.md, MobileNetV2 feature width).
"""

from fedray.platform.models import cnn, leaf, resnet, torchvision_adapters  # noqa: F401  (registers the zoo)
from fedray.platform.models.base import FeaturePool, FedModel, head_param_names, num_params
from fedray.platform.models.inputs import DESCRIBE, InputShape
from fedray.platform.models.registry import (
    ArchSpec,
    arch_for_client,
    build_for,
    build_model,
    first_client_of_arch,
    is_known_model,
    known_models,
    min_image_size,
    model_group,
    model_modality,
    models_reading,
    parse_model_name,
    register_group,
    register_model,
    require_embeddings,
    require_image_size,
)

register_group("fedssa_cnns", [f"fedssa_cnn{k}" for k in range(1, 6)])
register_group("htfe2", ["fedavg_cnn@512", "resnet18:imagenet@512"])
register_group("htfe3", ["resnet10:imagenet@512", "resnet18:imagenet@512", "resnet34:imagenet@512"])
register_group("htfe4", ["fedavg_cnn@512", "googlenet@512", "mobilenet_v2@512", "resnet18:imagenet@512"])
register_group(
    "htfe8",
    [
        "fedavg_cnn@512",
        "googlenet@512",
        "mobilenet_v2@512",
        *(f"resnet{d}:imagenet@512" for d in (18, 34, 50, 101, 152)),
    ],
)
register_group("htfe9", [f"resnet{d}:imagenet@512" for d in (4, 6, 8, 10, 18, 34, 50, 101, 152)])
register_group("small_hetero", ["cnn_small@128", "cnn_small_wide@128", "cnn_small_deep@128"])
register_group("fedsc_mobilenet", ["mobilenet_v2@lin512"])

__all__ = [
    "DESCRIBE",
    "ArchSpec",
    "FeaturePool",
    "FedModel",
    "InputShape",
    "arch_for_client",
    "build_for",
    "build_model",
    "first_client_of_arch",
    "head_param_names",
    "is_known_model",
    "known_models",
    "min_image_size",
    "model_group",
    "model_modality",
    "models_reading",
    "num_params",
    "parse_model_name",
    "register_group",
    "register_model",
    "require_embeddings",
    "require_image_size",
]

"""Model zoo: shapes, the features/head contract, paper parameter counts, groups and name errors.

Big models are checked on the ``meta`` device (shapes without memory or compute); each real model is built
once per session (``_real``) and run on a batch of 2.
"""

from __future__ import annotations

import pickle
from functools import cache

import pytest
import torch
from conftest import one_torch_thread
from torch import nn

from fedray.platform.errors import ConfigError
from fedray.platform.models import (
    FeaturePool,
    FedModel,
    arch_for_client,
    build_model,
    head_param_names,
    is_known_model,
    known_models,
    min_image_size,
    model_group,
    num_params,
)
from fedray.platform.models.registry import _ARCHS

C = 10
HTFE = ["htfe2", "htfe3", "htfe4", "htfe8", "htfe9"]
# (name, feature_dim at 3x32x32) for every image architecture and style (text: test_models_text.py)
ALL_ARCHS = {
    "cnn_small": 128,
    "cnn_small_wide": 256,
    "cnn_small_deep": 64,
    **{f"fedssa_cnn{k}": 500 for k in range(1, 6)},
    "fedavg_cnn": 512,
    "leaf_cnn": 2048,
    "resnet20": 64,
    **{
        f"resnet{n}:{s}": d
        for n, d in ((4, 64), (6, 128), (8, 256), (10, 512))
        for s in ("cifar", "imagenet")
    },
    **{f"resnet{n}:{s}": 512 for n in (18, 34) for s in ("cifar", "imagenet")},
    **{f"resnet{n}:{s}": 2048 for n in (50, 101, 152) for s in ("cifar", "imagenet")},
    "googlenet": 1024,
    "mobilenet_v2": 1280,
    "vgg16:cifar": 512,
    "vgg16_bn:cifar": 512,
    "vgg16:imagenet": 4096,
    "vgg16_bn:imagenet": 4096,
}
# built for real and run on CPU (cheap enough at 32x32, batch 2)
REAL = [
    "cnn_small",
    "cnn_small_wide",
    "cnn_small_deep",
    *(f"fedssa_cnn{k}" for k in range(1, 6)),
    "fedavg_cnn",
    "resnet20",
    "resnet4",
    "resnet8:imagenet",
    "resnet10",
    "resnet18",
    "resnet50:imagenet",
    "googlenet",
    "mobilenet_v2",
    "vgg16",
]


_one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


@cache
def _real(arch: str, in_channels: int = 3, size: int = 32) -> FedModel:
    torch.manual_seed(0)
    return build_model(arch, in_channels, size, C).eval()


@cache
def _meta(arch: str, in_channels: int = 3, size: int = 32, num_classes: int = C) -> FedModel:
    with torch.device("meta"):
        return build_model(arch, in_channels, size, num_classes).eval()


def _x(in_channels: int = 3, size: int = 32, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, in_channels, size, size, generator=torch.Generator().manual_seed(1))


# ------------------------------------------------------------------------------------- the contract


def test_every_registered_image_architecture_is_covered():
    covered = {name.split(":")[0] for name in ALL_ARCHS}
    assert covered == {name for name, spec in _ARCHS.items() if spec.modality == "image"}


@pytest.mark.parametrize("arch", REAL)
def test_forward_shapes_and_head_contract(arch):
    model = _real(arch)
    x = _x()
    with torch.no_grad():
        logits = model(x)
        z = model.forward_features(x)
        logits2, z2 = model.forward_with_features(x)
        via_head = model.head(z)
    d = model.feature_dim
    assert logits.shape == (2, C)
    assert z.shape == (2, d)
    assert isinstance(model.head, nn.Linear)
    assert tuple(model.head.weight.shape) == (C, d)
    assert torch.equal(logits, via_head)
    assert torch.equal(logits, logits2)
    assert torch.equal(z, z2)
    assert torch.isfinite(logits).all()
    assert model.arch == arch


@pytest.mark.parametrize(("arch", "dim"), ALL_ARCHS.items())
def test_feature_dim_and_shapes_on_meta(arch, dim):
    model = _meta(arch)
    assert model.feature_dim == dim
    logits, z = model.forward_with_features(torch.empty(2, 3, 32, 32, device="meta"))
    assert tuple(logits.shape) == (2, C)
    assert tuple(z.shape) == (2, dim)


@pytest.mark.parametrize(
    "arch",
    [
        "cnn_small", "fedssa_cnn2", "fedavg_cnn", "resnet20", "resnet8:cifar", "resnet10:imagenet",
        "resnet18:cifar", "resnet50:imagenet", "googlenet", "mobilenet_v2",
    ],
)  # fmt: skip
def test_one_channel_inputs(arch):
    """The first conv takes in_channels from the argument (MNIST/FEMNIST: 1x28x28)."""
    assert min_image_size(arch) <= 28
    model = _meta(arch, in_channels=1, size=28, num_classes=62)
    assert tuple(model(torch.empty(3, 1, 28, 28, device="meta")).shape) == (3, 62)


def test_head_param_names_are_the_state_dict_keys_of_the_head():
    model = _real("fedssa_cnn3")
    names = head_param_names(model)
    assert names == ["head.weight", "head.bias"]
    sd = model.state_dict()
    assert tuple(sd["head.weight"].shape) == (C, 500)
    assert tuple(sd["head.bias"].shape) == (C,)
    assert not any(k.startswith("head.") for k in sd if k not in names)


def test_same_seed_same_init():
    torch.manual_seed(3)
    a = build_model("resnet20", 3, 32, C)
    torch.manual_seed(3)
    b = build_model("resnet20", 3, 32, C)
    assert all(torch.equal(va, vb) for va, vb in zip(a.state_dict().values(), b.state_dict().values()))


# ---------------------------------------------------------------------------------- paper details


@pytest.mark.parametrize(
    ("k", "expected"), [(1, 2_621_558), (2, 1_815_142), (3, 1_320_558), (4, 1_060_358), (5, 670_058)]
)
def test_fedssa_cnn_param_counts_match_spec(k, expected):
    """Computed CIFAR-10 parameter counts of CNN-1..CNN-5.

    They match Table 3's sizes except CNN-4's: docs/algorithms/fedssa.md, Model assignment and CNN sizes.
    """
    model = _real(f"fedssa_cnn{k}")
    assert num_params(model) == expected
    assert model.feature_dim == 500
    fc1 = model.features.fc1
    assert fc1.out_features == {1: 2000, 2: 2000, 3: 1000, 4: 800, 5: 500}[k]
    assert fc1.in_features == (400 if k == 2 else 800)


def test_fedavg_cnn_flatten_dim():
    assert _real("fedavg_cnn").features.fc1.in_features == 1600
    assert _meta("fedavg_cnn", size=64).features.fc1.in_features == 10816
    mnist = _real("fedavg_cnn", 1, 28)
    assert mnist.features.fc1.in_features == 1024
    with torch.no_grad():
        assert mnist(_x(1, 28)).shape == (2, C)


def test_resnet20_is_the_cifar_resnet():
    model = _real("resnet20")
    assert num_params(model) == 269_722  # He et al.: 0.27M (option-A shortcuts have no parameters)
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 19  # 1 stem + 3 stages x 3 blocks x 2


def test_fedsc_resnet10_layout():
    """FedSC paper Sec. 5.1 (ResNet-10, d = 512); layout from docs/algorithms/fedsc.md, ResNet-10 layout:
    BasicBlock [1,1,1,1], width 64, 3x3/1 stem, no max-pool, avgpool -> 512."""
    net = _real("resnet10").features
    assert net.conv1.kernel_size == (3, 3) and net.conv1.stride == (1, 1)
    assert isinstance(net.maxpool, nn.Identity)
    assert [len(stage) for stage in net.layers] == [1, 1, 1, 1]
    imagenet = _meta("resnet10:imagenet").features
    assert imagenet.conv1.kernel_size == (7, 7) and isinstance(imagenet.maxpool, nn.MaxPool2d)


def test_resnet_style_is_automatic_by_image_size():
    assert _meta("resnet18", size=32).features.conv1.kernel_size == (3, 3)
    assert isinstance(_meta("resnet18", size=32).features.maxpool, nn.Identity)
    assert _meta("resnet18", size=96).features.conv1.kernel_size == (7, 7)
    assert _meta("resnet18:imagenet", size=32).features.conv1.kernel_size == (7, 7)


def test_imagenet_style_keeps_torchvision_layout():
    from torchvision.models import resnet50

    with torch.device("meta"):
        tv = resnet50(weights=None)
    ours = _meta("resnet50:imagenet")
    tv_keys = {k for k in tv.state_dict() if not k.startswith("fc.")}
    assert {k.removeprefix("features.") for k in ours.state_dict() if k.startswith("features.")} == tv_keys


def test_vgg16_variants():
    assert num_params(_meta("vgg16:imagenet")) > 130_000_000  # the FedCross paper's ">130M" (Sec. IV-C2)
    cifar = _real("vgg16")
    assert 14_000_000 < num_params(cifar) < 16_000_000
    assert _meta("vgg16", size=64).feature_dim == 512


def test_learned_projection_suffix():
    model = _meta("mobilenet_v2@lin512")
    assert model.feature_dim == 512
    assert isinstance(model.features[1], nn.Linear)
    assert (model.features[1].in_features, model.features[1].out_features) == (1280, 512)


# ------------------------------------------------------------------------------------------ groups


def test_arch_for_client_cycles_through_the_group():
    members = model_group("fedssa_cnns")
    assert members == [f"fedssa_cnn{k}" for k in range(1, 6)]
    assert [arch_for_client("fedssa_cnns", i) for i in range(7)] == [
        f"fedssa_cnn{k}" for k in (1, 2, 3, 4, 5, 1, 2)
    ]
    for group in [*HTFE, "small_hetero"]:
        ms = model_group(group)
        for i in range(3 * len(ms)):
            assert arch_for_client(group, i) == ms[i % len(ms)]


def test_single_arch_and_adhoc_groups():
    assert model_group("resnet20") == ["resnet20"]
    assert arch_for_client("resnet20", 17) == "resnet20"
    assert model_group("fedavg_cnn@512, resnet18:cifar@512") == ["fedavg_cnn@512", "resnet18:cifar@512"]
    assert is_known_model("googlenet@512,resnet4@512")
    assert not is_known_model("googlenet@512,nope")


def test_htfe_group_members_match_fedl2g():
    bases = {g: [m.split("@")[0].split(":")[0] for m in model_group(g)] for g in HTFE}
    assert bases["htfe2"] == ["fedavg_cnn", "resnet18"]
    assert bases["htfe3"] == ["resnet10", "resnet18", "resnet34"]
    assert bases["htfe4"] == ["fedavg_cnn", "googlenet", "mobilenet_v2", "resnet18"]
    resnets = [f"resnet{d}" for d in (18, 34, 50, 101, 152)]
    assert bases["htfe8"] == ["fedavg_cnn", "googlenet", "mobilenet_v2", *resnets]
    assert bases["htfe9"] == [f"resnet{d}" for d in (4, 6, 8, 10, 18, 34, 50, 101, 152)]


@pytest.mark.parametrize("group", HTFE)
def test_htfe_members_share_a_512_head(group):
    for arch in model_group(group):
        model = _meta(arch, num_classes=100)
        assert model.feature_dim == 512, arch
        assert tuple(model.head.weight.shape) == (100, 512), arch
        assert isinstance(model.features[1], FeaturePool), arch
        out = model.forward_features(torch.empty(2, 3, 32, 32, device="meta"))
        assert tuple(out.shape) == (2, 512), arch


def test_htfe_members_run_for_real():
    """A real forward through pooled members of each kind (the cheap ones)."""
    for arch in ["fedavg_cnn@512", "resnet4:imagenet@512", "resnet18:imagenet@512", "mobilenet_v2@512"]:
        model = _real(arch)
        with torch.no_grad():
            logits, z = model.forward_with_features(_x())
        assert logits.shape == (2, C) and z.shape == (2, 512)


def test_feature_pool_is_channel_average_pooling():
    """FeaturePool(k) == FedL2G's nn.AdaptiveAvgPool1d(k) applied to the flat [B, D] vector."""
    for d, k in [(2048, 512), (1280, 512), (1024, 512), (512, 512), (256, 512), (64, 512), (500, 128)]:
        x = torch.randn(3, d)
        assert torch.allclose(FeaturePool(k)(x), nn.AdaptiveAvgPool1d(k)(x), atol=1e-6), (d, k)
    x = torch.randn(3, 2048)
    assert torch.allclose(FeaturePool(512)(x), x.view(3, 512, 4).mean(-1), atol=1e-6)
    y = torch.randn(3, 512)
    assert torch.equal(FeaturePool(512)(y), y)
    small = torch.randn(3, 64)
    assert torch.equal(FeaturePool(512)(small), small.repeat_interleave(8, dim=1))


# the levels FedRCL reads, before their ReLU: a ResNet's stem and each stage's last block, a small CNN's
# convolutions and its last layer; none where a model declares none
LEVELS = {
    "cnn_small": 3,
    "cnn_small_deep": 4,
    "cnn_small_wide@128": 3,
    "resnet20": 4,
    "resnet4": 2,
    "resnet10": 5,
    "resnet8:imagenet": 4,
    "resnet18": 5,
    "resnet50:imagenet": 5,
    "fedavg_cnn": 0,
    "googlenet": 0,
}


@pytest.mark.parametrize(("arch", "count"), LEVELS.items())
def test_declared_levels_run_once_each_from_shallow_to_deep(arch, count):
    model = _real(arch)
    levels = model.feature_levels()
    assert len(levels) == count
    ran: list[int] = []
    handles = [m.register_forward_hook(lambda *_, k=k: ran.append(k)) for k, m in enumerate(levels)]
    with torch.no_grad():
        model(_x())
    for handle in handles:
        handle.remove()
    assert ran == list(range(count))
    assert len(pickle.loads(pickle.dumps(model)).feature_levels()) == count  # as a worker receives it


def test_models_pickle_for_ray():
    for arch in ["resnet20", "cnn_small_wide@128"]:
        model = _real(arch, 3, 32)
        clone = pickle.loads(pickle.dumps(model))
        x = _x()
        with torch.no_grad():
            assert torch.equal(clone(x), model(x))
        assert clone.arch == arch and clone.feature_dim == model.feature_dim


def test_pooled_model_features_are_the_pooled_base_features():
    torch.manual_seed(0)
    pooled = build_model("cnn_small_wide@128", 1, 8, C).eval()
    x = _x(1, 8)
    with torch.no_grad():
        base = pooled.features[0](x)
        assert base.shape == (2, 256)
        assert torch.allclose(pooled.forward_features(x), base.view(2, 128, 2).mean(-1))


@pytest.mark.parametrize("arch", ["cnn_small", *model_group("small_hetero")])
def test_small_models_on_8x8_digits_shape(arch):
    model = _real(arch, 1, 8)
    with torch.no_grad():
        logits, z = model.forward_with_features(_x(1, 8, batch=4))
    assert logits.shape == (4, C)
    assert z.shape == (4, 128)


def test_cnn_small_learns_digits():
    from sklearn.datasets import load_digits

    torch.manual_seed(0)
    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(data.target)
    perm = torch.randperm(len(y))
    train, test = perm[:1400], perm[1400:]
    model = build_model("cnn_small", 1, 8, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(5):
        for idx in train[torch.randperm(len(train))].split(32):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    with torch.no_grad():
        acc = (model.eval()(x[test]).argmax(1) == y[test]).float().mean().item()
    assert acc > 0.9


# ------------------------------------------------------------------------------------------ errors


def test_unknown_arch_is_a_config_error_naming_it():
    with pytest.raises(ConfigError, match="transformer9000"):
        build_model("transformer9000", 3, 32, C)
    with pytest.raises(ConfigError, match="transformer9000"):
        model_group("transformer9000")
    with pytest.raises(ConfigError, match="transformer9000"):
        arch_for_client("transformer9000", 0)
    assert "transformer9000" not in known_models()


def test_bad_names_and_sizes_are_config_errors():
    with pytest.raises(ConfigError, match="':imagenet'"):
        build_model("fedavg_cnn:imagenet", 3, 32, C)
    with pytest.raises(ConfigError, match="is a group"):
        build_model("htfe8", 3, 32, C)
    with pytest.raises(ConfigError, match="at least 16x16"):
        build_model("fedssa_cnn1", 1, 8, C)
    with pytest.raises(ConfigError, match="at least 32x32"):
        build_model("vgg16", 1, 28, C)
    with pytest.raises(ConfigError, match="num_classes"):
        build_model("cnn_small", 1, 8, 0)


def test_known_models_lists_archs_groups_and_members():
    names = known_models()
    for name in ["cnn_small", "resnet152", "vgg16", "fedssa_cnns", "small_hetero", *HTFE]:
        assert name in names
    for group in [*HTFE, "small_hetero", "fedssa_cnns"]:
        assert all(m in names for m in model_group(group))
    assert len(names) == len(set(names))


@pytest.mark.parametrize("kind", ["basic", "bottleneck", "own"])
@pytest.mark.parametrize("downsample", [False, True])
def test_a_block_with_a_level_computes_what_torchvisions_block_computes(kind, downsample):
    # the blocks FedRCL reads a level in: torchvision's turned into twins, fedray's own shallow ResNet's
    import copy

    from torchvision.models.resnet import BasicBlock, Bottleneck

    from fedray.platform.models.resnet import _BasicBlock
    from fedray.platform.models.torchvision_levels import expose_pre_activation

    width = 16 if kind == "bottleneck" else 64
    inplanes = 32 if downsample else width * (4 if kind == "bottleneck" else 1)
    down = (
        nn.Sequential(nn.Conv2d(inplanes, 64, 1, 2, bias=False), nn.BatchNorm2d(64)) if downsample else None
    )
    stride = 2 if downsample else 1
    torch.manual_seed(0)
    theirs = (Bottleneck if kind == "bottleneck" else BasicBlock)(inplanes, width, stride, down)
    for m in theirs.modules():  # BatchNorm affine away from (1, 0), so a dropped step shows
        if isinstance(m, nn.BatchNorm2d):
            nn.init.uniform_(m.weight, 0.5, 1.5), nn.init.uniform_(m.bias, -0.5, 0.5)
    if kind == "own":
        mine: nn.Module = _BasicBlock(inplanes, width, stride, copy.deepcopy(down))
        mine.load_state_dict(theirs.state_dict())
    else:
        mine = copy.deepcopy(theirs)
        expose_pre_activation(mine)
        assert type(mine) is not type(theirs)
    assert list(mine.state_dict()) == list(theirs.state_dict())
    x = torch.randn(3, inplanes, 8, 8, generator=torch.Generator().manual_seed(1))
    outs = []
    for block in (theirs, mine):
        xb = x.clone().requires_grad_(True)
        out = block(xb)
        out.square().sum().backward()
        outs.append((out.detach(), xb.grad, [p.grad for p in block.parameters()]))
    (o1, g1, p1), (o2, g2, p2) = outs
    assert torch.equal(o1, o2) and torch.equal(g1, g2)
    assert all(torch.equal(a, b) for a, b in zip(p1, p2, strict=True))

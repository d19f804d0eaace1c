"""Modality-aware zoo: InputShape, build_for, the modality checks and LEAF's models (no Ray).

LEAF (Caldas et al. 2018): ``leaf_cnn`` (FEMNIST 1x28x28, 62 classes), ``leaf_lstm`` (Shakespeare, 80
characters, windows of 80, 80 classes), ``sent140_lstm`` (Sent140, 25 words, 2 classes). Parameter counts
are computed here from the layer sizes, independently of the models.
"""

from __future__ import annotations

import dataclasses
import math
import pickle

import pytest
import torch
from conftest import one_torch_thread
from torch import nn

from fedray.platform.errors import ConfigError
from fedray.platform.models import (
    FeaturePool,
    FedModel,
    InputShape,
    arch_for_client,
    build_for,
    build_model,
    is_known_model,
    min_image_size,
    model_group,
    model_modality,
    models_reading,
    num_params,
    register_model,
)
from fedray.platform.models.checks import require_homogeneous, shared_feature_dim
from fedray.platform.models.registry import _ARCHS

FEMNIST = InputShape.image(1, 28)
SHAKESPEARE = InputShape.text(vocab=80, length=80)
SENT140 = InputShape.text(vocab=10_000, length=25)
TEXT_ARCHS = ["leaf_lstm", "sent140_lstm"]


_one_thread = pytest.fixture(autouse=True, scope="module")(one_torch_thread)


def _build(arch: str, shape: InputShape, num_classes: int, seed: int = 0, **kw) -> FedModel:
    torch.manual_seed(seed)
    return build_for(arch, shape, num_classes, **kw).eval()


def _tokens(shape: InputShape, batch: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, shape.vocab, (batch, shape.size), generator=torch.Generator().manual_seed(seed))


def _lstm_params(inp: int, hidden: int, layers: int) -> int:
    """PyTorch's nn.LSTM: per layer W_ih [4H, in], W_hh [4H, H], b_ih [4H], b_hh [4H]."""
    total = 0
    for layer in range(layers):
        width = inp if layer == 0 else hidden
        total += 4 * hidden * width + 4 * hidden * hidden + 2 * 4 * hidden
    return total


def _linear(i: int, o: int) -> int:
    return i * o + o


# ------------------------------------------------------------------------------------------ InputShape


def test_input_shape_constructors_and_examples():
    image, text = InputShape.image(3, 32), InputShape.text(vocab=80, length=20)
    assert (image.modality, image.channels, image.size, image.vocab) == ("image", 3, 32, 0)
    assert (text.modality, text.channels, text.size, text.vocab, text.length) == ("text", 0, 20, 80, 20)
    x = image.example()
    assert x.dtype == torch.float32 and tuple(x.shape) == (2, 3, 32, 32) and not x.any()
    t = text.example(batch=5)
    assert t.dtype == torch.int64 and tuple(t.shape) == (5, 20) and not t.any()
    assert InputShape.image(3, 32) == image and hash(InputShape.image(3, 32)) == hash(image)
    assert pickle.loads(pickle.dumps(text)) == text
    with pytest.raises(dataclasses.FrozenInstanceError):
        image.size = 64  # type: ignore[misc]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: InputShape.image(0, 28), "channels must be a positive integer, got 0"),
        (lambda: InputShape.image(1, -28), "size must be a positive integer, got -28"),
        (lambda: InputShape.image(1, 28.0), "got 28.0"),
        (lambda: InputShape.image(True, 28), "got True"),
        (lambda: InputShape.text(vocab=0, length=80), "vocab must be a positive integer"),
        (lambda: InputShape.text(vocab=80, length=0), "sequence length must be a positive integer"),
        (lambda: InputShape("audio", 1, 1), "modality must be one of image, text"),
        (lambda: InputShape("image", channels=1, size=28, vocab=80), "vocab is not used"),
        (lambda: InputShape("text", channels=1, size=8, vocab=80), "channels is not used"),
    ],
)
def test_input_shape_validation_is_one_config_error_line(make, match):
    with pytest.raises(ConfigError, match=match) as info:
        make()
    assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------- the LEAF models


def test_every_text_architecture_is_covered():
    assert set(TEXT_ARCHS) == {n for n, spec in _ARCHS.items() if spec.modality == "text"}
    assert models_reading("text") == TEXT_ARCHS
    assert "leaf_cnn" in models_reading("image") and "leaf_lstm" not in models_reading("image")


@pytest.mark.parametrize(
    ("arch", "shape", "num_classes", "dim"),
    [
        ("leaf_cnn", FEMNIST, 62, 2048),
        ("leaf_lstm", SHAKESPEARE, 80, 256),
        ("sent140_lstm", SENT140, 2, 128),
    ],
)
def test_leaf_models_shapes_and_head_contract(arch, shape, num_classes, dim):
    model = _build(arch, shape, num_classes)
    x = torch.randn(3, 1, 28, 28) if shape.modality == "image" else _tokens(shape)
    with torch.no_grad():
        logits = model(x)
        z = model.forward_features(x)
        logits2, z2 = model.forward_with_features(x)
        via_head = model.head(z)
    assert model.feature_dim == dim and model.inputs == shape and model.arch == arch
    assert tuple(logits.shape) == (3, num_classes) and tuple(z.shape) == (3, dim)
    assert isinstance(model.head, nn.Linear) and tuple(model.head.weight.shape) == (num_classes, dim)
    assert torch.equal(logits, logits2) and torch.equal(z, z2) and torch.equal(logits, via_head)
    assert torch.isfinite(logits).all()
    example = model.example_input(4)
    assert example.dtype == (torch.float32 if shape.modality == "image" else torch.int64)
    assert tuple(model(example).shape) == (4, num_classes)


def test_leaf_cnn_layers_and_param_count_at_femnist():
    model = _build("leaf_cnn", FEMNIST, 62)
    f = model.features
    for conv, (cin, cout) in ((f.conv1, (1, 32)), (f.conv2, (32, 64))):
        assert (conv.in_channels, conv.out_channels) == (cin, cout)
        assert conv.kernel_size == (5, 5) and conv.padding == (2, 2) and conv.stride == (1, 1)  # 'same'
    assert isinstance(f.pool1, nn.MaxPool2d) and isinstance(f.pool2, nn.MaxPool2d)
    assert (f.fc1.in_features, f.fc1.out_features) == (7 * 7 * 64, 2048)
    assert isinstance(f.relu3, nn.ReLU)  # LEAF: dense(2048, relu)
    expected = (
        (1 * 5 * 5 * 32 + 32)  # conv1
        + (32 * 5 * 5 * 64 + 64)  # conv2
        + _linear(7 * 7 * 64, 2048)  # fc1
        + _linear(2048, 62)  # head
    )
    assert expected == 6_603_710
    assert num_params(model) == expected


def test_leaf_cnn_sizes_by_arithmetic():
    with torch.device("meta"):
        rgb = build_for("leaf_cnn", InputShape.image(3, 32), 10)
        odd = build_for("leaf_cnn", InputShape.image(1, 29), 10)
        smallest = build_for("leaf_cnn", InputShape.image(1, 4), 10)
    assert rgb.features.fc1.in_features == 64 * 8 * 8
    assert odd.features.fc1.in_features == 64 * 7 * 7  # 29 -> 14 -> 7 (floor pools)
    assert smallest.features.fc1.in_features == 64
    assert tuple(odd(torch.empty(2, 1, 29, 29, device="meta")).shape) == (2, 10)
    assert min_image_size("leaf_cnn") == 4
    with pytest.raises(ConfigError, match="at least 4x4"):
        build_model("leaf_cnn", 1, 3, 10)


def test_leaf_lstm_layers_param_count_and_last_step():
    model = _build("leaf_lstm", SHAKESPEARE, 80)
    f = model.features
    assert (f.embedding.num_embeddings, f.embedding.embedding_dim) == (80, 8)
    assert (f.lstm.input_size, f.lstm.hidden_size, f.lstm.num_layers) == (8, 256, 2)
    assert f.lstm.batch_first and not f.lstm.bidirectional
    expected = 80 * 8 + _lstm_params(8, 256, 2) + _linear(256, 80)
    # embedding 640 + layer 1 (4*256*(8+256) + 2*1024) + layer 2 (4*256*512 + 2*1024) + head 20,560
    assert expected == 640 + 272_384 + 526_336 + 20_560 == 819_920
    assert num_params(model) == expected
    x = _tokens(SHAKESPEARE)
    with torch.no_grad():
        out, (h_n, _) = f.lstm(f.embedding(x))
        z = model.forward_features(x)
    assert torch.equal(z, out[:, -1])  # the last time step's output ...
    assert torch.allclose(z, h_n[-1])  # ... the top layer's final hidden state


def test_sent140_lstm_layers_param_count_and_linear_dense():
    model = _build("sent140_lstm", SENT140, 2)
    f = model.features
    assert (f.embedding.num_embeddings, f.embedding.embedding_dim) == (10_000, 100)
    assert (f.lstm.input_size, f.lstm.hidden_size, f.lstm.num_layers) == (100, 100, 2)
    assert isinstance(f.fc, nn.Linear) and (f.fc.in_features, f.fc.out_features) == (100, 128)
    expected = 10_000 * 100 + _lstm_params(100, 100, 2) + _linear(100, 128) + _linear(128, 2)
    assert expected == 1_000_000 + 80_800 + 80_800 + 12_928 + 258 == 1_174_786
    assert num_params(model) == expected == num_params(model, trainable_only=True)
    x = _tokens(SENT140)
    with torch.no_grad():
        out, _ = f.lstm(f.embedding(x))
        z = model.forward_features(x)
    # LEAF's fc1 = dense(128) has no activation: the features are the affine map of the last step
    assert torch.allclose(z, f.fc(out[:, -1]))
    assert (z < 0).any()


def test_tf_style_init_of_the_lstm():
    """BasicLSTMCell's forget_bias=1.0 as the forget gate's initial bias, other biases 0, and weights
    within the Glorot bound of TF's one [in + H, 4H] kernel per layer."""
    lstm = _build("leaf_lstm", SHAKESPEARE, 80).features.lstm
    H = 256
    for layer, width in ((0, 8), (1, H)):
        b_ih, b_hh = getattr(lstm, f"bias_ih_l{layer}"), getattr(lstm, f"bias_hh_l{layer}")
        assert torch.equal(b_ih[H : 2 * H], torch.ones(H))
        assert not b_ih[:H].any() and not b_ih[2 * H :].any() and not b_hh.any()
        limit = math.sqrt(6 / (width + H + 4 * H))
        for w in (getattr(lstm, f"weight_ih_l{layer}"), getattr(lstm, f"weight_hh_l{layer}")):
            assert w.abs().max() <= limit and w.abs().max() > 0.9 * limit


def test_same_seed_same_init_for_text_models():
    for arch, shape in (("leaf_lstm", SHAKESPEARE), ("sent140_lstm", InputShape.text(50, 5))):
        a, b = _build(arch, shape, 3, seed=7), _build(arch, shape, 3, seed=7)
        c = _build(arch, shape, 3, seed=8)
        assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
        assert not torch.equal(a.features.embedding.weight, c.features.embedding.weight)


def test_leaf_lstm_learns_to_remember_the_first_token():
    """A task only the recurrence solves: the label is the first of 8 tokens, read at the last step."""
    torch.manual_seed(0)
    shape = InputShape.text(vocab=6, length=8)
    model = build_for("leaf_lstm", shape, 6)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    for _ in range(150):
        x = torch.randint(0, 6, (32, 8), generator=gen)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), x[:, 0]).backward()
        opt.step()
    x = torch.randint(0, 6, (256, 8), generator=gen)
    with torch.no_grad():
        acc = (model.eval()(x).argmax(1) == x[:, 0]).float().mean().item()
    assert acc > 0.9


# ------------------------------------------------------------------------------------------ embeddings


def test_sent140_embeddings_are_frozen_and_outside_the_state_dict():
    vocab, dim = 50, 12
    vectors = torch.randn(vocab, dim, generator=torch.Generator().manual_seed(3))
    kept = vectors.clone()
    model = _build("sent140_lstm", InputShape.text(vocab, 7), 2, embeddings=vectors).train()
    emb = model.features.embedding
    assert torch.equal(emb.vectors, kept) and emb.embedding_dim == dim
    assert model.features.lstm.input_size == dim  # the LSTM reads the given width
    x = _tokens(InputShape.text(vocab, 7), batch=8)
    assert torch.equal(emb(x), kept[x])  # a lookup of the given rows
    # not state: no payload, checkpoint or weight comparison carries the table
    assert not any("embedding" in k for k in model.state_dict())
    assert emb.vectors.data_ptr() == vectors.data_ptr()  # float32 given: one table for every model
    as_float64 = _build("sent140_lstm", InputShape.text(vocab, 7), 2, embeddings=kept.double())
    assert as_float64.features.embedding.vectors.dtype == torch.float32
    assert torch.equal(as_float64.features.embedding.vectors, kept)
    # 4*100*(12+100) + 4*100*100 + 2 layers x 2 biases x 400 + dense + head: the table is no parameter
    trainable = _lstm_params(dim, 100, 2) + _linear(100, 128) + _linear(128, 2)
    assert num_params(model, trainable_only=True) == num_params(model) == trainable
    loaded = _build("sent140_lstm", InputShape.text(vocab, 7), 2, embeddings=kept)
    loaded.load_state_dict(model.state_dict())  # strict: the state dicts match without the table

    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), torch.arange(8) % 2).backward()
    opt.step()
    assert torch.equal(emb.vectors, kept)  # never trained
    after = model.state_dict()
    for key in (
        "features.lstm.weight_ih_l0",
        "features.lstm.weight_hh_l1",
        "features.fc.weight",
        "head.weight",
    ):
        assert not torch.equal(after[key], before[key]), key


def test_sent140_without_embeddings_learns_its_embedding():
    model = _build("sent140_lstm", InputShape.text(30, 5), 2).train()
    assert model.features.embedding.weight.requires_grad
    before = model.features.embedding.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x = _tokens(InputShape.text(30, 5), batch=8)
    nn.functional.cross_entropy(model(x), torch.arange(8) % 2).backward()
    opt.step()
    assert not torch.equal(model.features.embedding.weight, before)


@pytest.mark.parametrize(
    ("arch", "shape", "vectors", "match"),
    [
        (
            "leaf_lstm",
            SHAKESPEARE,
            torch.zeros(80, 8),
            r"'leaf_lstm' takes no pretrained embeddings .*sent140_lstm",
        ),
        (
            "cnn_small",
            InputShape.image(1, 8),
            torch.zeros(80, 8),
            "'cnn_small' takes no pretrained embeddings",
        ),
        (
            "sent140_lstm",
            SHAKESPEARE,
            torch.zeros(81, 300),
            r"shape \[81, 300\] .* vocabulary of 80 token ids",
        ),
        ("sent140_lstm", SHAKESPEARE, torch.zeros(80), r"shape \[80\]"),
        ("sent140_lstm", SHAKESPEARE, torch.zeros(80, 300, dtype=torch.int64), "float tensor"),
        ("sent140_lstm", SHAKESPEARE, [[0.0] * 3] * 80, "float tensor .* got list"),
    ],
)
def test_embedding_errors_are_one_config_error_line(arch, shape, vectors, match):
    with pytest.raises(ConfigError, match=match) as info:
        build_for(arch, shape, 2, embeddings=vectors)
    assert "\n" not in str(info.value)


# -------------------------------------------------------------------------------------- modality checks


def test_image_model_on_text_data_names_both_sides_and_the_text_models():
    with pytest.raises(ConfigError) as info:
        build_for("cnn_small", SHAKESPEARE, 80)
    assert str(info.value) == (
        "model 'cnn_small' reads images, the data is text (token ids); text models: leaf_lstm, sent140_lstm"
    )


def test_text_model_on_image_data_names_both_sides_and_the_image_models():
    with pytest.raises(ConfigError, match=r"model 'leaf_lstm@128' reads text \(token ids\), the data is images; "
                       r"image models: .*leaf_cnn") as info:  # fmt: skip
        build_model("leaf_lstm@128", 1, 28, 62)
    assert "\n" not in str(info.value) and "sent140_lstm" not in str(info.value)
    with pytest.raises(ConfigError, match="reads text"):
        build_for("sent140_lstm", FEMNIST, 62)
    with pytest.raises(ConfigError, match="reads text"):
        min_image_size("leaf_lstm")


def test_model_modality_of_names_groups_and_lists():
    assert model_modality("cnn_small") == "image"
    assert model_modality("htfe8") == model_modality("fedsc_mobilenet") == "image"
    assert model_modality("leaf_lstm") == model_modality("sent140_lstm@lin64") == "text"
    assert model_modality("leaf_lstm@128, sent140_lstm") == "text"
    assert model_modality("leaf_cnn,cnn_small@2048") == "image"
    with pytest.raises(ConfigError) as info:
        model_modality("leaf_lstm, cnn_small, sent140_lstm")
    msg = str(info.value)
    assert (
        "mixes" in msg and "text (token ids): leaf_lstm, sent140_lstm" in msg and "images: cnn_small" in msg
    )
    with pytest.raises(ConfigError, match="transformer9000"):
        model_modality("leaf_lstm,transformer9000")


def test_register_model_refuses_image_options_on_text_models():
    def builder(vocab, length):
        return nn.Identity(), 1

    with pytest.raises(ValueError, match="styles and min_size are for image models"):
        register_model("text_with_styles", modality="text", styles=("cifar",))(builder)
    with pytest.raises(ValueError, match="only text models take embeddings"):
        register_model("image_with_embeddings", embeddings=True)(builder)
    with pytest.raises(ValueError, match="modality"):
        register_model("audio_model", modality="audio")(builder)  # type: ignore[arg-type]
    assert not {"text_with_styles", "image_with_embeddings", "audio_model"} & set(_ARCHS)


# ------------------------------------------------------------------------------ modifiers, meta, FedModel


def test_pooled_leaf_lstm_has_128_features():
    model = _build("leaf_lstm@128", SHAKESPEARE, 80)
    assert model.feature_dim == 128 and isinstance(model.features[1], FeaturePool)
    assert tuple(model.head.weight.shape) == (80, 128)
    x = _tokens(SHAKESPEARE)
    with torch.no_grad():
        base = model.features[0](x)
        logits, z = model.forward_with_features(x)
    assert base.shape == (3, 256) and z.shape == (3, 128) and logits.shape == (3, 80)
    assert torch.allclose(z, base.view(3, 128, 2).mean(-1))


def test_learned_projection_on_sent140():
    model = _build("sent140_lstm@lin64", SENT140, 2)
    assert model.feature_dim == 64
    assert isinstance(model.features[1], nn.Linear) and model.features[1].in_features == 128
    assert tuple(model(_tokens(SENT140)).shape) == (3, 2)


def test_text_models_build_on_meta_and_share_a_feature_size():
    with torch.device("meta"):
        for arch in TEXT_ARCHS:
            model = build_for(arch, SENT140, 2)
            assert all(p.is_meta for p in model.parameters()), arch
            assert tuple(model(SENT140.example(device="meta")).shape) == (2, 2)
    assert shared_feature_dim("fedproto", "leaf_lstm@128,sent140_lstm", SHAKESPEARE, 80) == 128
    assert shared_feature_dim("fedproto", "sent140_lstm", SENT140, 2) == 128
    # built on the meta device: a 2**40 x 300 embedding (1.3 PB) is never allocated
    assert shared_feature_dim("fedproto", "sent140_lstm", InputShape.text(2**40, 25), 2) == 128
    with pytest.raises(ConfigError, match=r"one feature size .*leaf_lstm: 256, sent140_lstm: 128"):
        shared_feature_dim("fedproto", "leaf_lstm,sent140_lstm", SHAKESPEARE, 80)
    with pytest.raises(ConfigError, match="reads images, the data is text"):
        shared_feature_dim("fedproto", "leaf_lstm,cnn_small", SHAKESPEARE, 80)
    assert shared_feature_dim("fedproto", "small_hetero", InputShape.image(1, 8), 10) == 128


def test_fedmodel_inputs_and_image_attributes():
    image = _build("leaf_cnn", FEMNIST, 62)
    assert (image.in_channels, image.image_size) == (1, 28)
    text = _build("leaf_lstm", SHAKESPEARE, 80)
    assert text.inputs == SHAKESPEARE
    assert not hasattr(text, "in_channels") and not hasattr(text, "image_size")
    legacy = FedModel(nn.Identity(), 4, 3, arch="identity", in_channels=1, image_size=2)
    assert legacy.inputs == InputShape.image(1, 2) and (legacy.in_channels, legacy.image_size) == (1, 2)
    with pytest.raises(TypeError):
        FedModel(nn.Identity(), 4, 3, arch="identity")
    with pytest.raises(TypeError):
        FedModel(nn.Identity(), 4, 3, arch="identity", inputs=SHAKESPEARE, in_channels=1)
    clone = pickle.loads(pickle.dumps(text))  # Ray ships models pickled
    x = _tokens(SHAKESPEARE)
    with torch.no_grad():
        assert torch.equal(clone(x), text(x))
    assert clone.inputs == SHAKESPEARE and clone.arch == "leaf_lstm"
    with pytest.raises(TypeError, match="InputShape"):
        build_for("leaf_lstm", (80, 80), 80)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="num_classes"):
        build_for("leaf_lstm", SHAKESPEARE, 0)


# --------------------------------------------------------------------------------------------- FedSC


def test_fedsc_mobilenet_builds_at_64x64_with_512_features():
    assert model_group("fedsc_mobilenet") == ["mobilenet_v2@lin512"]
    assert is_known_model("fedsc_mobilenet")
    assert arch_for_client("fedsc_mobilenet", 7) == "mobilenet_v2@lin512"
    require_homogeneous("fedsc", "fedsc_mobilenet")  # one architecture: whole-model averaging is fine
    model = _build("mobilenet_v2@lin512", InputShape.image(3, 64), 200)
    assert model.feature_dim == 512
    proj = model.features[1]
    assert isinstance(proj, nn.Linear) and (proj.in_features, proj.out_features) == (1280, 512)
    with torch.no_grad():
        logits, z = model.forward_with_features(torch.randn(2, 3, 64, 64))
    assert logits.shape == (2, 200) and z.shape == (2, 512)
    assert shared_feature_dim("fedsc", "fedsc_mobilenet", InputShape.image(3, 64), 200) == 512

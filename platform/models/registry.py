"""Architecture registry, model groups and the model-name grammar.

An architecture reads one modality (:class:`~fedray.platform.models.inputs.InputShape`): images
(``builder(in_channels, image_size[, style=...])``) or token ids (``builder(vocab, length[, embeddings=...])``);
either returns ``(feature extractor, feature_dim)``. :func:`build_for` builds one for an input shape and
refuses a model that reads the other modality.

A model name is ``base[:style][@K | @linK]``:

- ``base``: a registered architecture (``@register_model("name")``), e.g. ``resnet18``.
- ``:style`` (images only): for architectures with a small-image and an ImageNet variant (ResNets, VGG):
  ``:cifar`` = adapted to small inputs, ``:imagenet`` = the original torchvision layout. Without it the
  choice is automatic: ``cifar`` when ``image_size <= 64``, else ``imagenet``.
- ``@K``: FedL2G's ``nn.AdaptiveAvgPool1d(K)`` over the penultimate vector (no parameters), so
  ``feature_dim = K`` (docs/algorithms/fedl2g.md, Pooling features to K = 512).
- ``@linK``: a learned ``Linear(d, K)`` instead (FedSC's MobileNetV2 1280 -> 512;
  docs/algorithms/fedsc.md, MobileNetV2 feature width). Both modifiers apply to text models too.

A group is a list of model names; client ``i`` gets ``group[i % len(group)]``. Any single model name is a
homogeneous group of itself, and a comma-separated list of names is an ad-hoc group.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from fedray.platform.errors import ConfigError
from fedray.platform.models.base import FeaturePool, FedModel
from fedray.platform.models.inputs import DESCRIBE, MODALITIES, InputShape, Modality

# images: builder(in_channels, image_size[, style=...]); text: builder(vocab, length[, embeddings=...])
# -> (feature extractor, feature_dim)
Builder = Callable[..., tuple[nn.Module, int]]
STYLES = ("cifar", "imagenet")
SMALL_IMAGE_MAX = 64  # automatic style: "cifar" up to this size, "imagenet" above


@dataclass(frozen=True)
class ArchSpec:
    name: str
    builder: Builder
    min_size: int = 1  # images: smallest square input the architecture accepts
    styles: tuple[str, ...] = ()  # supported ':style' modifiers; empty = no variants
    # min_size per style where it differs
    style_min_size: dict[str, int] = field(default_factory=dict)
    # re-initialise the head like the original model does (default: PyTorch's Linear init)
    head_init: Callable[[nn.Linear], None] | None = None
    doc: str = ""
    modality: Modality = "image"
    embeddings: bool = False  # text: the builder takes ``embeddings`` (pretrained [vocab, D] vectors)


_ARCHS: dict[str, ArchSpec] = {}
_GROUPS: dict[str, list[str]] = {}
_NAME = re.compile(r"^(?P<base>[a-z0-9_]+)(?::(?P<style>[a-z]+))?(?:@(?P<lin>lin)?(?P<k>[0-9]+))?$")


def register_model(
    name: str,
    *,
    min_size: int = 1,
    styles: tuple[str, ...] = (),
    style_min_size: dict[str, int] | None = None,
    head_init: Callable[[nn.Linear], None] | None = None,
    modality: Modality = "image",
    embeddings: bool = False,
) -> Callable[[Builder], Builder]:
    """Decorator: register ``fn(in_channels, image_size[, style]) -> (features, feature_dim)`` for images,
    or with ``modality="text"`` ``fn(vocab, length[, embeddings]) -> (features, feature_dim)``.

    ``embeddings=True`` (text): the builder takes ``embeddings``, a ``[vocab, D]`` tensor or None, already
    checked against the vocabulary; other builders never get one. ``min_size`` and ``styles`` are for images.
    """

    def decorate(fn: Builder) -> Builder:
        if name in _ARCHS or name in _GROUPS:
            raise ValueError(f"model {name!r} is registered twice")
        if not _NAME.match(name) or ":" in name or "@" in name:
            raise ValueError(f"bad model name {name!r}: use lower-case letters, digits and '_'")
        if modality not in MODALITIES:
            raise ValueError(f"model {name!r}: modality must be one of {MODALITIES}, got {modality!r}")
        if modality != "image" and (styles or style_min_size or min_size != 1):
            raise ValueError(f"model {name!r}: styles and min_size are for image models")
        if embeddings and modality != "text":
            raise ValueError(f"model {name!r}: only text models take embeddings")
        doc = (fn.__doc__ or "").strip().splitlines()
        _ARCHS[name] = ArchSpec(
            name,
            fn,
            min_size,
            tuple(styles),
            dict(style_min_size or {}),
            head_init,
            doc[0] if doc else "",
            modality,
            embeddings,
        )
        return fn

    return decorate


def register_group(name: str, members: list[str]) -> None:
    """Register a named model group (validated lazily, when first used)."""
    if name in _ARCHS or name in _GROUPS:
        raise ValueError(f"model group {name!r} is registered twice")
    _GROUPS[name] = list(members)


@dataclass(frozen=True)
class ParsedName:
    base: str
    style: str | None  # None = automatic
    k: int | None  # pooled / projected feature dim
    learned: bool  # "@linK" rather than "@K"

    def spec(self) -> ArchSpec:
        return _ARCHS[self.base]


def parse_model_name(name: str) -> ParsedName:
    """Split ``base[:style][@K|@linK]`` and check each part; raise ``ConfigError`` naming the problem."""
    m = _NAME.match(name.strip()) if isinstance(name, str) else None
    if m is None or m["base"] not in _ARCHS:
        if m is not None and m["base"] in _GROUPS:
            raise ConfigError(f"model {name!r} is a group; build its members (see arch_for_client)")
        raise ConfigError(f"unknown model {name!r}; known: {', '.join(known_models())}")
    spec = _ARCHS[m["base"]]
    style = m["style"]
    if style is not None and style not in spec.styles:
        allowed = ", ".join(f"':{s}'" for s in spec.styles) or "none"
        raise ConfigError(f"model {name!r}: {spec.name} has no ':{style}' variant (allowed: {allowed})")
    k = int(m["k"]) if m["k"] is not None else None
    if k is not None and k < 1:
        raise ConfigError(f"model {name!r}: the feature size after '@' must be >= 1")
    return ParsedName(spec.name, style, k, bool(m["lin"]))


def is_known_model(name: str) -> bool:
    """True for any valid model name, group name, or comma-separated list of model names."""
    try:
        model_group(name)
    except ConfigError:
        return False
    return True


def known_models() -> list[str]:
    """Registered architectures, then groups, then the (modified) names used inside groups."""
    members = sorted({m for ms in _GROUPS.values() for m in ms} - set(_ARCHS))
    return sorted(_ARCHS) + sorted(_GROUPS) + members


def model_group(name: str) -> list[str]:
    """Group name -> its member names; a model name -> ``[name]``; ``"a,b,c"`` -> ``["a", "b", "c"]``."""
    if name in _GROUPS:
        members = list(_GROUPS[name])
    elif isinstance(name, str) and "," in name:
        members = [part.strip() for part in name.split(",") if part.strip()]
    else:
        members = [name]
    if not members:
        raise ConfigError(f"model group {name!r} is empty")
    for member in members:
        parse_model_name(member)
    return members


def arch_for_client(group: str, client_id: int) -> str:
    """The architecture of client ``client_id``: ``group[client_id % len(group)]``."""
    members = model_group(group)
    return members[client_id % len(members)]


def first_client_of_arch(group: str, client_id: int) -> int:
    """The lowest client id with client ``client_id``'s architecture: the id a shared initialisation
    draws from, so it is a function of the architecture (and client 0's, the global model's, is kept)."""
    members = model_group(group)
    return members.index(members[client_id % len(members)])


def resolve_style(spec: ArchSpec, style: str | None, image_size: int) -> str | None:
    if not spec.styles:
        return None
    if style is None:
        style = "cifar" if image_size <= SMALL_IMAGE_MAX else "imagenet"
        if style not in spec.styles:
            style = spec.styles[0]
    return style


def model_modality(name: str) -> Modality:
    """What the model, group or comma-separated list reads: ``"image"`` or ``"text"``; a ConfigError when
    its members read different ones."""
    by_modality: dict[Modality, list[str]] = {}
    for member in model_group(name):
        by_modality.setdefault(parse_model_name(member).spec().modality, []).append(member)
    if len(by_modality) > 1:
        found = "; ".join(f"{DESCRIBE[m]}: {', '.join(ms)}" for m, ms in by_modality.items())
        raise ConfigError(f"model group {name!r} mixes models that read different inputs ({found})")
    return next(iter(by_modality))


def models_reading(modality: str) -> list[str]:
    """The registered architectures that read ``modality``, sorted."""
    return sorted(n for n, spec in _ARCHS.items() if spec.modality == modality)


def min_image_size(name: str, image_size: int | None = None) -> int:
    """Smallest square input the named model accepts (the style may depend on ``image_size``)."""
    parsed = parse_model_name(name)
    spec = parsed.spec()
    if spec.modality != "image":
        raise ConfigError(f"model {name!r} reads {DESCRIBE[spec.modality]}, not images")
    style = resolve_style(spec, parsed.style, image_size if image_size is not None else 32)
    return spec.style_min_size.get(style or "", spec.min_size)


def build_model(arch: str, in_channels: int, image_size: int, num_classes: int) -> FedModel:
    """Build a fresh, randomly initialised zoo model (never pretrained) for square images:
    :func:`build_for` with ``InputShape.image(in_channels, image_size)``."""
    try:
        shape = InputShape.image(in_channels, image_size)
    except ConfigError as e:
        raise ConfigError(f"model {arch!r}: {e}") from None
    return build_for(arch, shape, num_classes)


def build_for(
    arch: str, shape: InputShape, num_classes: int, *, embeddings: torch.Tensor | None = None
) -> FedModel:
    """Build a fresh, randomly initialised zoo model (never pretrained) for inputs of ``shape``.

    ``embeddings`` (``[shape.vocab, D]``) are pretrained token vectors for a text model that takes them
    (``sent140_lstm``); a float32 table is used as it is (never written), not copied. Uses the global
    torch RNG, so seed before calling for reproducible inits.
    """
    parsed = parse_model_name(arch)
    spec = parsed.spec()
    if not isinstance(shape, InputShape):
        raise TypeError(f"build_for needs an InputShape, got {type(shape).__name__}")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ConfigError(f"model {arch!r}: num_classes must be a positive integer, got {num_classes!r}")
    if spec.modality != shape.modality:
        fits = ", ".join(models_reading(shape.modality)) or "none"
        raise ConfigError(
            f"model {arch!r} reads {DESCRIBE[spec.modality]}, the data is {DESCRIBE[shape.modality]}; "
            f"{shape.modality} models: {fits}"
        )
    if embeddings is not None:
        _check_embeddings(arch, spec, shape, embeddings)
    if shape.modality == "image":
        features, dim = _build_image(arch, parsed, spec, shape)
    else:
        kwargs = {"embeddings": embeddings} if spec.embeddings else {}
        features, dim = spec.builder(shape.vocab, shape.size, **kwargs)
    if parsed.k is not None:
        tail: nn.Module = nn.Linear(dim, parsed.k) if parsed.learned else FeaturePool(parsed.k)
        features, dim = nn.Sequential(features, tail), parsed.k
    model = FedModel(features, dim, num_classes, arch=arch, inputs=shape)
    if spec.head_init is not None and parsed.k is None:
        spec.head_init(model.head)
    return model


def require_image_size(arch: str, size: int) -> None:
    """One line naming the models that take ``size`` where ``arch`` needs larger images."""
    need = min_image_size(arch, size)
    if size < need:
        fits = [m for m in models_reading("image") if min_image_size(m, size) <= size]
        hint = f"models for {size}x{size}: {', '.join(fits)}" if fits else "raise data.image_size"
        raise ConfigError(
            f"model {arch!r} needs images of at least {need}x{need} pixels, the data has {size}x{size}; {hint}"
        )


def _build_image(arch: str, parsed: ParsedName, spec: ArchSpec, shape: InputShape) -> tuple[nn.Module, int]:
    require_image_size(arch, shape.size)
    style = resolve_style(spec, parsed.style, shape.size)
    kwargs = {"style": style} if style is not None else {}
    return spec.builder(shape.channels, shape.size, **kwargs)


def require_embeddings(group: str) -> None:
    """Every member of ``group`` takes pretrained token vectors; a one-line ConfigError naming the
    first that does not, and the models that do."""
    for arch in model_group(group):
        if not parse_model_name(arch).spec().embeddings:
            takers = ", ".join(n for n in sorted(_ARCHS) if _ARCHS[n].embeddings) or "none"
            raise ConfigError(f"model {arch!r} takes no pretrained embeddings (models that do: {takers})")


def _check_embeddings(arch: str, spec: ArchSpec, shape: InputShape, embeddings: object) -> None:
    if not spec.embeddings:
        require_embeddings(arch)
    if not isinstance(embeddings, torch.Tensor) or not embeddings.is_floating_point():
        got = (
            f"a {embeddings.dtype} tensor"
            if isinstance(embeddings, torch.Tensor)
            else type(embeddings).__name__
        )
        raise ConfigError(f"model {arch!r}: embeddings must be a float tensor [vocab, dim], got {got}")
    if embeddings.dim() != 2 or embeddings.shape[0] != shape.vocab or embeddings.shape[1] < 1:
        raise ConfigError(
            f"model {arch!r}: embeddings of shape {list(embeddings.shape)} do not fit the data's vocabulary "
            f"of {shape.vocab} token ids; expected [{shape.vocab}, dim]"
        )

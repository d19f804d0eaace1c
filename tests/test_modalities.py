"""Every shipped algorithm on both modalities: two rounds on FEMNIST-format files (images, natural
clients) and on Shakespeare-format files (token ids, LEAF's LSTM), in the test's process; Sent140 with
frozen GloVe vectors kept out of every server state; one real ``fedray run`` (Ray actors, MLflow) on
Shakespeare; and the one-line refusals of image-only options and of a model of the other modality."""

from __future__ import annotations

import pytest
from conftest import tiny_overrides
from in_process import tensors, train_rounds
from leaf_files import (
    NEGATIVE,
    NEUTRAL,
    POSITIVE,
    write_femnist,
    write_glove,
    write_sent140,
    write_shakespeare,
)

from fedray.platform.api.registry import registered_by
from fedray.platform.catalog import load_config
from fedray.platform.errors import ConfigError
from fedray.platform.runtime.coordinator import build_server
from fedray.platform.runtime.driver import federation_meta, prepare_federation

SHIPPED = registered_by("fedray.algorithms")
# algorithms that crop and flip their own views of images: on text, one line says so instead
IMAGE_ONLY = {"fedclassavg"}
# the model each modality's run trains: small enough for two CPU rounds of every algorithm
MODEL = {"femnist": "cnn_small", "shakespeare": "leaf_lstm@64", "sent140": "sent140_lstm"}


@pytest.fixture(scope="module")
def leaf_roots(tmp_path_factory):
    root = tmp_path_factory.mktemp("leaf")
    return {
        "femnist": write_femnist(root, users=6, per_user=(20, 40)),
        # a 0.45 train share keeps short roles (LEAF drops 79 windows between a role's train and test)
        "shakespeare": write_shakespeare(root, users=8, per_user=(130, 170), train_fraction=0.45),
    }


def leaf_config(dataset: str, root, **extra):
    overrides = {
        "data.dataset": dataset,
        "data.root": str(root),
        "data.num_clients": 4,
        "data.partition.kind": "natural",
        "data.split.convention": "official_test",  # each client tests on its own held-out samples
        "data.split.train": 1.0,
        "data.split.val": 0.0,
        "data.split.test": 0.0,
        "model.group": MODEL[dataset],
        "train.local_epochs": 1,
        "train.batch_size": 16,
        "train.fraction": 0.5,
        **extra,
    }
    return load_config(None, tiny_overrides(**overrides))


def test_every_shipped_algorithm_is_covered():
    assert {"fedavg", "fedcross", "fedl2g", "fedproto", "fedsc", "fedssa", "lgfedavg"} <= set(SHIPPED)


@pytest.mark.parametrize("dataset", ["femnist", "shakespeare"])
@pytest.mark.parametrize("algorithm", SHIPPED)
def test_every_algorithm_trains_two_rounds_on_each_modality(algorithm, dataset, leaf_roots):
    extra = {"fedl2g.warmup_rounds": 0} if algorithm == "fedl2g" else {}
    if algorithm in IMAGE_ONLY and dataset == "shakespeare":
        with pytest.raises(ConfigError, match=f"algorithm '{algorithm}' draws cropped and flipped views"):
            leaf_config(dataset, leaf_roots[dataset], algorithm=algorithm, **extra)
        return
    cfg = leaf_config(dataset, leaf_roots[dataset], algorithm=algorithm, **extra)
    scores = train_rounds(cfg, 2)
    assert scores and all(total > 0 and 0 <= correct <= total for _, correct, total, _ in scores)


@pytest.mark.parametrize("algorithm", ["fedavg", "fedcross", "fedprox"])
def test_frozen_glove_vectors_train_and_stay_out_of_the_server_state(algorithm, tmp_path):
    """What a server holds is what its payloads and checkpoints carry: the trained weights only."""
    root = write_sent140(tmp_path, users=6, per_user=(20, 30))
    glove = write_glove(tmp_path / "glove.txt", [*POSITIVE, *NEGATIVE, *NEUTRAL], dim=300)
    cfg = leaf_config("sent140", root, algorithm=algorithm, **{"data.leaf.glove": str(glove)})
    fed = prepare_federation(cfg)
    assert fed.embeddings is not None and fed.embeddings.shape[1] == 300
    state = tensors(build_server(cfg, federation_meta(fed)).state_dict())
    assert any("lstm" in k for k in state) and not any("embedding" in k for k in state), sorted(state)
    scores = train_rounds(cfg, 2)
    assert scores and all(total > 0 for _, _, total, _ in scores)


def test_a_real_run_on_shakespeare(leaf_roots, ray_session, mlflow_store):
    from fedray.platform.runtime.driver import run_experiment

    cfg = leaf_config("shakespeare", leaf_roots["shakespeare"], algorithm="fedcross", rounds=2)
    result = run_experiment(cfg)
    assert len(result.history) == 2
    assert 0.0 <= result.history[-1]["acc/global"] <= 1.0
    import mlflow

    run = mlflow.MlflowClient(mlflow_store).get_run(result.run_id)
    assert run.data.params["data.dataset"] == "shakespeare"
    (entry,) = run.inputs.dataset_inputs
    assert '"text": [80]' in entry.dataset.profile  # the sample shape MLflow records: 80 token ids


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"data.augment": "crop_flip"}, r"data.augment=crop_flip: shakespeare is text"),
        ({"data.normalize": "0.5,0.5"}, r"data.normalize='0.5,0.5': shakespeare is text"),
        ({"data.image_size": 32}, r"data.image_size=32: shakespeare is text"),
        (
            {"model.group": "cnn_small"},
            r"model.group='cnn_small' reads image, data.dataset=shakespeare is text",
        ),
    ],
)
def test_image_only_options_on_text_are_one_line_errors(overrides, message, leaf_roots):
    from fedray.platform.runtime.driver import prepare_federation

    with pytest.raises(ConfigError, match=message) as err:
        prepare_federation(leaf_config("shakespeare", leaf_roots["shakespeare"], **overrides))
    assert "\n" not in str(err.value)


def test_a_text_model_on_images_names_the_image_models(leaf_roots):
    with pytest.raises(
        ConfigError, match=r"reads text, data.dataset=femnist is images; image models: .*leaf_cnn"
    ):
        leaf_config("femnist", leaf_roots["femnist"], **{"model.group": "leaf_lstm"})


def test_natural_partition_on_a_dataset_without_clients_is_refused():
    from fedray.platform.data import check_data

    cfg = load_config(None, tiny_overrides(**{"data.partition.kind": "natural"}))
    with pytest.raises(ConfigError, match="synthetic has no clients of its own"):
        check_data(cfg.data)

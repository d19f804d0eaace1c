"""FedProto math and halves, checked against hand computations; no Ray, no Lightning trainer."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from fedray.algorithms.fedproto import (
    FedProtoClient,
    FedProtoServer,
    aggregate_prototypes,
    class_prototypes,
    nearest_prototype_scores,
    prototype_loss,
)
from fedray.platform.api.algorithm import ClientContext, ServerContext
from fedray.platform.api.prototypes import masked_mean, scatter_rows
from fedray.platform.catalog import load_config
from fedray.platform.data import ArrayDataset
from fedray.platform.errors import ConfigError, ContractError
from fedray.platform.models import FedModel, arch_for_client, build_model
from fedray.platform.models import registry as model_registry

# two clients, four classes, d = 1:  A holds class 0 (1 sample, proto 1) and class 2 (3 samples, proto 4);
# B holds class 0 (3 samples, proto 3) and class 1 (2 samples, proto 7); nobody holds class 3.
PROTOS = torch.tensor([[[1.0], [0.0], [4.0], [0.0]], [[3.0], [7.0], [99.0], [0.0]]])  # B's 99: count 0
COUNTS = torch.tensor([[1, 0, 3, 0], [3, 2, 0, 0]])


def uplink(classes: list[int], protos: list[float], counts: list[int]) -> dict[str, torch.Tensor]:
    """A client's upload: only the classes it holds travel."""
    return {
        "classes": torch.tensor(classes),
        "protos": torch.tensor(protos)[:, None],
        "counts": torch.tensor(counts),
    }


UPLINK_A = uplink([0, 2], [1.0, 4.0], [1, 3])
UPLINK_B = uplink([0, 1], [3.0, 7.0], [3, 2])  # the same two clients as uplinks


def float_data(x: torch.Tensor, y: torch.Tensor) -> ArrayDataset:
    """A train split as the client sees it: normalised float images."""
    return ArrayDataset(x, y)


# x flattened (d = 4): class 0 = [1,2,3,4], [3,2,1,0] -> mean [2,2,2,2];
#                      class 2 = [0,0,0,8], [2,2,2,0] -> mean [1,1,1,4]
X = torch.tensor([[1.0, 2, 3, 4], [3, 2, 1, 0], [0, 0, 0, 8], [2, 2, 2, 0]]).view(4, 1, 2, 2)
Y = torch.tensor([0, 0, 2, 2])


def flatten_model() -> FedModel:
    """features = Flatten (so prototypes are class means of the raw inputs), head = a known Linear(4, 3)."""
    model = FedModel(nn.Flatten(), 4, 3, arch="flat", in_channels=1, image_size=2)
    with torch.no_grad():
        model.head.weight.copy_(torch.tensor([[1.0, 0, 0, 0], [0, 1, 0, 0], [1, 1, 1, 1]]))
        model.head.bias.copy_(torch.tensor([0.0, 1.0, 0.0]))
    return model


def make_client(cls, algorithm: str, *overrides: str) -> FedProtoClient:
    cfg = load_config(None, [f"algorithm={algorithm}", *overrides])
    return cls(flatten_model(), ClientContext(0, cfg, 3, float_data(X, Y), torch.bincount(Y, minlength=3)))


def test_class_prototypes_by_hand():
    # class 0: ([1,0] + [3,2]) / 2 = [2,1]; class 1: none -> 0; class 2: [5,5]
    z = torch.tensor([[1.0, 0.0], [3.0, 2.0], [5.0, 5.0]])
    protos, counts = class_prototypes(z, torch.tensor([0, 0, 2]), 3)
    assert_close(protos, torch.tensor([[2.0, 1.0], [0.0, 0.0], [5.0, 5.0]]))
    assert counts.tolist() == [2, 0, 1]


def test_aggregate_prototypes_weighted_by_counts():
    # class 0: (1*1 + 3*3) / 4 = 2.5; class 1: 7; class 2: 4 (B's row ignored, count 0); class 3: nobody -> 0
    out, mask = aggregate_prototypes(PROTOS, COUNTS, weighted=True)
    assert_close(out, torch.tensor([[2.5], [7.0], [4.0], [0.0]]))
    assert mask.tolist() == [True, True, True, False]


def test_aggregate_prototypes_plain_mean_over_holders():
    # class 0: (1 + 3) / 2 = 2; the rest as above
    out, mask = aggregate_prototypes(PROTOS, COUNTS, weighted=False)
    assert_close(out, torch.tensor([[2.0], [7.0], [4.0], [0.0]]))
    assert mask.tolist() == [True, True, True, False]


def test_prototype_loss_by_hand():
    # sample 0 (class 0): (1-0)^2 + (1-0)^2 = 2; sample 1 (class 1, no global prototype): 0 -> 2 / (B*d = 4)
    z = torch.tensor([[1.0, 1.0], [2.0, 0.0]])
    targets = torch.tensor([[0.0, 0.0], [5.0, 5.0]])
    loss = prototype_loss(z, targets, torch.tensor([True, False]), torch.tensor([0, 1]))
    assert_close(loss, torch.tensor(0.5))


def test_scatter_rows_makes_dense_tensors_of_per_client_class_rows():
    ups = [UPLINK_A, UPLINK_B]
    classes = [u["classes"] for u in ups]
    protos, held = scatter_rows([u["protos"] for u in ups], classes, 4)
    counts, _ = scatter_rows([u["counts"][:, None] for u in ups], classes, 4)
    assert_close(counts[..., 0].to(torch.int64), COUNTS)
    assert held.tolist() == (COUNTS > 0).tolist()
    assert_close(protos[0], PROTOS[0])
    assert_close(protos[1, :2], PROTOS[1, :2])


def test_masked_mean_averages_over_the_clients_that_hold_each_class():
    # 3 clients, 3 classes, m = 1; class 0 held by clients 0 and 2: (2 + 6) / 2; class 1 by client 1
    # only; class 2 by nobody. Absent slots hold garbage (NaN) that must not leak.
    nan = float("nan")
    values = torch.tensor([[[2.0], [nan], [nan]], [[nan], [5.0], [nan]], [[6.0], [nan], [nan]]])
    mask = torch.tensor([[True, False, False], [False, True, False], [True, False, False]])
    mean, count = masked_mean(values, mask)
    assert_close(mean, torch.tensor([[4.0], [5.0], [0.0]]))
    assert count.tolist() == [2, 1, 0]


def test_server_aggregates_uploads_and_sends_prototypes():
    cfg = load_config(None, ["algorithm=fedproto", "model.group=small_hetero"])
    archs = [arch_for_client("small_hetero", cid) for cid in range(3)]
    server = FedProtoServer(ServerContext(cfg, 3, 4, archs, lambda cid: build_model(archs[cid], 1, 8, 4)))
    assert server.dim == 128
    assert server.configure(0, [0, 1]) == {0: {}, 1: {}}  # nothing before the first uploads
    server.aggregate(0, {0: UPLINK_A, 4: UPLINK_B})
    down = server.configure(1, [2])[2]
    assert_close(down["protos"], torch.tensor([[2.5], [7.0], [4.0], [0.0]]))
    assert down["mask"].tolist() == [True, True, True, False]


def test_mixed_feature_sizes_are_refused_in_config_validation(monkeypatch):
    """FedProto declares it needs one feature size (SHARED_FEATURES); FD, whose prototypes are
    logits, does not. The check runs when the config is built, before any data or Ray."""
    monkeypatch.setitem(model_registry._GROUPS, "mixed_dims", ["cnn_small", "cnn_small_wide"])
    with pytest.raises(ConfigError, match="algorithm=fedproto needs one feature size across the group"):
        load_config(None, ["algorithm=fedproto", "model.group=mixed_dims"])
    assert load_config(None, ["algorithm=feddistill", "model.group=mixed_dims"]).model.group == "mixed_dims"


def test_feature_dim_is_refused_to_an_algorithm_that_did_not_declare_it():
    cfg = load_config(None, ["algorithm=feddistill"])
    ctx = ServerContext(cfg, 2, 10, ["cnn_small"] * 2, lambda cid: build_model("cnn_small", 1, 8, 10))
    with pytest.raises(ContractError, match="without declaring it"):
        ctx.feature_dim  # noqa: B018


def test_client_uploads_class_means_of_its_representations():
    client = make_client(FedProtoClient, "fedproto", "fedproto.collect=after")
    up = client.upload()
    assert up["classes"].tolist() == [0, 2]
    assert_close(up["protos"], torch.tensor([[2.0, 2, 2, 2], [1, 1, 1, 4]]))
    assert up["counts"].tolist() == [2, 2]


@pytest.mark.parametrize("algorithm", ["fedproto", "feddistill"])
def test_collected_during_training_the_upload_is_the_class_means_of_what_each_step_produced(algorithm):
    """HtFLlib's clientproto: every batch's representations, in train mode and before the batch's
    step, over every epoch; here seen by hooks on the model, apart from the client's own sums."""
    from fedray.algorithms.feddistill import FedDistillClient
    from fedray.platform.runtime.local_training import LocalTraining

    cls = FedProtoClient if algorithm == "fedproto" else FedDistillClient
    client = make_client(cls, algorithm, "train.batch_size=2", "train.lr=0.5", "train.momentum=0")
    produced, labels = [], []
    space = client.model.features if algorithm == "fedproto" else client.model.head
    space.register_forward_hook(lambda module, args, out: produced.append(out.detach().clone()))
    train = client.training_step
    client.training_step = lambda batch, i: (labels.append(batch[1]), train(batch, i))[1]
    LocalTraining(client.ctx.cfg.train, torch.device("cpu")).fit(client, 2)
    up = client.upload()
    reps, y = torch.cat(produced), torch.cat(labels)
    assert len(y) == 8  # every sample, twice
    assert up["classes"].tolist() == [0, 2] and up["counts"].tolist() == [2, 2]  # the samples it holds
    assert_close(up["protos"], torch.stack([reps[y == c].mean(0) for c in (0, 2)]))
    if algorithm == "feddistill":  # the head trained between the steps: not the trained model's logits
        trained = client.model.head(X.flatten(1)).detach()
        assert not torch.allclose(up["protos"][0], trained[Y == 0].mean(0))
    assert client.upload()["classes"].numel() == 0  # consumed: a round without training uploads nothing


def test_training_step_adds_lam_times_the_prototype_pull():
    client = make_client(FedProtoClient, "fedproto", "fedproto.lam=0.5")
    x, y = X[:2], Y[:2]  # class 0 twice; z = [1,2,3,4], [3,2,1,0]
    plain = F.cross_entropy(client.model(x), y)
    assert_close(client.training_step((x, y), 0), plain)  # round 0: no prototypes yet
    targets = torch.tensor([[2.0, 2, 2, 2], [0, 0, 0, 0], [0, 0, 0, 0]])
    client.receive(1, {"protos": targets, "mask": torch.tensor([True, False, False])})
    # (z - [2,2,2,2])^2 = [1,0,1,4] + [1,0,1,4] -> 12 / 8 = 1.5; times lam 0.5 = 0.75
    assert_close(client.training_step((x, y), 0), plain + 0.75)


def test_nearest_prototype_scores_by_hand():
    z = torch.tensor([[0.0, 0.0], [3.0, 1.0]])
    protos = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([True, True, False])
    # squared distances: row 0 -> 1, 9, (0 but masked); row 1 -> 5, 1, (10)
    scores = nearest_prototype_scores(z, protos, mask)
    assert_close(scores[:, :2], torch.tensor([[-1.0, -9.0], [-5.0, -1.0]]))
    assert torch.isinf(scores[:, 2]).all()
    assert scores.argmax(1).tolist() == [0, 1]  # class 2 is nearest to row 0 but has no prototype


def test_evaluation_predicts_the_nearest_global_prototype_by_default():
    cfg = load_config(None, ["algorithm=fedproto"])
    archs = ["flat"] * 2
    server = FedProtoServer(ServerContext(cfg, 2, 3, archs, lambda cid: flatten_model()))
    server.aggregate(
        0,
        {
            0: {
                "classes": torch.tensor([0, 2]),
                "protos": torch.tensor([[0.0, 0, 0, 0], [8, 8, 8, 8]]),
                "counts": torch.tensor([1, 1]),
            }
        },
    )
    payload = server.eval_payload()
    client = make_client(FedProtoClient, "fedproto")
    client.load_for_eval(payload)
    x = torch.tensor([[1.0, 1, 1, 1], [7, 7, 7, 7]]).view(2, 1, 2, 2)
    # head logits of x = [1,1,1,1]: [1, 2, 4] -> class 2; the nearest prototype is class 0's
    assert client.model(x).argmax(1).tolist() == [2, 2]
    assert client.eval_logits(x).argmax(1).tolist() == [0, 2]
    # the option: score with the head, and no evaluation payload travels
    head = FedProtoServer(
        ServerContext(
            load_config(None, ["algorithm=fedproto", "fedproto.eval=head"]),
            2,
            3,
            archs,
            lambda cid: flatten_model(),
        )
    )
    assert head.eval_payload() is None
    head_client = make_client(FedProtoClient, "fedproto", "fedproto.eval=head")
    head_client.load_for_eval(payload)
    assert head_client.eval_logits(x).argmax(1).tolist() == [2, 2]

"""FedNTD's not-true distillation and client, checked by hand and against an independent teacher; no Ray."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from test_algo_fedproto import X
from test_algo_moon import bn_model
from torch.testing import assert_close

from fedray.algorithms.fedavg import FedAvgServer
from fedray.algorithms.fedntd import FedNTDClient, not_true_distillation, not_true_logits
from fedray.platform.api import registry
from fedray.platform.api.algorithm import ClientContext
from fedray.platform.catalog import load_config
from fedray.platform.data import ArrayDataset
from fedray.platform.errors import ConfigError

Y = torch.tensor([0, 0, 2, 1])


def test_not_true_logits_drop_each_rows_label():
    logits = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
    assert torch.equal(
        not_true_logits(logits, torch.tensor([0, 2, 1])), torch.tensor([[2.0, 3], [4, 5], [7, 9]])
    )


def test_the_distillation_by_hand_and_blind_to_the_true_class():
    # label 1: the not-true logits are columns 0 and 2. Student uniform over them; the teacher's
    # softmax over [ln 3, 0] is [3/4, 1/4]: KL = 3/4 ln(3/2) + 1/4 ln(1/2)
    student = torch.tensor([[0.0, 9.0, 0.0]])
    teacher = torch.tensor([[math.log(3), -4.0, 0.0]])
    y = torch.tensor([1])
    expected = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert_close(not_true_distillation(student, teacher, y, tau=1.0), torch.tensor(expected))
    # the true class's logit, the student's or the teacher's, changes nothing
    moved = not_true_distillation(student + torch.tensor([[0.0, -20.0, 0.0]]), teacher * 1, y, tau=1.0)
    assert_close(moved, torch.tensor(expected))
    # at tau = 2 the teacher's not-true softmax is over [ln 3 / 2, 0]: [sqrt3, 1] / (sqrt3 + 1)
    p = math.sqrt(3) / (math.sqrt(3) + 1)
    at_two = p * math.log(2 * p) + (1 - p) * math.log(2 * (1 - p))
    assert_close(not_true_distillation(student, teacher, y, tau=2.0), torch.tensor(at_two))
    # a batch is averaged (KL's batchmean): the same sample twice gives the same value
    assert_close(
        not_true_distillation(student.repeat(2, 1), teacher.repeat(2, 1), y.repeat(2), 1.0),
        torch.tensor(expected),
    )


def test_the_client_distils_from_the_received_model_in_eval_mode_however_far_it_trained():
    cfg = load_config(None, ["algorithm=fedntd", "fedntd.beta=0.7", "fedntd.tau=2"])
    client = FedNTDClient(bn_model(0), ClientContext(0, cfg, 3, ArrayDataset(X, Y)))
    received = bn_model(1).state_dict()
    received["features.2.running_mean"] = torch.tensor([0.5, -1.0, 2.0])  # statistics unlike a batch's
    client.begin_round(0, {"model": received})
    teacher = copy.deepcopy(client.model).eval()
    with torch.no_grad():  # a local step moves the model away from what it received
        for p in client.model.parameters():
            p.add_(0.3)
    live = copy.deepcopy(client.model)
    with torch.no_grad():
        teacher_logits = teacher(X)
    logits = live(X)
    expected = F.cross_entropy(logits, Y) + 0.7 * not_true_distillation(logits, teacher_logits, Y, 2.0)
    assert_close(client.training_step((X, Y), 0), expected)
    assert all(m.training for m in client.model.modules())  # the teacher's pass left the modes alone
    assert torch.equal(client.model.features[2].running_mean, live.features[2].running_mean)
    assert "global_weights" not in client.state_dict()  # a round's teacher, not the client's state


def test_the_server_is_fedavgs_and_a_client_keeps_nothing():
    spec = registry.get("fedntd")
    assert spec.server_cls is FedAvgServer and spec.client_cls.keeps_state is False


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["fedntd.tau=0"], "fedntd.tau=0.0: must be > 0"),
        (["fedntd.beta=-1"], "fedntd.beta=-1.0: must be >= 0"),
    ],
)
def test_bad_settings_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, ["algorithm=fedntd", *overrides])

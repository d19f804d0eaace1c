"""FML's mutual losses, its halves, the group's smallest model and the logging of a global model of
another architecture than client 0's; no Ray."""

import copy
import math

import pytest
import torch
from conftest import tiny_overrides
from torch.testing import assert_close

from fedray.algorithms.fml import FMLClient, FMLServer, distillation, mutual_losses
from fedray.platform.api.algorithm import ClientContext, ServerContext
from fedray.platform.catalog import load_config
from fedray.platform.data import ArrayDataset
from fedray.platform.errors import ConfigError, ContractError
from fedray.platform.models import arch_for_client, build_model, model_group
from fedray.platform.runtime.driver import Result, federation_meta, log_final, prepare_federation
from fedray.platform.runtime.worker import member_model, model_of_arch, smallest_arch


def test_the_mutual_losses_by_hand():
    p = torch.tensor([[0.0, math.log(3)]], requires_grad=True)  # softmax [1/4, 3/4]
    q = torch.tensor([[0.0, 0.0]], requires_grad=True)  # softmax [1/2, 1/2]
    y = torch.tensor([1])
    kl_q_p = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)  # KL(sigma(q) || sigma(p))
    kl_p_q = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    private, meme = mutual_losses(p, q, y, alpha=0.3, beta=0.8)
    assert_close(private, torch.tensor(0.3 * -math.log(0.75) + 0.7 * kl_q_p))
    assert_close(meme, torch.tensor(0.8 * -math.log(0.5) + 0.2 * kl_p_q))
    # each KL's target is a constant: the private loss moves only p, the meme loss only q
    private.backward()
    assert q.grad is None and p.grad is not None
    # averaged over the batch, not over batch and classes (HtFLlib's nn.KLDivLoss() default)
    assert_close(distillation(p.detach().repeat(3, 1), q.detach().repeat(3, 1)), torch.tensor(kl_q_p))


def small_hetero_cfg(*overrides: str):
    return load_config(
        None, tiny_overrides(algorithm="fml", **{"model.group": "small_hetero"}) + list(overrides)
    )


def test_the_shared_model_is_the_groups_smallest_member():
    cfg = small_hetero_cfg()
    meta = federation_meta(prepare_federation(cfg))
    sizes = {
        a: sum(p.numel() for p in model_of_arch(a, meta).parameters()) for a in model_group("small_hetero")
    }
    assert smallest_arch(cfg, meta) == min(sizes, key=sizes.get) == "cnn_small_deep@128"
    assert member_model(cfg, "cnn_small_deep@128", meta).arch == "cnn_small_deep@128"
    with pytest.raises(ContractError, match=r"model 'resnet18' is not in model\.group='small_hetero'"):
        member_model(cfg, "resnet18", meta)


def contexts(cfg, meta):
    n = cfg.data.num_clients
    archs = [arch_for_client(cfg.model.group, c) for c in range(n)]
    small = smallest_arch(cfg, meta)
    server_ctx = ServerContext(
        cfg,
        n,
        meta["num_classes"],
        archs,
        lambda c: model_of_arch(archs[c], meta),
        find_smallest=lambda: small,
        make_arch=lambda a: member_model(cfg, a, meta),
    )
    return server_ctx, small


def test_the_server_sends_the_meme_model_and_keeps_the_uploaders_mean():
    cfg = small_hetero_cfg()
    meta = federation_meta(prepare_federation(cfg))
    server_ctx, small = contexts(cfg, meta)
    server = FMLServer(server_ctx)
    assert server.meme.arch == small and server.global_model() is server.meme
    assert server.eval_payload() is None  # clients are tested with their private models
    down = server.configure(0, [1, 3])
    assert set(down[1]) == {"meme"} and down[1]["meme"].keys() == server.meme.state_dict().keys()
    ups = {}
    for cid, fill in ((1, 1.0), (3, 4.0)):  # unweighted: no sample counts travel
        ups[cid] = {
            "meme": {
                k: torch.full_like(v, fill) if v.is_floating_point() else v
                for k, v in down[1]["meme"].items()
            }
        }
    server.aggregate(0, ups)
    for k, v in server.meme.state_dict().items():
        if v.is_floating_point():
            assert torch.equal(v, torch.full_like(v, 2.5)), k


def test_the_client_trains_both_models_and_uploads_the_meme_one():
    cfg = small_hetero_cfg("fml.alpha=0.4", "fml.beta=0.6")
    meta = federation_meta(prepare_federation(cfg))
    small = smallest_arch(cfg, meta)
    torch.manual_seed(0)
    x, y = torch.randn(6, 1, 8, 8), torch.tensor([0, 1, 2, 3, 4, 5])
    ctx = ClientContext(
        0, cfg, meta["num_classes"], ArrayDataset(x, y), find_smallest=lambda: small,
        make_arch=lambda a: member_model(cfg, a, meta),
    )  # fmt: skip
    client = FMLClient(model_of_arch(arch_for_client(cfg.model.group, 0), meta), ctx)
    assert client.meme.arch == small and client.model.arch != small  # a heterogeneous pair
    private_before = copy.deepcopy(client.model.state_dict())
    sent = build_model(small, 1, 8, meta["num_classes"]).state_dict()
    client.begin_round(0, {"meme": sent})
    for k, v in client.meme.state_dict().items():
        assert torch.equal(v, sent[k]), k
    for k, v in client.model.state_dict().items():  # the downlink leaves the private model alone
        assert torch.equal(v, private_before[k]), k
    p, q = copy.deepcopy(client.model)(x), copy.deepcopy(client.meme)(x)
    expected = sum(mutual_losses(p, q, y, 0.4, 0.6))
    assert_close(client.training_step((x, y), 0), expected)
    up = client.upload()
    assert set(up) == {"meme"} and up["meme"].keys() == sent.keys()


def test_log_final_logs_a_global_model_of_its_own_architecture():
    """FML's global model is the group's smallest member (client 2's here), not client 0's."""
    cfg = small_hetero_cfg()
    fed = prepare_federation(cfg)
    meta = federation_meta(fed)
    small = smallest_arch(cfg, meta)
    assert small != arch_for_client(cfg.model.group, 0)
    logged = []

    class Recorder:
        def model_names(self):
            return set()

        def log_model(self, model, name, example, step=0, with_example=True):
            logged.append((name, model.arch))

        def __getattr__(self, name):
            return lambda *args, **kwargs: 0

    state = model_of_arch(small, meta).state_dict()
    log_final(Recorder(), Result("run", "0", cfg, [], {}, True, 0.0), fed, (state, small), {}, "")
    assert logged == [("global_model", small)]


@pytest.mark.parametrize("key", ["alpha", "beta"])
def test_weights_outside_zero_one_are_one_line_errors(key):
    with pytest.raises(ConfigError, match=f"fml.{key}=1.5: must be in \\[0, 1\\]"):
        load_config(None, ["algorithm=fml", f"fml.{key}=1.5"])


def test_the_smallest_member_is_found_only_when_an_algorithm_asks():
    """A model that cannot be built on the meta device must not break the algorithms that never ask."""
    from fedray.algorithms.fedavg import FedAvgClient

    def unbuildable() -> str:
        raise RuntimeError("no meta-device build for this model")

    cfg = load_config(None, ["algorithm=fedavg"])
    ctx = ClientContext(
        0,
        cfg,
        10,
        ArrayDataset(torch.zeros(2, 1, 8, 8), torch.zeros(2, dtype=torch.long)),
        find_smallest=unbuildable,
    )
    FedAvgClient(build_model("cnn_small", 1, 8, 10), ctx)  # built without asking
    with pytest.raises(RuntimeError, match="no meta-device build"):
        _ = ctx.smallest_arch
    bare = ClientContext(0, cfg, 10, ArrayDataset(torch.zeros(2, 1, 8, 8), torch.zeros(2, dtype=torch.long)))
    with pytest.raises(
        ContractError, match=r"ClientContext\.smallest_arch: this context was built without find_smallest"
    ):
        _ = bare.smallest_arch

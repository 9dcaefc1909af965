"""The real workloads train under Horovod: dense and top-k each lower the validation loss from the
start, and every rank ends with bitwise-identical parameters.

Short on purpose (and at -np 2 only: it tests training, not the exchange): a few dozen steps of plain
SGD at a small batch per rank. No momentum: ResNet-18 is evaluated with BatchNorm's running
statistics, which lag a model that moves fast; with momentum 0.9 its test loss rose in 24 steps.
ResNet-18 is torchvision's, at full size; the language model is the workload's
``ByteTransformer`` at a reduced size (2 layers x d_model 128) on the workload's own data,
batches and evaluation, since the 6 x 512 default costs about half a second a step here. The
seeded factory builds the same model on every rank, which is checked, so nothing is broadcast.
"""
import horovod.torch as hvd
import pytest
import torch

import horovod_sparse.torch as hvds
from horovod_sparse import workloads

# training quality on the real workloads, not the exchange (which runs at every P elsewhere)
pytestmark = pytest.mark.world_sizes(2)

#: per workload: the model, its steps and batch per rank, SGD's learning rate, the evaluation
CASES = {
    "digits_resnet": dict(build={}, steps=24, batch=8, lr=0.02, evaluate={}),
    "stdlib_lm": dict(build=dict(layers=2, d_model=128, heads=4), steps=30, batch=4, lr=0.1,
                      evaluate=dict(count=32)),
}
COMPRESSIONS = {"dense": lambda: hvd.Compression.none,
                "topk": lambda: hvds.Compression.topk(density=0.01)}


def flat_parameters(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("compression", sorted(COMPRESSIONS))
@pytest.mark.parametrize("name", sorted(CASES))  # cluttered_resnet: digits_resnet's model on other data
def test_lowers_validation_loss_and_keeps_replicas_identical(name, compression, assert_identical_across_ranks,
                                                             record_property):
    workload, case = workloads.get(name), CASES[name]
    model = workload.build_model(seed=0, **case["build"])
    assert_identical_across_ranks(flat_parameters(model))
    before = workload.evaluate(model, **case["evaluate"])["loss"]

    opt = torch.optim.SGD(model.parameters(), lr=case["lr"])
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=COMPRESSIONS[compression]())
    batches = workload.batches(hvd.rank(), hvd.size(), case["batch"])
    for _ in range(case["steps"]):
        opt.zero_grad()
        workload.loss(model, next(batches)).backward()
        opt.step()

    assert_identical_across_ranks(flat_parameters(model))
    after = workload.evaluate(model, **case["evaluate"])["loss"]
    record_property("validation_loss", f"{before:.4f} -> {after:.4f}")
    assert after < before, f"{name}, {compression}: validation loss {before:.4f} -> {after:.4f}"

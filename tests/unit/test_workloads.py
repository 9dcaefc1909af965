"""The real workloads' data and models: fixed splits, the same batches on every run and call,
rank shards that are disjoint and make up the global batch, and no network access."""
import hashlib
import socket
import subprocess
import sys
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import torch

from horovod_sparse import workloads
from horovod_sparse.exact_steps import ExactSteps
from horovod_sparse.workloads import digits_data, stdlib_text
from horovod_sparse.workloads.byte_transformer import ByteTransformer
from horovod_sparse.workloads.sharding import shard_indices

SMALL_LM = dict(layers=1, d_model=32, heads=2)


def fingerprint(name, rank=1, size=2, batch=4, steps=3):
    """sha256 of the first ``steps`` batches of rank ``rank`` in workload ``name``."""
    digest = hashlib.sha256()
    for tensors in islice(workloads.get(name).batches(rank, size, batch), steps):
        for tensor in tensors:
            digest.update(tensor.contiguous().numpy().tobytes())
    return digest.hexdigest()


# -- sharding ----------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [60, 23])  # 23: global batches run across epoch ends
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_rank_shards_are_disjoint_and_make_up_the_global_batch(size, n):
    batch = 5
    shards = [list(islice(shard_indices(n, rank, size, batch, seed=7), 12)) for rank in range(size)]
    single = list(islice(shard_indices(n, 0, 1, batch * size, seed=7), 12))
    for step in range(12):
        parts = [shards[rank][step] for rank in range(size)]
        assert all(len(part) == batch for part in parts)
        assert np.array_equal(np.concatenate(parts), single[step])  # in rank order
        if n % (batch * size) == 0:  # no global batch spans two epochs
            assert len(set(np.concatenate(parts).tolist())) == batch * size


def test_each_epoch_sees_every_example_once():
    stream = np.concatenate(list(islice(shard_indices(12, 0, 1, 4, seed=3), 6)))
    for epoch in stream.reshape(2, 12):
        assert sorted(epoch.tolist()) == list(range(12))
    assert not np.array_equal(stream[:12], stream[12:])  # a new order each epoch


def test_shard_indices_refuses_a_rank_outside_the_job():
    with pytest.raises(ValueError):
        next(shard_indices(10, rank=2, size=2, batch=1))


# -- splits ------------------------------------------------------------------------------------

def test_digits_split_is_fixed_disjoint_and_complete():
    train, test = digits_data.split_indices()
    again_train, again_test = digits_data.split_indices()
    assert torch.equal(train, again_train) and torch.equal(test, again_test)
    assert (len(train), len(test)) == (1437, 360)
    assert sorted(torch.cat([train, test]).tolist()) == list(range(1797))
    data = digits_data.load()
    assert data.train_x.shape == (1437, 3, 32, 32) and data.test_x.shape == (360, 3, 32, 32)
    assert abs(data.train_x.mean().item()) < 1e-4 and abs(data.train_x.std().item() - 1) < 1e-3
    assert sorted(set(data.test_y.tolist())) == list(range(10))


def test_cluttered_digits_come_from_their_split_and_do_not_change():
    data = digits_data.load_cluttered()
    assert data.train_x.shape == (12000, 3, 32, 32) and data.test_x.shape == (2000, 3, 32, 32)
    assert abs(data.train_x.mean().item()) < 1e-4 and abs(data.train_x.std().item() - 1) < 1e-3
    counts = torch.bincount(data.train_y, minlength=10)
    assert counts.min() > 0.08 * 12000 and counts.max() < 0.12 * 12000  # every class, near uniform
    digest = hashlib.sha256(data.test_x.numpy().tobytes() + data.test_y.numpy().tobytes()).hexdigest()
    digits_data.load_cluttered.cache_clear()
    again = digits_data.load_cluttered()
    assert hashlib.sha256(again.test_x.numpy().tobytes() + again.test_y.numpy().tobytes()).hexdigest() == digest


def test_cluttered_digits_do_not_depend_on_torchs_thread_count():
    """A float32 sum of the noisy set changes with the threads that split it: the ranks of a job
    and a fresh interpreter would normalise with other bits."""
    threads, digests = torch.get_num_threads(), []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            digits_data.load_cluttered.cache_clear()
            digests.append(hashlib.sha256(digits_data.load_cluttered().train_x.numpy().tobytes()).hexdigest())
    finally:
        torch.set_num_threads(threads)
        digits_data.load_cluttered.cache_clear()
    assert digests[0] == digests[1]


def test_clutter_places_the_labelled_digit_among_fragments(monkeypatch):
    side = digits_data.DIGIT_SIDE
    digits = np.stack([np.full((side, side), (k + 1) / 10, np.float32) for k in range(10)])  # digit k: (k+1)/10
    labels = np.arange(10) * 3 % 10  # labels need not follow the order
    monkeypatch.setattr(digits_data, "NOISE", 0.0)
    monkeypatch.setattr(digits_data, "FRAGMENTS", 0)
    images, chosen = digits_data.clutter(digits, labels, 50, seed=5)
    for image, label in zip(images, chosen):
        value = (np.flatnonzero(labels == label)[0] + 1) / 10  # the digit carrying that label
        placed = np.argwhere(image > 0)
        assert placed.shape[0] == side * side and np.all(image[image > 0] == np.float32(value))
        assert np.all(placed.max(0) - placed.min(0) == side - 1)  # one square, wherever it lies
    monkeypatch.setattr(digits_data, "FRAGMENTS", 6)
    cluttered, again = digits_data.clutter(digits, labels, 50, seed=5), digits_data.clutter(digits, labels, 50, seed=5)
    assert np.array_equal(cluttered[0], again[0]) and np.array_equal(cluttered[1], again[1])  # the same seed, the same set
    assert (np.count_nonzero(cluttered[0], axis=(1, 2)) > side * side).mean() > 0.9  # fragments beside the digit


def test_stdlib_split_is_by_file_fixed_and_capped():
    root = stdlib_text.stdlib_root()
    files = stdlib_text.source_files(root)
    assert files == sorted(files) and len(files) > 100
    assert not any("site-packages" in f.parts for f in files)
    validation = [f for f in files if stdlib_text.is_validation(f)]
    assert 0.05 < len(validation) / len(files) < 0.15
    text = stdlib_text.load()
    assert not set(text.train_files) & set(text.validation_files)
    assert len(text.train) == stdlib_text.TRAIN_BYTES
    assert len(text.validation) == stdlib_text.VALIDATION_BYTES
    first = (root / text.validation_files[0]).read_bytes()
    assert bytes(text.validation[:len(first)].numpy()) == first[:stdlib_text.VALIDATION_BYTES]


# -- the same batches on every call and every run ----------------------------------------------

@pytest.mark.parametrize("name", workloads.NAMES)
def test_batches_are_the_same_on_every_call(name):
    assert fingerprint(name) == fingerprint(name)
    assert fingerprint(name, rank=0) != fingerprint(name, rank=1)


@pytest.mark.parametrize("name", workloads.NAMES)
def test_rank_batches_make_up_the_single_process_batch(name):
    workload = workloads.get(name)
    ranks = [next(workload.batches(rank, 2, 3)) for rank in range(2)]
    single = next(workload.batches(0, 1, 6))
    for part, whole in zip(zip(*ranks), single):
        assert torch.equal(torch.cat(part), whole)


def test_batches_and_models_are_the_same_in_a_fresh_interpreter():
    code = ("import test_workloads as t; from horovod_sparse import workloads as w; "
            "print(*[t.fingerprint(n) for n in w.NAMES], "
            "t.parameters_digest(w.get('stdlib_lm').build_model(3, **t.SMALL_LM)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).parent)  # -c puts the working directory on sys.path
    assert result.returncode == 0, result.stderr[-2000:]
    here = [fingerprint(name) for name in workloads.NAMES]
    here.append(parameters_digest(workloads.get("stdlib_lm").build_model(3, **SMALL_LM)))
    assert result.stdout.split() == here


# -- models ------------------------------------------------------------------------------------

def parameters_digest(model):
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()


@pytest.mark.parametrize("name,parameters,tensors", [("digits_resnet", 11_181_642, 62),
                                                     ("cluttered_resnet", 11_181_642, 62),
                                                     ("stdlib_lm", 19_210_496, 78)])
def test_models_have_their_documented_size(name, parameters, tensors):
    model = workloads.get(name).build_model()
    assert sum(p.numel() for p in model.parameters()) == parameters
    assert len(list(model.parameters())) == tensors


@pytest.mark.parametrize("name,size", [("digits_resnet", {}), ("stdlib_lm", SMALL_LM)])
def test_model_factory_is_seeded_and_leaves_the_callers_rng_alone(name, size):
    build = workloads.get(name).build_model
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    first, again, other = build(0, **size), build(0, **size), build(1, **size)
    assert torch.equal(torch.rand(3), expected)
    assert parameters_digest(first) == parameters_digest(again) != parameters_digest(other)


def test_language_model_is_causal():
    model = ByteTransformer(layers=2, d_model=32, heads=2, context=16).eval()
    tokens = torch.randint(0, 256, (2, 16))
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.equal(a[:, 10:], b[:, 10:])


def test_evaluate_gives_the_metric_and_leaves_the_mode_alone():
    lm = workloads.get("stdlib_lm")
    model = lm.build_model(0, **SMALL_LM)
    result = lm.evaluate(model, count=8)
    assert model.training
    assert result["bits_per_byte"] == pytest.approx(result["loss"] / np.log(2))
    assert 6 < result["bits_per_byte"] < 10  # untrained: about log2(256) = 8
    assert lm.evaluate(model, count=8) == result


# -- offline -----------------------------------------------------------------------------------

def test_loading_never_touches_the_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[1:] or kwargs}")

    for name in ("connect", "connect_ex", "sendto"):
        monkeypatch.setattr(socket.socket, name, refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    digits_data.load.cache_clear()
    digits_data.load_cluttered.cache_clear()
    stdlib_text.load.cache_clear()
    for name in workloads.NAMES:
        workload = workloads.get(name)
        model = workload.build_model()
        workload.loss(model, next(workload.batches(0, 1, 2))).backward()
    assert digits_data.load.cache_info().currsize == stdlib_text.load.cache_info().currsize == 1
    assert digits_data.load_cluttered.cache_info().currsize == 1


def test_unknown_workload_names_the_known_ones():
    with pytest.raises(ValueError, match="digits_resnet, stdlib_lm, cluttered_resnet"):
        workloads.get("imagenet")


def test_size_parser_and_the_recipe_under_a_compressor_with_its_own_momentum():
    assert workloads.parse_size("layers=4, d_model=256") == {"layers": 4, "d_model": 256}
    with pytest.raises(Exception, match="KEY=INT"):
        workloads.parse_size("layers=four")
    from horovod_sparse.workloads.recipes import RECIPES
    momentum = RECIPES["momentum"]
    # DGC's momentum correction and Signum apply the momentum: their optimizer runs without it
    assert momentum.for_compressor("dgc:density=0.01").momentum == 0.0
    assert momentum.for_compressor("signum").momentum == 0.0
    assert momentum.for_compressor("topk:density=0.01") is momentum
    assert RECIPES["adamw"].for_compressor("dgc") is RECIPES["adamw"]


def test_the_exact_step_recipe_is_the_workloads_adamw_on_horovod_sparse_adamw():
    from horovod_sparse.torch import AdamW
    from horovod_sparse.workloads.recipes import Recipe, recipe_for

    class Workload:  # a workload with its own AdamW rate
        RECIPES = {"adamw": Recipe("adamw", lr=3e-4, weight_decay=0.1, warmup=0.1, decay="cosine")}

    exact, plain = recipe_for(Workload, "adamw-exact"), recipe_for(Workload, "adamw")
    assert (exact.name, exact.lr, exact.weight_decay, exact.warmup, exact.decay) == \
        ("adamw-exact", plain.lr, plain.weight_decay, plain.warmup, plain.decay)
    opt = exact.optimizer(torch.nn.Linear(3, 2).parameters())
    assert type(opt) is AdamW and opt.defaults["lr"] == 3e-4 and opt.defaults["weight_decay"] == 0.1
    assert type(plain.optimizer(torch.nn.Linear(3, 2).parameters())) is torch.optim.AdamW
    assert recipe_for(Workload, "adamw-exact", lr=1e-3).lr == 1e-3
    assert opt.exact_schedule == ExactSteps() and opt.defaults["variance_decay"] == "per_step"
    spec = "adamw-exact:exact_warmup=200,max_interval=16,exact_compression=fp16,variance_decay=per_update"
    chosen = recipe_for(Workload, spec).optimizer(torch.nn.Linear(3, 2).parameters())
    assert type(chosen) is AdamW and chosen.defaults["lr"] == 3e-4
    assert chosen.exact_schedule == ExactSteps(200, 16, "fp16") and chosen.defaults["variance_decay"] == "per_update"


@pytest.mark.parametrize("spec, named", [("adamw-exact:lr=1", "lr not among its options"),
                                         ("adamw:exact_warmup=3", "exact_warmup not among its options"),
                                         ("adamw-exactly", "recipe must be one of")])
def test_a_recipe_spec_names_a_recipe_and_only_its_options(spec, named):
    """recipe_for raises ValueError; --recipe's argparse type says the same reason."""
    import argparse

    from horovod_sparse.workloads.recipes import recipe_for, recipe_spec
    with pytest.raises(ValueError, match=named):
        recipe_for(None, spec)
    with pytest.raises(argparse.ArgumentTypeError, match=named):
        recipe_spec(spec)

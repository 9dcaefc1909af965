"""Convergence on the demo's task (scikit-learn digits, 64-128-10 MLP, 4 ranks): each sparsifier
at density 0.01 with error feedback, and fft, qsgd, efsignsgd and powersgd with their defaults,
end within 2 points of dense test accuracy, and top-k
without error feedback ends clearly worse (as GRACE measured on ImageNet).

Training is deterministic for a given number of ranks, so these numbers are exact, not
samples: the test runs at -np 4 only (the demo's setting).
Plain SGD (momentum 0, lr 0.1), 14 epochs, batch 16 per rank: dense ends at 0.9333, the farthest
(oktopk) 1.4 points below it, top-k without error feedback 8 points below (at 20 epochs the
same held, the farthest 0.6 points below, in 123 s against 85 s; at 10 the farthest came within
a test sample of the bound).
"""
import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("demo", Path(__file__).parents[3] / "scripts" / "demo.py")
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)

EPOCHS, LR, MOMENTUM, BATCH = 14, 0.1, 0.0, 16
#: (top-k over the DSA exchange is left out: it sums the same selections as top-k's allgather, and
#: ended at the same accuracy as it, 0.9417)
SPARSIFIERS = ["topk:density=0.01", "oktopk:density=0.01", "gtopk:density=0.01", "gaussiank:density=0.01",
               "dgc:density=0.01"]
#: the quantizers, PowerSGD and FFT, each with its documented defaults
QUANTIZERS = ["fft", "qsgd", "efsignsgd", "powersgd"]

pytestmark = pytest.mark.world_sizes(4)  # the demo's setting


@pytest.fixture(scope="module")
def dense_accuracy():
    return train("dense")


def train(run):
    result = demo.train_one(run, demo.load_data(), EPOCHS, BATCH, LR, MOMENTUM)
    assert result["identical"], f"{run}: replicas diverged"
    return result["accuracy"]


@pytest.fixture(scope="module")
def accuracies():
    """Each run's accuracy, trained once in this module (top-k is asked for twice)."""
    return {}


def train_once(run, accuracies):
    if run not in accuracies:
        accuracies[run] = train(run)
    return accuracies[run]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("run", SPARSIFIERS + QUANTIZERS)
def test_within_two_points_of_dense(run, dense_accuracy, record_property, accuracies):
    accuracy = train_once(run, accuracies)
    record_property("accuracy", f"{accuracy:.4f}")  # in the JUnit file, for the docs
    record_property("dense_accuracy", f"{dense_accuracy:.4f}")
    assert accuracy >= dense_accuracy - 0.02, f"{run}: {accuracy:.4f} vs dense {dense_accuracy:.4f}"


@pytest.mark.timeout(300)
def test_topk_without_error_feedback_is_worse(dense_accuracy, record_property, accuracies):
    with_feedback = train_once("topk:density=0.01", accuracies)
    without = train("topk:density=0.01,error_feedback=false")
    record_property("accuracy_with_feedback", f"{with_feedback:.4f}")
    record_property("accuracy_without_feedback", f"{without:.4f}")
    assert without < with_feedback - 0.05, f"without {without:.4f}, with {with_feedback:.4f}"

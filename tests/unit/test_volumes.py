"""The closed forms of horovod_sparse.whatif.volumes: their constants match the engine's, they
agree with the what-if model's payload terms, and the recorded counts of
docs/results/oktopk-scale.md still equal them (``bench_exchange.py --report``). The forms
against the live counters: tests/parallel/scale."""
import doctest
import math
from pathlib import Path

import numpy as np
import pytest

from horovod_sparse.whatif import volumes, wire
from scripts_under_test import load_script

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "docs/results/data/oktopk-scale"


def test_doctests():
    assert doctest.testmod(volumes).failed == 0


def test_header_is_the_engines():
    from horovod_sparse.exchange.validation import HEADER_FIELDS
    assert volumes.HEADER_FIELDS == len(HEADER_FIELDS)


def test_algorithms_and_oktopk_schedule_are_the_engines():
    from horovod_sparse.exchange.engine import ALGORITHMS
    from horovod_sparse.exchange.oktopk import DEFAULTS
    assert sorted(volumes.ALGORITHMS) == sorted(ALGORITHMS) == sorted(volumes.LABELS)
    assert (volumes.TAU, volumes.TAU_PRIME) == (DEFAULTS["tau"], DEFAULTS["tau_prime"])
    assert volumes.oktopk_schedule(0) == (True, True) and volumes.oktopk_schedule(1) == (False, False)
    assert volumes.oktopk_schedule(volumes.TAU_PRIME) == (False, True)


@pytest.mark.parametrize("P", [2, 4, 8, 32])
def test_payload_terms_agree_with_the_what_if_model(P):
    n, k = 1_000_000, 10_000
    header = volumes.header(P).bytes_sent
    assert volumes.allgather(k, P, n=n).bytes_sent - header == wire._sparse("allgather", n, k, P)[0]
    # gTop-k's busiest rank (rank 1): wire's log2 P 8k + 4k, plus an 8-byte length per send
    busiest = max(volumes.gtopk(k, P, r, n=n).bytes_sent for r in range(P))
    assert busiest == volumes.gtopk(k, P, 1, n=n).bytes_sent
    assert busiest - header == wire._sparse("gtopk", n, k, P)[0] + 8 * math.log2(P)
    # Ok-Topk without its control data: the what-if model's 2(P-1)/P 8k
    ok = volumes.oktopk(n, k, P)
    control = header + 8 * (P - 1) + 16 * (P - 1)
    assert ok.bytes_sent - control == pytest.approx(wire._sparse("oktopk", n, k, P)[0])


def test_dense_mean_is_the_ring_and_p1_moves_nothing():
    assert volumes.dense(1000, 4).bytes_sent == 2 * 1000 * 3 / 4 * 4 + 80 * 3
    assert sum(volumes.dense(1001, 3, r).bytes_sent for r in range(3)) / 3 == \
        pytest.approx(volumes.dense(1001, 3).bytes_sent)
    for algorithm in volumes.ALGORITHMS:
        assert volumes.volume(algorithm, 1000, 10, 1) == volumes.Volume()


def test_the_recorded_counts_equal_the_closed_forms_fed_the_data():
    bench = load_script("bench_exchange")
    import json
    records = [json.loads(line) for line in (DATA / "counts.jsonl").read_text().splitlines() if line.strip()]
    some = [r for r in records if r["P"] <= 8 and r["selections_step"] == 30]
    rows = bench.report_rows(some, str(DATA / "selections.npz"))
    assert rows and all(r["data_exact_every_rank"] for r in rows)
    for r in rows:
        if r["algorithm"] in ("dense", "allgather", "gtopk"):
            assert r["sent_mean"] == r["model_sent"]
        if r["algorithm"] == "oktopk":
            assert abs(r["sent_mean"] / r["model_sent"] - 1) < 0.05


def test_record_selections_writes_what_bench_exchange_reads(tmp_path):
    record = load_script("record_selections")
    bench = load_script("bench_exchange")
    out = tmp_path / "s.npz"
    assert record.main(["--size", "layers=1,d_model=32,heads=2", "--ranks", "3", "--steps", "3",
                        "--record", "0,2", "--density", "0.05", "--out", str(out)]) == 0
    indices, values, step, n, k, meta = bench.load_selections(str(out), 2)
    assert step == 2 and indices.shape == values.shape == (3, k) and k == round(0.05 * n)
    assert indices.dtype == np.int32 and values.dtype == np.float32
    assert all(np.all(np.diff(row) > 0) for row in indices) and indices.max() < n
    assert meta["recorded_steps"] == [0, 2] and meta["P"] == 3


def test_record_selections_keeps_only_the_unions_in_json(tmp_path):
    """``--out FILE.json``: per recorded step, the distinct indices of the first P ranks'
    selections, P = 2, 4, ...: at least k and at most P k, growing with P; predict_scale reads it."""
    import json
    record = load_script("record_selections")
    out = tmp_path / "u.json"
    assert record.main(["--size", "layers=1,d_model=32,heads=2", "--ranks", "4", "--steps", "3",
                        "--record", "2", "--density", "0.05", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    unions = {int(P): u for P, u in data["unions"]["2"].items()}
    k = data["k"]
    assert sorted(unions) == [2, 4] and k <= unions[2] <= unions[4] <= 4 * k and unions[2] <= 2 * k
    predict = load_script("predict_scale")
    own = predict.model_unions([f"ResNet-18={out}"])
    ((name, (trend, got, *_)),) = own.items()
    assert name.startswith("ResNet-18") and got == unions and trend.union(10**9, k, 2) == pytest.approx(unions[2])
    with pytest.raises(SystemExit):
        predict.model_unions([f"VGG={out}"])

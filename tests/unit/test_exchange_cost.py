"""horovod_sparse.whatif.exchange_cost: the fit recovers known costs, the predictor grows with P
where the closed forms say it must, the crossover search, and the shipped constants equal the
fit of the shipped records. No MPI."""
import json
import os

import numpy as np
import pytest

from horovod_sparse.whatif import exchange_cost as ec
from horovod_sparse.whatif import volumes as vol
from horovod_sparse.whatif.model import Network

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMED = [os.path.join(ROOT, "docs", "results", "data", "oktopk-scale", name)
         for name in ("timed-1gbit.jsonl", "timed-10gbit.jsonl", "timed-uniform-1gbit.jsonl",
                      "timed-uniform-10gbit.jsonl", "pingpong.jsonl")]


def _record(algorithm, P, per_rank, seconds, cpus=2, k=None):
    """A bench record with the given per-rank counters (messages, sent, received, messages
    received) on 2 calls."""
    call = {"messages_sent": [x[0] for x in per_rank], "bytes_sent": [x[1] for x in per_rank],
            "bytes_received": [x[2] for x in per_rank], "messages_received": [x[-1] for x in per_rank]}
    rec = {"algorithm": algorithm, "P": P, "rate": "test", "median_s": seconds, "min_s": seconds,
           "max_s": seconds, "per_call": [call, call], "cpus": cpus}
    if k is not None:
        rec["k"] = k
    return rec


GAMMA = {"dense": 1.5e-9, "allgather": 5e-9, "gtopk": 2e-9, "dsa": 1e-10, "oktopk": 3e-10}
KAPPA = {"allgather": 2e-9, "gtopk": 1e-7, "dsa": 5e-8, "oktopk": 2e-8}
CALL = {"dense": 1e-4, "allgather": 2e-4, "gtopk": 3e-4, "dsa": 5e-4, "oktopk": 4e-4}
WAKEUP = 3e-6


def _synthetic(alpha, beta, gamma=GAMMA, burst=0.0, Ps=(2, 4, 8), n=1_000_000, ks=(10_000, 40_000), call=CALL,
               kappa=KAPPA, wakeup=WAKEUP):
    """Records timed by the model itself, at two selection sizes (so that the work per entry
    selected and per byte received can be told apart)."""
    recs = []
    for k in ks:
        for alg in vol.ALGORITHMS:
            for P in Ps:
                per_rank = [(v.messages_sent, v.bytes_sent, v.bytes_received, v.messages_received)
                            for v in (vol.volume(alg, n, k, P, r) for r in range(P))]
                f = ec.busiest(alg, per_rank, selected=0 if alg == "dense" else k)
                c = max(1, P / 2)
                t = (call[alg] + (alpha + wakeup * (c - 1)) * f.messages + beta * f.wire_bytes(burst)
                     + c * (gamma[alg] * f.bytes_received + kappa.get(alg, 0.0) * f.selected))
                recs.append(_record(alg, P, per_rank, t, k=k))
    return recs


def _check_local_costs(cost, call=CALL):
    for a, t in call.items():
        assert cost.call_s[a] == pytest.approx(t, rel=1e-4)
    assert cost.wakeup_s == pytest.approx(WAKEUP, rel=1e-4)
    for a, g in GAMMA.items():
        assert cost.local_s_per_byte[a] == pytest.approx(g, rel=1e-4)
    for a, g in KAPPA.items():
        assert cost.local_s_per_selected[a] == pytest.approx(g, rel=1e-4)


@pytest.mark.parametrize("alpha,beta", [(50e-6, 8e-9), (1e-4, 0.8e-9), (2e-5, 3e-9)])
def test_fit_recovers_every_cost_from_synthetic_records(alpha, beta):
    recs = _synthetic(alpha, beta, Ps=(2, 3, 4, 6, 8))
    cost = ec.fit(recs)
    assert cost.alpha_s == pytest.approx(alpha, rel=1e-5)
    assert cost.beta_s == pytest.approx(beta, rel=1e-5)
    _check_local_costs(cost)
    assert all(abs(e) < 1e-5 for *_, e in ec.validation(recs, cost))


def test_joint_fit_over_links_recovers_per_link_bandwidth_and_shared_costs_with_a_burst():
    burst = 256 * 1024
    recs = {"slow": _synthetic(40e-6, 8e-9, burst=burst), "fast": _synthetic(40e-6, 0.8e-9, burst=burst)}
    fits = ec.fit_links(recs, burst_bytes=burst)
    assert fits["slow"].beta_s == pytest.approx(8e-9, rel=1e-5)
    assert fits["fast"].network.gbps == pytest.approx(10.0, rel=1e-5)
    for c in fits.values():
        assert c.alpha_s == pytest.approx(40e-6, rel=1e-5)
        _check_local_costs(c)
        assert c.burst_bytes == burst
    assert fits["fast"].on_link(25).burst_bytes == 0.0
    assert fits["fast"].on_link(25).local_s_per_selected == fits["fast"].local_s_per_selected


def test_fit_with_the_nominal_rates_and_a_measured_alpha_fits_the_rest():
    burst = 256 * 1024
    recs = {"slow": _synthetic(40e-6, 8e-9, burst=burst), "fast": _synthetic(40e-6, 0.8e-9, burst=burst)}
    fits = ec.fit_links(recs, burst_bytes=burst, bandwidth_bps={"slow": 1e9, "fast": 1e10}, latency_s=40e-6)
    assert (fits["slow"].network.gbps, fits["fast"].network.gbps) == (1.0, 10.0)
    for c in fits.values():
        assert c.alpha_s == 40e-6
        _check_local_costs(c)
    # a wrong measured alpha is not absorbed silently: the records no longer fit exactly
    off = ec.fit_links(recs, burst_bytes=burst, bandwidth_bps={"slow": 1e9, "fast": 1e10}, latency_s=400e-6)
    assert max(abs(e) for *_, e in ec.validation(recs["slow"], off["slow"])) > 0.01


def test_features_take_the_busiest_rank_per_call_then_the_mean_over_calls():
    rec = _record("dsa", 8, [(3, 100, 7, 1), (5, 40, 9, 1)], 1.0)
    rec["per_call"][1] = {"messages_sent": [1, 1], "bytes_sent": [300, 0], "bytes_received": [0, 1],
                          "messages_received": [1, 1]}
    assert ec.features(rec) == ec.Features(3.0, 200.0, 5.0, "dsa", 4.0)
    assert ec.features(rec, call=0) == ec.Features(5.0, 100.0, 9.0, "dsa", 4.0)
    assert ec.features(rec, cores=16).oversubscription == 1.0
    rec["k"] = 1234
    assert ec.features(rec).selected == 1234.0
    assert ec.features({**rec, "algorithm": "dense"}).selected == 0.0   # dense densifies n, whatever k


def test_gtopk_counts_the_root_chain_both_ways_each_transfer_from_its_own_sender():
    per_rank = [(3, 100, 700, 8), (5, 400, 90, 1)]
    f = ec.busiest("gtopk", per_rank)
    assert f == ec.Features(11.0, 100.0, 700.0, "gtopk", 1.0, chain_messages=8.0, chain_bytes=700.0)
    assert f.wire_bytes() == 800.0
    # the root's sends beyond its burst, each of the 8 received transfers beyond its sender's
    assert f.wire_bytes(50.0) == 50.0 + 8 * (700.0 / 8 - 50.0)
    assert f.wire_bytes(100.0) == 0.0
    assert ec.busiest("allgather", per_rank) == ec.Features(5.0, 400.0, 700.0, "allgather")


def test_fit_needs_enough_records():
    with pytest.raises(ValueError):
        ec.fit(_synthetic(1e-5, 1e-9)[:2])


COST = ec.ExchangeCost(Network.from_gbps(10, 50e-6), {a: 1e-10 for a in vol.ALGORITHMS})
PS = [2 ** i for i in range(1, 11)]


@pytest.mark.parametrize("algorithm", ["dense", "allgather", "gtopk", "oktopk"])
def test_prediction_grows_with_P(algorithm):
    """Every term of dense, TopkA, gTop-k and Ok-Topk grows (or stays) with P under the uniform model."""
    t = [ec.predict_seconds(algorithm, 10_000_000, 100_000, P, COST) for P in PS]
    assert all(b >= a for a, b in zip(t, t[1:])), t


def test_prediction_equals_cost_of_the_closed_form_at_the_busiest_rank():
    n, k, P = 1_000_000, 10_000, 8
    per = [vol.volume("gtopk", n, k, P, r) for r in range(P)]
    f = ec.critical_volume("gtopk", n, k, P)
    both = max(v.bytes_sent + v.bytes_received for v in per)
    assert f.wire_bytes() == both == per[0].bytes_sent + per[0].bytes_received
    assert f.selected == k and ec.critical_volume("dense", n, k, P).selected == 0
    assert ec.predict_seconds("gtopk", n, k, P, COST) == pytest.approx(COST.seconds(f))
    assert ec.critical_volume("dense", n, k, 1) == ec.Features(0.0, 0.0, 0.0)


def test_oktopk_amortized_lies_between_its_later_and_its_first_call():
    n, k, P = 10_000_000, 100_000, 64
    later = ec.predict_seconds("oktopk", n, k, P, COST, amortized=False)
    first = COST.seconds(ec.critical_volume("oktopk", n, k, P, call=0))
    amortized = ec.predict_seconds("oktopk", n, k, P, COST)
    assert later < amortized < first


def test_overlap_trend_shrinks_the_union_and_dsa():
    trend = ec.Overlap(1.4, 0.5)
    n, k = 10_000_000, 100_000
    assert trend.union(n, k, 64) == pytest.approx(1.4 * k * 8)
    assert trend.union(n, k, 2) <= n * (1 - (1 - k / n) ** 2)          # capped by the uniform union
    assert ec.predict_seconds("dsa", n, k, 256, COST, trend) < ec.predict_seconds("dsa", n, k, 256, COST)
    fitted = ec.Overlap.fitted({2: 2 * k * 2 ** 0.5, 8: 2 * k * 8 ** 0.5, 32: 2 * k * 32 ** 0.5}, k)
    assert (fitted.coefficient, fitted.exponent) == (pytest.approx(2.0), pytest.approx(0.5))


def test_crossover_on_a_constructed_case():
    Ps = [16, 32, 64, 128]
    times = {"oktopk": [5, 5, 5, 5], "allgather": [1, 4, 6, 9], "dense": [9, 9, 9, 9], "gtopk": [1, 1, 1, 1],
             "dsa": [6, 4, 6, 7]}
    assert ec.crossover(times, Ps, "oktopk", "allgather") == 64
    assert ec.crossover(times, Ps, "oktopk", "dense") == 16
    assert ec.crossover(times, Ps, "oktopk", "gtopk") is None
    assert ec.crossover(times, Ps, "oktopk", "dsa") == 64      # the last crossing counts


def test_crossover_of_topka_by_oktopk_is_found_on_a_large_gradient():
    """TopkA's bytes grow as (P-1)k, Ok-Topk's stay below 6k: on a slow link it overtakes."""
    cost = ec.ExchangeCost(Network.from_gbps(1, 50e-6))
    times = ec.sweep(10_000_000, 100_000, PS, cost, ("allgather", "oktopk"))
    c = ec.crossover(times, PS, "oktopk", "allgather")
    assert c is not None and c <= 8
    best, _ = ec.fastest(10_000_000, 100_000, 512, cost, ("allgather", "oktopk"))
    assert best == "oktopk"


def test_on_link_keeps_alpha_and_gamma():
    c = COST.on_link(100)
    assert (c.alpha_s, c.local_s_per_byte["dsa"], c.network.gbps) == (50e-6, 1e-10, 100.0)
    assert COST.on_link(100, 25e-6).alpha_s == 25e-6


@pytest.mark.skipif(not all(os.path.exists(p) for p in TIMED), reason="no timed records")
def test_shipped_constants_are_the_joint_fit_of_the_shipped_records():
    """As scripts/predict_scale.py fits them: recorded step 30 and the uniform inputs, the links
    at their nominal rates, alpha the ping-pong's."""
    recs, pingpong = {}, []
    for path in TIMED:
        with open(path) as f:
            for line in f:
                r = json.loads(line) if line.strip() else None
                if r and r.get("kind") == "pingpong":
                    pingpong.append(r["median_s"])
                elif r and r.get("selections_step") in (30, None):
                    recs.setdefault(r["rate"], []).append(r)
    recs = {rate: ec.pool_rounds(rs) for rate, rs in recs.items()}
    rates = {"1gbit": 1e9, "10gbit": 1e10}
    cost = ec.fit_links(recs, burst_bytes=ec.NETEM_BURST_BYTES, bandwidth_bps=rates,
                        latency_s=float(np.median(pingpong)))["10gbit"]
    assert ec.FITTED["alpha_s"] == pytest.approx(cost.alpha_s, rel=1e-6)
    for a, t in cost.call_s.items():
        assert ec.FITTED["call_s"][a] == pytest.approx(t, rel=1e-6, abs=1e-12)
    assert ec.FITTED["wakeup_s"] == pytest.approx(cost.wakeup_s, rel=1e-6)
    for a, g in cost.local_s_per_byte.items():
        assert ec.FITTED["local_s_per_byte"][a] == pytest.approx(g, rel=1e-6, abs=1e-20)
    for a, g in cost.local_s_per_selected.items():
        assert ec.FITTED["local_s_per_selected"][a] == pytest.approx(g, rel=1e-6, abs=1e-20)
    assert ec.default_cost(25).network.gbps == 25.0


# ------------------------------------------------------------ horovod-sparse whatif --sparse-allreduce
def test_whatif_sparse_allreduce_names_the_predicted_fastest(capsys):
    from horovod_sparse import cli
    assert cli.main(["whatif", "netai:vgg16", "--sparse-allreduce", "--workers", "16", "1024",
                     "--bandwidth", "10", "100", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["workers"], r["gbps"]) for r in rows] == [(16, 10.0), (16, 100.0), (1024, 10.0), (1024, 100.0)]
    for r in rows:
        assert set(r["seconds"]) == set(vol.ALGORITHMS)
        assert r["fastest"] == min(r["seconds"], key=r["seconds"].get)
        assert r["k"] == round(0.01 * r["n"])
        want = ec.predict_seconds("oktopk", r["n"], r["k"], r["workers"], ec.default_cost(r["gbps"]))
        assert r["seconds"]["oktopk"] == pytest.approx(want)
    assert cli.main(["whatif", "netai:vgg16", "--sparse-allreduce", "--workers", "64", "--bandwidth", "25"]) == 0
    out = capsys.readouterr().out
    assert "predicted ms per exchange" in out and "Ok-Topk" in out and "fastest" in out


def test_whatif_sparse_allreduce_rejects_a_density_above_one(capsys):
    from horovod_sparse import cli
    with pytest.raises(SystemExit) as e:
        cli.main(["whatif", "netai:vgg16", "--sparse-allreduce", "--density", "2"])
    assert e.value.code == 2
    assert "--density" in capsys.readouterr().err


@pytest.mark.skipif(not all(os.path.exists(p) for p in TIMED), reason="no timed records")
def test_predict_scale_fits_with_the_measured_alpha_and_checks_the_uniform_inputs(tmp_path, capsys):
    """scripts/predict_scale.py on the shipped records: alpha is the ping-pong's, the fit is the
    shipped one, and the validation covers the recorded and the uniform inputs."""
    from scripts_under_test import load_script
    predict = load_script("predict_scale")
    records, pingpong = predict.load_records(TIMED)
    assert pingpong and all(r["kind"] == "pingpong" for r in pingpong)
    assert predict.measured_alpha(pingpong) == pytest.approx(ec.FITTED["alpha_s"])
    assert {r.get("selections_step") for r in records} == {30, 60, None}
    selections = os.path.join(ROOT, "docs", "results", "data", "oktopk-scale", "selections.npz")
    page = tmp_path / "page.md"
    page.write_text("<!-- oktopk-predict:begin -->\n<!-- oktopk-predict:end -->\n")
    assert predict.main(["--records", *TIMED, "--selections", selections, "--page", str(page)]) == 0
    text = page.read_text()
    assert "measured by ping-pong" in text and "uniform, n = 17.3M" in text
    calls = " | ".join(f"{ec.FITTED['call_s'][a] * 1e6:.0f}" for a in vol.ALGORITHMS)
    assert f"| joint | 10gbit | 30 | {calls} |" in text
    capsys.readouterr()

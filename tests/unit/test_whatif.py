"""horovod_sparse.whatif: the NetAI'20 reproduction against a literal transcription of the
reference (tests/unit/netai_reference.py), closed forms, the wire formulas, traces and
recommendations. No MPI, no torch."""
import json
import os

import pytest

import netai_reference as ref
from horovod_sparse.schedule.cost import CostModel, RingAllreduce
from horovod_sparse.whatif import (CodecCost, Gradient, Network, Options, Trace, load, predict, read_bk_log,
                                   recommend, sweep)
from horovod_sparse.whatif import model as whatif_model
from horovod_sparse.whatif import wire
from horovod_sparse.whatif.trace import NETAI_DIR

PAPER = Options(rule="netai", latency=False, codec=False)
MODELS = sorted(ref.BATCH_TIME)


@pytest.fixture(scope="module")
def vec_add():
    return ref.VecAddCost(os.path.join(NETAI_DIR, "cuda_vec_add.log"))


@pytest.fixture(scope="module")
def netai_traces():
    return {m: load(f"netai:{m}") for m in MODELS}


# ------------------------------------------------------------ the reproduction
@pytest.mark.parametrize("model", MODELS)
def test_reproduces_the_reference_on_its_own_traces(model, vec_add, netai_traces):
    """All of the paper's cases: ratios 1..100, 16/32/64 workers, 1..100 Gbit/s."""
    log = os.path.join(NETAI_DIR, f"{model}.bk.log")
    worst = 0.0
    for c in ref.COMPRESSIONS:
        for n in ref.WORKERS:
            for bw in ref.LINKSPEEDS:
                want = ref.scaling_factor(log, model, n, bw, vec_add, c)
                got = predict(netai_traces[model], Network.from_gbps(bw / 1e9), n, ratio=c, options=PAPER).scaling
                worst = max(worst, abs(want - got))
    assert worst < 0.01
    assert worst < 1e-6   # in fact the same arithmetic


def test_reference_skip_of_tiny_waits_changes_nothing_that_matters(vec_add):
    log = os.path.join(NETAI_DIR, "resnet50.bk.log")
    exact = ref.scaling_factor(log, "resnet50", 16, 10e9, vec_add, 5)
    skipped = ref.scaling_factor(log, "resnet50", 16, 10e9, vec_add, 5, skip_below=3e-6)
    assert abs(exact - skipped) < 1e-3


def test_the_papers_finding_full_bandwidth_scales_and_10gbit_needs_little_compression(netai_traces):
    rows = sweep(netai_traces["resnet50"], [16, 32, 64], gbps=[10, 100], ratios=[1, 2, 5], options=PAPER)
    at = {(p.ratio, p.workers, p.gbps): p.scaling for p in rows}
    assert all(at[(1, n, 100.0)] > 0.95 for n in (16, 32, 64))
    assert all(at[(1, n, 10.0)] < 0.7 and at[(5, n, 10.0)] > 0.95 for n in (16, 32, 64))


# ------------------------------------------------------------------ closed forms
def _trace(waits=(0.01, 0.02), sizes=(4_000_000, 8_000_000), batch=0.1, device="gpu", compressors=None):
    grads = [Gradient(f"g{i}", w, s, [s // 4]) for i, (w, s) in enumerate(zip(waits, sizes))]
    return Trace("toy", grads, batch, device=device, compressors=compressors or {})


def test_one_bucket_after_backward_is_backward_plus_one_ring():
    t = _trace()
    net = Network.from_gbps(10, latency_s=1e-4)
    p = predict(t, net, 4, compressor="dense", options=Options(rule="single", codec=False))
    ring = RingAllreduce(10e9, 1e-4, 4)(12_000_000)
    assert p.overhead_s == pytest.approx(ring)
    assert p.step_s == pytest.approx(0.1 + ring) and p.buckets == 1


def test_one_worker_has_no_overhead():
    for rule in ("netai", "horovod", "wfbp", "single"):
        p = predict(_trace(), Network.from_gbps(1, 1e-3), 1, compressor="dense", options=Options(rule=rule))
        assert p.overhead_s == 0.0 and p.scaling == 1.0


@pytest.mark.parametrize("rule", ["netai", "horovod", "wfbp", "single"])
def test_monotone_in_bandwidth_and_ratio_and_scaling_in_0_1(rule, netai_traces):
    t = netai_traces["vgg16"]
    opts = Options(rule=rule)
    # Horovod's loop fuses whatever is ready when the previous allreduce ends: a faster link
    # can form more, smaller buckets and pay a little more latency (0.02% here)
    tol = 1e-3 if rule == "horovod" else 1e-12
    prev = None
    for gbps in (0.1, 1, 10, 100, 1000):
        s = predict(t, Network.from_gbps(gbps, 2e-5), 16, ratio=1, options=opts).scaling
        assert 0 < s <= 1
        assert prev is None or s >= prev - tol
        prev = s
    prev = None
    for c in (1, 2, 5, 10, 100):
        s = predict(t, Network.from_gbps(10, 2e-5), 16, ratio=c, options=opts).scaling
        assert 0 < s <= 1
        assert prev is None or s >= prev - tol
        prev = s


def test_latency_and_codec_cost_only_add_time():
    t = _trace(compressors={"fp16": CodecCost(0.003, 0.002, "horovod")})
    net = Network.from_gbps(10, 1e-3)
    base = predict(t, net, 8, compressor="fp16", options=Options(latency=False, codec=False))
    with_lat = predict(t, net, 8, compressor="fp16", options=Options(codec=False))
    with_all = predict(t, net, 8, compressor="fp16")
    assert base.step_s < with_lat.step_s < with_all.step_s
    assert with_all.codec_s == pytest.approx(0.005)


def test_a_fused_compressor_pays_its_pipeline_then_its_exchange_after_backward():
    t = _trace(sizes=(4_000_000, 8_000_000), compressors={"topk:density=0.01": CodecCost(0.001, 0.05, "out_of_band")})
    net = Network.from_gbps(1, 0.0)
    p1 = predict(t, net, 1, compressor="topk:density=0.01")
    assert p1.overhead_s == pytest.approx(0.051)        # P = 1: the codec alone
    p = predict(t, net, 4, compressor="topk:density=0.01", options=Options(latency=False))
    k = 3_000_000 // 100
    assert p.overhead_s == pytest.approx(0.051 + 3 * 8 * k * 8 / 1e9)


def test_measured_wire_bytes_replace_the_formula():
    t = _trace(compressors={"qsgd": CodecCost(0.0, 0.0, "out_of_band")})
    p = predict(t, Network.from_gbps(1, 0.0), 2, compressor="qsgd", wire_bytes=1e6,
                options=Options(overlap=False))
    probes = RingAllreduce(1e9, 0.0, 2)(2 * 4)    # Horovod's one-float probes, one bucket
    assert p.overhead_s == pytest.approx(1e6 * 8 / 1e9 + probes)


def test_without_overlap_every_allreduce_waits_for_backward():
    t = _trace(waits=(0.01, 0.05), sizes=(40_000_000, 4))
    net = Network.from_gbps(10, 0.0)
    over = predict(t, net, 2, compressor="dense", options=Options(rule="wfbp", overlap=True))
    serial = predict(t, net, 2, compressor="dense", options=Options(rule="wfbp", overlap=False))
    assert over.overhead_s < serial.overhead_s
    assert serial.overhead_s == pytest.approx(RingAllreduce(10e9, 0, 2)(40_000_004))


def test_a_cpu_trace_does_not_overlap_by_default():
    assert not _trace(device="cpu").on_gpu and _trace(device="cuda:0").on_gpu


def test_horovod_rule_reads_the_environment(monkeypatch):
    monkeypatch.setenv("HOROVOD_CYCLE_TIME", "5")
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "1024")
    o = Options()
    assert o.cycle_s == 0.005 and o.fusion_bytes == 1024
    monkeypatch.delenv("HOROVOD_CYCLE_TIME")
    monkeypatch.delenv("HOROVOD_FUSION_THRESHOLD")
    assert Options().cycle_s == 0.001 and Options().fusion_bytes == 128 * 1024 * 1024


def test_network_from_a_fitted_allreduce_is_the_rings_inverse():
    line = RingAllreduce(3e9, 2e-5, 8).linear()
    net = Network.from_allreduce(line, 8)
    assert net.bandwidth_bps == pytest.approx(3e9) and net.latency_s == pytest.approx(2e-5)
    with pytest.raises(ValueError):
        Network.from_allreduce(CostModel(0.1, 0.0), 8)


def test_bad_inputs():
    t = _trace()
    with pytest.raises(ValueError, match="either"):
        predict(t, Network.from_gbps(1), 2)
    with pytest.raises(ValueError, match="workers"):
        predict(t, Network.from_gbps(1), 0, ratio=2)
    with pytest.raises(ValueError, match="rule"):
        Options(rule="fastest")


def test_contention_is_the_measured_over_the_profiled_forward_and_backward():
    t = Trace("toy", [Gradient("w", 0.05, 4000), Gradient("b", 0.01, 400)], 0.1, device="cpu",
              forward_s=0.03, update_s=0.01, compressors={"dense": CodecCost(0.01, 0.0, "horovod")})
    assert whatif_model.contention(t, 0.2) == pytest.approx(0.2 / (0.03 + 0.06 + 0.01))
    assert whatif_model.contention(t, 0.2, compressor=None) == pytest.approx(0.2 / 0.09)
    with pytest.raises(ValueError, match="fwd_bwd_s must be > 0"):
        whatif_model.contention(t, 0.0)
    with pytest.raises(ValueError, match="compute_scale must be > 0"):
        Options(compute_scale=0)
    with pytest.raises(ValueError, match="codec_scale must be >= 0"):
        Options(codec_scale=-1)


def test_compute_scale_multiplies_compute_and_codec_not_the_wire():
    t = _trace(device="cpu", compressors={"topk:density=0.01": CodecCost(0.002, 0.03, "out_of_band"),
                                          "dense": CodecCost(0.001, 0.001, "horovod")})
    net = Network.from_gbps(1, 1e-4)
    for spec in ("topk:density=0.01", "dense"):
        alone, slow = (predict(t, net, 1, compressor=spec, options=Options(compute_scale=c)) for c in (1.0, 3.0))
        assert slow.step_s == pytest.approx(3 * alone.step_s)          # P = 1: nothing moves
        assert slow.scaling == pytest.approx(alone.scaling)
        one, three = (predict(t, net, 4, compressor=spec, options=Options(compute_scale=c)) for c in (1.0, 3.0))
        assert three.comm_s == pytest.approx(one.comm_s) and three.wire_bytes == one.wire_bytes
        assert three.step_s - three.comm_s == pytest.approx(3 * (one.step_s - one.comm_s))


def test_adding_the_other_ranks_contributions_grows_with_p():
    # vector additions cost 1 ns per byte: an out-of-band compressor pays (received values x 4) ns
    t = _trace(device="cpu", compressors={"topk:density=0.01": CodecCost(0.0, 0.03, "out_of_band")})
    t.reduce = [[1, 1e-9], [1e9, 1.0]]
    net = Network.from_gbps(1, 0.0)
    codec = {p: predict(t, net, p, compressor="topk:density=0.01").codec_s for p in (1, 2, 4, 8)}
    assert codec[1] == pytest.approx(0.03)                  # the profile's own P
    k = 3_000_000 // 100
    for p in (2, 4, 8):                                     # allgather: (P-1) k values
        assert codec[p] == pytest.approx(0.03 + (p - 1) * k * 4e-9, rel=1e-6)


def test_codec_profiled_at_p_is_used_as_measured_there_and_scaled_elsewhere():
    # profiled by 4 ranks at once: at P = 4 the codec is already what 4 ranks pay (no compute
    # scale, no addition term); at another P it is treated as a P = 1 profile, with a note
    t = _trace(device="cpu", compressors={"topk:density=0.01": CodecCost(0.001, 0.03, "out_of_band")})
    t.reduce = [[1, 1e-9], [1e9, 1.0]]
    t.workers = 4
    net, slow = Network.from_gbps(1, 0.0), Options(compute_scale=2.0)
    at_4 = predict(t, net, 4, compressor="topk:density=0.01", options=slow)
    assert at_4.codec_s == pytest.approx(0.031) and not at_4.notes
    at_8 = predict(t, net, 8, compressor="topk:density=0.01", options=slow)
    k = 3_000_000 // 100
    assert at_8.codec_s == pytest.approx(2 * 0.031 + 2 * 7 * k * 4e-9, rel=1e-6)
    assert at_8.notes == ["codec costs profiled at P = 4, used at P = 8"]
    t.workers = 1
    assert predict(t, net, 4, compressor="topk:density=0.01", options=slow).codec_s > at_4.codec_s


# ------------------------------------------------------------------------- wire
def test_wire_formulas():
    n, p = 1_000_000, 4
    k = 10_000
    assert wire.fused_exchange("topk:density=0.01", n, p) == (3 * 8 * k, 3)
    assert wire.fused_exchange("oktopk:density=0.01", n, p)[0] == pytest.approx(2 * 3 / 4 * 8 * k)
    assert wire.fused_exchange("gtopk:density=0.01", n, p)[0] == pytest.approx(2 * 8 * k + 4 * k)
    assert wire.fused_exchange("signsgd", n, p)[0] == pytest.approx(2 * 3 / 4 * n / 8)
    assert wire.fused_exchange("signsgd:method=allgather", n, p)[0] == pytest.approx(3 * n / 8)
    # powersgd at its default rank 2: P and Q of a 1000 x 1000 matrix, plus a dense vector of 1000
    assert wire.fused_exchange("powersgd", 1_001_000, 2, [[1000, 1000], [1000]])[0] == \
        pytest.approx(4 * (2 * 2000 + 1000))
    assert wire.fused_exchange("powersgd:rank=1", 1_001_000, 2, [[1000, 1000], [1000]])[0] == \
        pytest.approx(4 * (2000 + 1000))
    assert wire.fused_exchange("topk", n, 1) == (0.0, 0)
    assert wire.fused_exchange("threshold:value=1", n, 2, sent_fraction=0.5)[0] == pytest.approx(8 * n / 2)


def test_wire_formulas_match_the_exchange_benchmarks_bytes():
    """docs/results/benchmarks.jsonl: 25M floats, density 0.01, P = 2..4, bytes counted by the engine."""
    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "results", "benchmarks.jsonl")
    if not os.path.exists(path):
        pytest.skip("no docs/results/benchmarks.jsonl")
    spec = {"allgather": "topk:density=0.01", "oktopk": "oktopk:density=0.01", "dsa": "topk:density=0.01,exchange=dsa"}
    checked = 0
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r.get("algorithm") in spec and r.get("n") and r.get("bytes_sent_per_rank_max"):
                got = wire.fused_exchange(spec[r["algorithm"]], r["n"], r["P"])[0]
                assert got == pytest.approx(r["bytes_sent_per_rank_max"], rel=0.05), r["algorithm"]
                checked += 1
    assert checked


def test_received_values_follow_the_exchange():
    n, p = 1_000_000, 4
    for spec in ("topk:density=0.01", "qsgd", "qsgd:method=allgather", "powersgd"):
        sent, _ = wire.fused_exchange(spec, n, p)
        received = wire.received_values(spec, n, sent)
        if spec.startswith("topk"):
            assert received == pytest.approx((p - 1) * 10_000)       # (P-1) k pairs
        elif spec == "qsgd":
            assert received == pytest.approx(2 * (p - 1) / p * n)   # reduce-scatter + allgather
        elif spec == "qsgd:method=allgather":
            assert received == pytest.approx((p - 1) * n)           # every other rank's code
        else:
            assert 0 < received < n
    assert wire.received_values("topk:density=0.01", 0, 0.0) == 0.0


def test_horovod_payloads():
    g = [Gradient("w", 0.0, 4000), Gradient("b", 0.0, 40)]
    assert wire.payload_bytes("dense", g) == [4000, 40]
    assert wire.payload_bytes("hvd-fp16", g) == [2000, 20]
    assert wire.payload_bytes("randomk:density=0.01", g) == [40, 4]   # at least one element
    assert wire.payload_bytes("topk", [Gradient("w", 0, 4 * 4096), Gradient("b", 0, 40)]) == [4, 40]
    assert wire.carrier("randomk") == "horovod" and wire.carrier("qsgd") == "out_of_band"
    assert wire.canonical("dense") == "none" == wire.canonical("hvd-none")
    assert wire.canonical("topk") == wire.canonical("topk:density=0.01")
    with pytest.raises(ValueError):
        wire.parse("nonesuch")


# ----------------------------------------------------------------------- traces
def test_bk_log_reader(tmp_path):
    t = read_bk_log(os.path.join(NETAI_DIR, "resnet50.bk.log"))
    events = ref.read_backward_log(os.path.join(NETAI_DIR, "resnet50.bk.log"))[0]
    assert [(g.wait_s, g.nbytes) for g in t.gradients] == [(w, s) for w, s in events]
    assert t.batch_time_s == ref.BATCH_TIME["resnet50"] and t.reduce and t.on_gpu
    bad = tmp_path / "bad.bk.log"
    bad.write_text("comment\n1\n3\n1,2\n")
    with pytest.raises(ValueError, match="expected 3"):
        read_bk_log(str(bad), batch_time_s=0.1)
    other = tmp_path / "mine.bk.log"
    other.write_text("comment\n1\n1\n5,8\n")
    with pytest.raises(ValueError, match="batch time"):
        read_bk_log(str(other))
    assert load(str(other), batch_time_s=0.2).batch_time_s == 0.2


def test_json_trace_round_trip(tmp_path):
    t = _trace(compressors={"topk:density=0.01": CodecCost(0.001, 0.05, "out_of_band", 0.0101)})
    t.reduce = [[4096, 1e-6], [1 << 20, 1e-4]]
    t.tail_s = 0.001
    path = tmp_path / "t.json"
    t.save(path)
    back = load(str(path))
    assert back.to_json() == t.to_json()
    assert back.backward_s == pytest.approx(0.031)
    (tmp_path / "x.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a horovod_sparse trace"):
        load(str(tmp_path / "x.json"))
    with pytest.raises(ValueError, match="no such"):
        load(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="unknown NetAI"):
        load("netai:alexnet")


def test_codec_lookup_by_canonical_spec():
    t = _trace(compressors={"topk:density=0.01": CodecCost(0.0, 0.1), "fp16": CodecCost(0.0, 0.2)})
    assert whatif_model.codec_for(t, "topk").decompress_s == 0.1
    assert whatif_model.codec_for(t, "hvd-fp16").decompress_s == 0.2
    assert whatif_model.codec_for(t, "qsgd") is None
    p = predict(t, Network.from_gbps(1), 2, compressor="qsgd")
    assert p.notes and "no codec cost" in p.notes[0]


# --------------------------------------------------------------- recommendations
def test_recommends_none_on_a_fast_network_and_compression_on_a_slow_one(netai_traces):
    rows = sweep(netai_traces["vgg16"], [16], gbps=[1, 100], ratios=[1, 2, 10], options=PAPER)
    recs = {r.gbps: r for r in recommend(rows)}
    assert recs[100.0].choice == "none"
    assert recs[1.0].choice == "x10" and recs[1.0].speedup > 2


def test_an_expensive_codec_is_not_recommended():
    t = _trace(compressors={"dense": CodecCost(), "qsgd": CodecCost(0.0, 10.0, "out_of_band")})
    rows = sweep(t, [8], gbps=[1], compressors=["dense", "qsgd"])
    (rec,) = recommend(rows)
    assert rec.choice == "none" and rec.best == "dense"
    assert [p.speedup for p in rows][0] == 1.0 and rows[1].speedup < 1


def test_sweep_adds_dense_for_speedups_without_listing_it():
    t = _trace(compressors={"hvd-fp16": CodecCost(0.0, 0.0, "horovod")})
    rows = sweep(t, [4], gbps=[1], compressors=["hvd-fp16"])
    assert [p.label for p in rows] == ["hvd-fp16"] and rows[0].speedup > 1
    row = rows[0].row()
    for key in ("compressor", "workers", "gbps", "overhead_s", "scaling", "step_s", "speedup"):
        assert key in row


# ------------------------------------------------------- scripts/validate_whatif.py
def _validate_script():
    from scripts_under_test import load_script
    return load_script("validate_whatif")


def test_validate_script_uses_a_trace_profiled_at_p_for_that_p(tmp_path):
    validate = _validate_script()
    _trace().save(tmp_path / "toy.json")
    at_4 = _trace()
    at_4.workers = 4
    at_4.save(tmp_path / "toy-p4.json")
    traces = validate.find_traces([str(tmp_path)])
    assert validate.trace_for(traces, "toy", 4).workers == 4
    assert validate.trace_for(traces, "toy", 2).workers == 1
    assert validate.trace_for(traces, "other", 2) is None


@pytest.mark.parametrize("slowdown", [1.0, 2.0])
def test_validate_script_reads_measured_steps_and_scores_the_picks(tmp_path, capsys, slowdown):
    validate = _validate_script()

    trace = _trace(device="cpu", compressors={"dense": CodecCost(0.0, 0.0, "horovod"),
                                              "hvd-fp16": CodecCost(0.004, 0.002, "horovod"),
                                              "topk:density=0.01": CodecCost(0.0, 0.03, "out_of_band")})
    (tmp_path / "traces").mkdir()
    trace.save(tmp_path / "traces" / "toy.json")
    net = Network(0.8e9, 50e-6)   # what the benchmarks below say
    bench = tmp_path / "bench.jsonl"
    bench.write_text(json.dumps({"algorithm": "dense", "rate": "1gbit", "P": 2, "bytes_sent_per_rank_max": 1e8,
                                 "median_s": 1e8 * 8 / 0.8e9}) + "\n")
    measured = tmp_path / "steps.jsonl"
    with open(measured, "w") as f:
        for spec_, factor in (("dense", 1.0), ("hvd-fp16", 1.1), ("topk:density=0.01", 0.9)):
            # the ranks compute `slowdown` x slower than the profile; dense's fwd+bwd says so
            p = predict(trace, net, 2, compressor=spec_, options=Options(latency=True, compute_scale=slowdown))
            f.write(json.dumps({"model": "toy", "np": 2, "link": "1gbit", "compressor": spec_,
                                "fwd_bwd_ms": trace.batch_time_s * slowdown * 1e3,
                                "step_ms": 1.0, "total_ms": p.step_s * 1e3 * factor, "error": None}) + "\n")
        f.write(json.dumps({"model": "other", "np": 2, "link": "1gbit", "compressor": "dense", "total_ms": 5.0}) + "\n")
    md, out = tmp_path / "v.md", tmp_path / "v.jsonl"
    assert validate.main(["--measured", str(measured), "--traces", str(tmp_path / "traces"), "--benchmarks", str(bench),
                          "--latency", "50e-6", "--md", str(md), "--out", str(out)]) == 0
    text = md.read_text()
    assert "no trace for other" in text and "Summary: 2 cases predicted (1 dense rows in-sample" in text
    assert "fastest picked in 1/1 groups" in text
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    errors = {r["compressor"]: r["error"] for r in rows if "compressor" in r}
    assert errors["dense"] == pytest.approx(0.0, abs=0.01)
    assert errors["hvd-fp16"] == pytest.approx(1 / 1.1 - 1, abs=0.02)
    assert errors["topk:density=0.01"] == pytest.approx(1 / 0.9 - 1, abs=0.02)

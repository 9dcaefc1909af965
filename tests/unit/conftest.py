import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # before any test imports TensorFlow
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# the tests exercise the compressed step from the first one; the warm-up's own tests ask for one
os.environ.setdefault("HOROVOD_SPARSE_WARMUP_STEPS", "0")

#: the modules that take longest (jobs launched for minutes, then the longest in one process), in the
#: order they start: run first, so that the other workers take the short ones meanwhile instead of
#: waiting at the end for one of these (scripts/run_tests.py turns off pytest-xdist's reordering by
#: number of tests, which put them last). The elastic jobs (3 workers and Horovod's driver, about
#: 165 s) first, and beside them on the other worker modules of one process each (about 170 s
#: together): beside the elastic jobs the schedule benchmark's compressor run took 136 s against 37 s
#: alone (its 2 ranks wait on each other on 2 shared cores). xdist gives the elastic worker its next
#: module, the schedule benchmark, while its jobs run, so that one starts after them.
LONGEST_FIRST = ("test_elastic_launch.py", "test_module_imports.py", "test_codecs.py", "test_bench_schedule.py",
                 "test_workloads.py", "test_imports.py", "test_cpu_kernels_quantize.py", "test_rangefloat.py",
                 "test_ranks_ending_apart.py", "test_overflow_in_band.py", "test_compare_bucket_k.py",
                 "test_bench_tta.py", "test_cli.py", "test_demo_output.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module's order kept

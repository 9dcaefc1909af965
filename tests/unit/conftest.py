import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # before any test imports TensorFlow
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# the tests exercise the compressed step from the first one; the warm-up's own tests ask for one
os.environ.setdefault("HOROVOD_SPARSE_WARMUP_STEPS", "0")

#: the modules that take longest (jobs launched for minutes), longest first: run first, so that
#: the other workers take the short ones meanwhile instead of waiting at the end for one of these
#: (scripts/run_tests.py turns off pytest-xdist's reordering by number of tests, which put them last)
LONGEST_FIRST = ("test_elastic_launch.py", "test_bench_schedule.py", "test_ranks_ending_apart.py",
                 "test_compare_bucket_k.py", "test_bench_tta.py", "test_cli.py", "test_demo_output.py",
                 "test_imports.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module's order kept

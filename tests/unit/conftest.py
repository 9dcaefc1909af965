import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # before any test imports TensorFlow
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# the tests exercise the compressed step from the first one; the warm-up's own tests ask for one
os.environ.setdefault("HOROVOD_SPARSE_WARMUP_STEPS", "0")

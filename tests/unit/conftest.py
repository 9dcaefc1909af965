import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # before any test imports TensorFlow
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

"""Codes for float32 vectors on the wire (quantizers, range-based float) and the
pipelines that exchange them."""
from .codec import Float32Codec, ValueCodec, derive_seed

__all__ = ["Float32Codec", "ValueCodec", "derive_seed"]

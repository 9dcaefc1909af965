"""Codes for float32 vectors on the wire, and the pipeline that exchanges them.

Modules, in data-flow order: codec (the ValueCodec contract), bitpack (codes of 1..16
bits into bytes), codecs (bf16, QSGD, TernGrad, sign, scaled sign, 1-bit), rangefloat
(the FFT compressor's range-based float), pipeline (error feedback or momentum, then
the compressed allreduce of :mod:`horovod_sparse.exchange.compressed`).
"""
from .codec import Float32Codec, ValueCodec, derive_seed
from .codecs import BF16Codec, OneBitCodec, QSGDCodec, ScaledSignCodec, SignCodec, TernGradCodec
from .pipeline import QuantizedPipeline
from .rangefloat import RangeFloatCodec

__all__ = ["ValueCodec", "Float32Codec", "BF16Codec", "QSGDCodec", "TernGradCodec", "SignCodec",
           "ScaledSignCodec", "OneBitCodec", "RangeFloatCodec", "QuantizedPipeline", "derive_seed"]

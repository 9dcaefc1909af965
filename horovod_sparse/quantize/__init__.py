"""Codes for float32 vectors on the wire, and the pipeline that exchanges them.

Modules, in data-flow order: codec (the ValueCodec contract), uniform (counter-based
random numbers, the same in numpy and torch), sums (fixed-order float32 sums), bitpack
(codes of 1..16 bits into bytes), codecs (bf16, QSGD, TernGrad, sign, scaled sign,
1-bit), absmax (int4's nearest levels), rangefloat (the FFT compressor's range-based float), scratch (reused
temporaries), pipeline (error feedback or momentum, then the compressed allreduce of
:mod:`horovod_sparse.exchange.compressed`).
"""
from .absmax import Int4Codec
from .codec import Float32Codec, ValueCodec
from .codecs import BF16Codec, OneBitCodec, QSGDCodec, ScaledSignCodec, SignCodec, TernGradCodec
from .pipeline import QuantizedPipeline
from .rangefloat import RangeFloatCodec

__all__ = ["ValueCodec", "Float32Codec", "BF16Codec", "QSGDCodec", "TernGradCodec", "SignCodec",
           "ScaledSignCodec", "OneBitCodec", "Int4Codec", "RangeFloatCodec", "QuantizedPipeline"]

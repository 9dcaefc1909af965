"""The value codec: how a float32 vector becomes bytes on the wire and back.

Every quantizer (and the FFT compressor's range-based float) is a :class:`ValueCodec`.
The exchanges that carry codes (:mod:`horovod_sparse.exchange.compressed`, and the
sparse engine's ``value_codec``) only ever see ``encode``/``decode``/``nbytes``, so a
new code is one small class.

Contract, relied on by every exchange:

* ``encode(values, seed, out=None, decoded=None)`` takes a 1-D float32 array (numpy, or
  a torch tensor on any device) and returns a 1-D ``uint8`` array of exactly
  ``nbytes(values.size)`` bytes in the same library and device (written into ``out``
  if given). It is deterministic given ``(values, seed)``: stochastic codes draw from
  the counter-based stream of :mod:`.uniform`, identical in numpy and torch. With
  ``decoded`` (a float32 buffer of the same length) it also writes what ``decode``
  will give for that code, without unpacking it again.
* ``decode(data, count, out=None)`` returns ``count`` float32 values in ``data``'s
  library and device (a new array, or ``out``). It is a pure function of the bytes,
  so every rank decoding the same bytes gets bitwise the same floats, and numpy and
  torch decode the same bytes to the same floats.
* ``nbytes(count)`` depends only on ``count`` (and the codec's parameters), so a
  receiver can size its buffers without asking.
* ``aggregate`` says how decoded contributions combine: ``"sum"`` (the default), or
  ``"majority"`` (signSGD's vote: the result is P * sign(sum), sign(0) = +1; such a code
  keeps only signs, sign(0) = +1, so the code of a sum is the code of its vote).

Scratch buffers live in the codec (:mod:`.scratch`): one codec instance serves one
pipeline, one call at a time.

TensorFlow tensors (a step run as TensorFlow ops on the gradients' device) are immutable:
``encode``/``decode`` return new tensors (``out`` is not written), and
:meth:`ValueCodec.encode_decoded` returns the code with its decoded floats. The kernels
branch on TensorFlow inside (each returns its result), so a code is written once and
gives the numpy path's bytes and floats.
"""
import sys

import numpy as np

from horovod_sparse.ops import cpu, namespace, views

from .scratch import Scratch

VALUE_DTYPE = np.float32


def as_values(values):
    """``values`` as a contiguous 1-D float32 array: a torch tensor stays on its device,
    anything else becomes numpy (copied only if needed)."""
    if namespace.is_torch(values):
        import torch
        return values.detach().reshape(-1).to(torch.float32).contiguous()
    if namespace.is_tensorflow(values):
        tf = sys.modules["tensorflow"]
        return tf.reshape(tf.cast(values, tf.float32), [-1])
    return np.ascontiguousarray(np.asarray(values).ravel(), dtype=VALUE_DTYPE)


def as_bytes(data):
    """``data`` as a 1-D uint8 array (a torch tensor stays a tensor)."""
    if namespace.is_torch(data):
        return data.reshape(-1)
    if namespace.is_tensorflow(data):
        return sys.modules["tensorflow"].reshape(data, [-1])
    return np.ascontiguousarray(data, dtype=np.uint8).ravel()


class ValueCodec:
    """Base class: a code for 1-D float32 vectors. See the module docstring."""

    name = "abstract"
    #: True if ``encode`` draws random numbers (stochastic rounding)
    stochastic = False
    #: "sum" or "majority"
    aggregate = "sum"
    #: the compressed allreduce cuts its chunks at multiples of this many values
    #: (:mod:`horovod_sparse.exchange.compressed`)
    chunk_unit = 1

    #: True where :meth:`_encode_fused` / :meth:`_decode_fused` run compiled kernels
    #: (:mod:`horovod_sparse.ops.cpu.quantize`) on CPU arrays
    fused_cpu = False

    def encode(self, values, seed=0, out=None, decoded=None, residual=None):
        """See the module docstring. ``residual`` (a float32 buffer like ``decoded``, which may
        be ``values`` itself) also gets ``values - decoded`` in float32: error feedback's next
        residual, written in the same pass where the kernels run (numpy, CPU tensors)."""
        x = as_values(values)
        if namespace.is_tensorflow(x):  # a new tensor (``out`` and ``decoded`` not written)
            return self._encode(x, seed, None, None)[0]
        out = self._code_buffer(out, x.shape[0], x)
        with np.errstate(all="ignore"):  # overflow, NaN, 0/0: documented per code, never a warning
            args = (_kernel(x), seed, _kernel(out), _optional(decoded))
            arrays = (args[0], args[2], args[3], _optional(residual))
            if not (_fusable(self, *arrays) and self._encode_fused(*args, arrays[3])):
                if residual is not None and decoded is None:  # the floats the residual is made of
                    args = args[:3] + (_kernel(namespace.new_empty(x.shape[0], "float32", x)),)
                self._encode(*args)
                if residual is not None:
                    namespace.backend(_kernel(residual)).subtract(args[0], args[3], out=_kernel(residual))
        return out

    def encode_decoded(self, values, seed=0, out=None, decoded=None):
        """``(code, floats)``: :meth:`encode` and what :meth:`decode` gives for that code, written
        into ``out`` and ``decoded`` (numpy, torch: allocated when None), or new tensors
        (TensorFlow: the buffers are not used)."""
        x = as_values(values)
        if namespace.is_tensorflow(x):
            return self._encode(x, seed, None, True)
        if decoded is None:
            decoded = namespace.new_empty(x.shape[0], "float32", x)
        return self.encode(x, seed, out=out, decoded=decoded), decoded

    def decode(self, data, count, out=None):
        data = as_bytes(data)
        if namespace.is_tensorflow(data):
            return self._decode(data, count, None)
        out = self._value_buffer(out, count, data)
        with np.errstate(all="ignore"):
            args = (_kernel(data), count, _kernel(out))
            if not (_fusable(self, args[0], args[2]) and self._decode_fused(*args)):
                self._decode(*args)
        return out

    #: True where :meth:`_decode_sum_fused` has compiled kernels
    sums_codes_fused = False

    def sums_two_codes(self, like):
        """Whether :meth:`decode_sum_of_two` runs compiled kernels over both codes for arrays
        like ``like`` (so a caller need not keep either side's decoded floats)."""
        return self.sums_codes_fused and _fusable(self, _kernel(like))

    def decode_sum_of_two(self, first, second, count, out=None):
        """``out = decode(first) + decode(second)`` in float32, that order (``count`` values
        each; numpy or torch ``out``). In one compiled pass where :meth:`sums_two_codes` (the
        1-bit codes), else two decodes and an add."""
        first, second = as_bytes(first), as_bytes(second)
        out = self._value_buffer(out, count, first)
        if not (self.sums_codes_fused and _fusable(self, _kernel(first), _kernel(second), _kernel(out))
                and self._decode_sum_fused(_kernel(first), _kernel(second), count, _kernel(out))):
            spare = namespace.new_empty(count, "float32", first)
            self.decode(first, count, out=out)
            namespace.backend(_kernel(out)).add(_kernel(out), _kernel(self.decode(second, count, out=spare)),
                                                out=_kernel(out))
        return out

    def _decode_sum_fused(self, first, second, count, out):
        """:meth:`decode_sum_of_two` by compiled kernels (only where :attr:`sums_codes_fused`);
        False where it does not apply."""
        return False

    def _encode_fused(self, x, seed, out, decoded, residual):
        """:meth:`_encode` (and ``residual = x - decoded``) by compiled kernels on numpy arrays;
        returns False where it does not apply (the numpy code then runs)."""
        return False

    def _decode_fused(self, data, count, out):
        """:meth:`_decode` by compiled kernels on numpy arrays; False where it does not apply."""
        return False

    def _encode(self, x, seed, out, decoded):
        """encode into ``out`` (and ``decoded``): arrays of one library and device, numpy for
        anything on the CPU (see :func:`_kernel`). Returns ``(code, decoded)``: on TensorFlow
        new tensors (``out`` is None; ``decoded`` True asks for the floats, None not)."""
        raise NotImplementedError

    def _decode(self, data, count, out):
        """decode into ``out`` (``count`` floats), arrays as for :meth:`_encode`; returns the
        floats (TensorFlow: a new tensor, ``out`` is None)."""
        raise NotImplementedError

    def nbytes(self, count):
        raise NotImplementedError

    def roundtrip(self, values, seed=0):
        """``decode(encode(values, seed))``: what a receiver would see."""
        values = as_values(values)
        return self.decode(self.encode(values, seed), values.shape[0])

    @property
    def scratch(self):
        """This codec's reusable temporaries (created on first use, never pickled)."""
        if "_scratch" not in self.__dict__:
            self.__dict__["_scratch"] = Scratch()
        return self.__dict__["_scratch"]

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_scratch"}

    def _code_buffer(self, out, count, like):
        """``out`` checked, or a new uint8 buffer of ``nbytes(count)`` like ``like``."""
        size = self.nbytes(count)
        if out is None:
            return namespace.new_empty(size, "uint8", like)
        if out.shape[0] != size:
            raise ValueError(f"out holds {out.shape[0]} bytes, the code of {count} values has {size}")
        return out

    @staticmethod
    def _value_buffer(out, count, like):
        return namespace.new_empty(count, "float32", like) if out is None else out[:count]

    def __repr__(self):
        return f"{type(self).__name__}()"


def _optional(x):
    return None if x is None else _kernel(x)


def _fusable(codec, *arrays):
    """Whether ``codec`` runs its compiled kernels on these arrays: it has them, they are on,
    and every array given is numpy (a CPU tensor's view; CUDA keeps torch's ops)."""
    return codec.fused_cpu and cpu.enabled() and all(a is None or isinstance(a, np.ndarray) for a in arrays)


def _kernel(x):
    """What a code computes on: a zero-copy numpy view of a CPU tensor (numpy's one-thread
    kernels beat torch's here: no per-call overhead, vectorised casts, shifts and compares;
    IEEE float32 and integer arithmetic, so the same bits), else ``x`` itself."""
    return views.kernel_view(x)


class Float32Codec(ValueCodec):
    """No compression: the float32 bytes themselves (4 bytes per value)."""

    name = "float32"

    def encode(self, values, seed=0, out=None, decoded=None):
        x = as_values(values)
        if namespace.is_tensorflow(x):
            return self._encode(x, seed, None, None)[0]
        out = self._code_buffer(out, x.shape[0], x)
        out[...] = x.view(namespace.dtype_of(x, "uint8"))
        if decoded is not None:
            decoded[...] = x
        return out

    def _encode(self, x, seed, out, decoded):
        """TensorFlow only: the float32 bytes, and the values themselves."""
        tf = sys.modules["tensorflow"]
        return tf.reshape(tf.bitcast(x, tf.uint8), [-1]), x

    def decode(self, data, count, out=None):
        data = as_bytes(data)
        if namespace.is_tensorflow(data):
            tf = sys.modules["tensorflow"]
            return tf.bitcast(tf.reshape(data[:4 * count], [count, 4]), tf.float32)
        out = self._value_buffer(out, count, data)
        out.view(namespace.dtype_of(out, "uint8"))[...] = data[:4 * count]
        return out

    def nbytes(self, count):
        return 4 * int(count)

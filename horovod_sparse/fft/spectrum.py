"""The chunked real spectrum of a gradient buffer, as a flat float32 vector.

A buffer of ``n`` elements is cut into chunks of ``chunk_size`` consecutive elements;
the last chunk is shorter when ``chunk_size`` does not divide ``n`` and is transformed
at its own length (no padding, so no coefficient describes elements that do not
exist). Each chunk of length L has L // 2 + 1 complex coefficients (rfft, norm="ortho");
coefficient j of the whole buffer (chunks in order) is stored at float positions 2j
(real part) and 2j + 1 (imaginary part). The sparse exchange's index space is thus
[0, 2 * n_coefficients).

The transforms run in float32, in the buffer's own library: ``numpy.fft`` (pocketfft) for
numpy and, through zero-copy views, CPU tensors; ``torch.fft`` elsewhere (cuFFT on a GPU).
All full chunks go through one batched call on a ``(chunks, chunk_size)`` view, written
into preallocated buffers (``out=``): nothing of size n is allocated.

TensorFlow tensors (the step as TensorFlow ops on the gradient's device) go through
``tf.signal.rfft`` / ``irfft`` (unnormalized, scaled here to "ortho"), the same batched
chunks; tensors are immutable, so each method returns a new tensor and ignores ``out``.
Those transforms are not pocketfft's bit for bit (a different float32 FFT: the results
agree to float32 FFT rounding, a relative L2 error of ~1e-7); everything after them
(keys, selection, positions) is the same integer logic.

"ortho" makes each chunk's transform orthonormal up to the Hermitian symmetry
(Parseval): ``sum(x**2) == sum(weight * |X|**2)`` with weight 1 for the DC and (even
L) Nyquist coefficients and 2 for the others, whose negative-frequency twins are
implied; ``weight * |X|**2`` is the energy a coefficient carries into the signal, and
what :meth:`ChunkedSpectrum.energy_keys` ranks.
"""
import math
import sys

import numpy as np

from horovod_sparse.ops import cpu, kernels, magnitude, namespace, views
from horovod_sparse.ops.cpu import spectrum as cpu_spectrum
from horovod_sparse.ops.indices import take

#: coefficients per block when the energies are computed (the squares stay in cache)
_ENERGY_BLOCK = 1 << 16


class ChunkedSpectrum:
    """Forward/inverse chunked rfft of buffers of length ``n`` (see the module docstring).

    n : int >= 0, buffer length (elements).
    chunk_size : int >= 2, elements per transformed chunk.
    """

    def __init__(self, n, chunk_size):
        self.n, self.chunk_size = int(n), int(chunk_size)
        self.full_chunks = self.n // self.chunk_size
        self.tail = self.n - self.full_chunks * self.chunk_size      # 0 or the short last chunk
        self.full_coefficients = self.chunk_size // 2 + 1
        self.tail_coefficients = self.tail // 2 + 1 if self.tail else 0
        self.n_coefficients = self.full_chunks * self.full_coefficients + self.tail_coefficients
        self.size = 2 * self.n_coefficients                           # floats in the index space

    def _parts(self, signal, spectrum):
        """(signal part, complex spectrum part, length) of the full chunks and of the tail."""
        split = self.full_chunks * self.chunk_size
        split_c = 2 * self.full_chunks * self.full_coefficients
        parts = []
        if self.full_chunks:
            parts.append((signal[:split].reshape(self.full_chunks, self.chunk_size),
                          views.complex_view(spectrum[:split_c]).reshape(self.full_chunks, -1),
                          self.chunk_size))
        if self.tail:
            parts.append((signal[split:], views.complex_view(spectrum[split_c:]), self.tail))
        return parts

    def forward(self, x, out):
        """Write the float32 spectrum (length ``size``, re/im interleaved) of the float32
        buffer ``x`` into ``out`` (same library and device); return ``out`` (TensorFlow: a
        new tensor)."""
        if namespace.is_tensorflow(x):
            return _tf_concat([_tf_rfft(signal, length) for signal, length in self._tf_parts(x, 1)], x)
        fft = namespace.backend(x).fft
        for signal, coefficients, _ in self._parts(x, out):
            fft.rfft(signal, None, -1, "ortho", out=coefficients)
        return out

    def inverse(self, spectrum, out):
        """Write the float32 buffer (length ``n``) of ``spectrum`` (length ``size``) into
        ``out``; return it (TensorFlow: a new tensor). The imaginary parts of DC and Nyquist
        coefficients are ignored (irfft's convention; TensorFlow's on the CPU too, and the
        forward transform makes them exactly 0, so they code to 0 whatever a device does)."""
        if namespace.is_tensorflow(spectrum):
            return _tf_concat([_tf_irfft(part, length) for part, length in self._tf_parts(spectrum, 2)],
                              spectrum)
        fft = namespace.backend(spectrum).fft
        for signal, coefficients, length in self._parts(out, spectrum):
            fft.irfft(coefficients, length, -1, "ortho", out=signal)
        return out

    def _tf_parts(self, x, floats):
        """TensorFlow: (part, chunk length) of the full chunks, shaped (chunks, chunk_size) for a
        signal (``floats=1``) or (chunks, coefficients, 2) for a spectrum (``floats=2``), and of
        the tail (one chunk)."""
        tf = sys.modules["tensorflow"]
        per_chunk = (self.chunk_size, self.full_coefficients)[floats - 1]
        split = self.full_chunks * per_chunk * floats
        shape = [-1, per_chunk] if floats == 1 else [-1, per_chunk, 2]
        parts = [(tf.reshape(x[:split], shape), self.chunk_size)] if self.full_chunks else []
        if self.tail:
            tail = (self.tail, self.tail_coefficients)[floats - 1]
            parts.append((tf.reshape(x[split:], [1, tail] if floats == 1 else [1, tail, 2]), self.tail))
        return parts

    def scatter(self, positions, values, out):
        """The spectrum that is ``values`` at the sorted unique ``positions`` and zero elsewhere,
        written into ``out`` (float32, length ``size``) and returned (TensorFlow: a new tensor)."""
        if namespace.is_tensorflow(values):
            tf = sys.modules["tensorflow"]
            return tf.scatter_nd(positions[:, None], values, [self.size])
        out[...] = 0
        kernels.put(out, positions, values)
        return out

    def energy_keys(self, spectrum, out, scratch, block=_ENERGY_BLOCK):
        """int32 keys, ordered like every coefficient's energy ``weight * |X|**2``, written
        into ``out`` (a float32 buffer of ``n_coefficients``, reinterpreted; returned as its
        int32 view). ``scratch``: float32, at least ``2 * min(n_coefficients, block)``;
        ``block`` coefficients are squared at a time (on CPU the squares stay in cache).

        Computed in float32 as (re*re + im*im), halved for DC and Nyquist: scaling by a
        power of two ranks like the weights 1 and 2 do, and cannot overflow. The keys are
        the float bits (:func:`~horovod_sparse.ops.magnitude.magnitude_keys`): exact integer
        comparisons, NaN above everything. numpy buffers with the compiled kernels enabled:
        :func:`horovod_sparse.ops.cpu.spectrum.energy_keys`, one pass, the same keys. TensorFlow: the same float32 operations, on new
        tensors (``out``, ``scratch`` and ``block`` unused).
        """
        if namespace.is_tensorflow(spectrum):
            tf = sys.modules["tensorflow"]
            pairs = tf.reshape(spectrum, [-1, 2])
            energies, full = pairs[:, 0] * pairs[:, 0] + pairs[:, 1] * pairs[:, 1], []
            split = self.full_chunks * self.full_coefficients
            if self.full_chunks:  # weights 1, with 0.5 at the edges: exact, like _halve_edges
                full.append(tf.reshape(tf.reshape(energies[:split], [self.full_chunks, -1])
                                       * _edge_weights(self.chunk_size), [-1]))
            if self.tail:
                full.append(energies[split:] * _edge_weights(self.tail))
            return magnitude.magnitude_keys(_tf_concat(full, spectrum))
        if cpu.enabled() and isinstance(spectrum, np.ndarray):  # one pass, the same keys
            cpu_spectrum.energy_keys(spectrum, out, self.full_chunks, self.chunk_size, self.tail)
            return views.int_view(out)
        lib = namespace.backend(spectrum)
        pairs = spectrum.reshape(-1, 2)
        for start in range(0, self.n_coefficients, block):
            stop = min(start + block, self.n_coefficients)
            squares = scratch[:2 * (stop - start)].reshape(-1, 2)
            lib.multiply(pairs[start:stop], pairs[start:stop], out=squares)
            lib.add(squares[:, 0], squares[:, 1], out=out[start:stop])
        full = self.full_chunks * self.full_coefficients
        if self.full_chunks:
            _halve_edges(out[:full].reshape(self.full_chunks, -1), self.chunk_size)
        if self.tail:
            _halve_edges(out[full:].reshape(1, -1), self.tail)
        return magnitude.magnitude_keys(out, out=views.int_view(out))


def _halve_edges(energies, length):
    """Halve the DC (and, for even ``length``, Nyquist) column of (chunks, coefficients)."""
    energies[:, 0] *= 0.5
    if length % 2 == 0:
        energies[:, -1] *= 0.5


def _edge_weights(length):
    """float32 ones of a chunk's coefficient count, 0.5 at DC (and, for even ``length``, Nyquist)."""
    weights = np.ones(length // 2 + 1, np.float32)
    weights[0] = 0.5
    if length % 2 == 0:
        weights[-1] = 0.5
    return sys.modules["tensorflow"].constant(weights)


def _tf_rfft(signal, length):
    """float32 "ortho" spectra, re/im interleaved and flat, of the (chunks, length) signal."""
    tf = sys.modules["tensorflow"]
    coefficients = tf.signal.rfft(signal, fft_length=[length])
    return tf.reshape(tf.bitcast(coefficients, tf.float32), [-1]) * np.float32(1 / math.sqrt(length))


def _tf_irfft(spectrum, length):
    """The flat float32 signal of (chunks, coefficients, 2) "ortho" spectra of chunks of ``length``
    (TensorFlow's irfft divides by ``length``, "ortho" by its square root)."""
    tf = sys.modules["tensorflow"]
    signal = tf.signal.irfft(tf.bitcast(spectrum, tf.complex64), fft_length=[length])
    return tf.reshape(signal, [-1]) * np.float32(math.sqrt(length))


def _tf_concat(parts, like):
    """The flat float32 parts back to back (none: an empty tensor on ``like``'s device)."""
    if not parts:
        return namespace.zeros(0, "float32", like)
    return parts[0] if len(parts) == 1 else sys.modules["tensorflow"].concat(parts, axis=0)


def coefficient_values(spectrum, coefficients):
    """The (re, im) floats of the int64 ``coefficients`` of ``spectrum``, flat, in their order."""
    if namespace.is_tensorflow(spectrum):
        tf = sys.modules["tensorflow"]
        return tf.reshape(tf.gather(tf.reshape(spectrum, [-1, 2]), coefficients), [-1])
    return take(spectrum.reshape(-1, 2), coefficients).reshape(-1)


def coefficient_positions(coefficients, out):
    """Float positions (2j, 2j + 1) of sorted int64 coefficients j, written into the int64
    buffer ``out`` (twice as long, same library); returns it, sorted (TensorFlow: a new tensor)."""
    if namespace.is_tensorflow(coefficients):
        tf = sys.modules["tensorflow"]
        return tf.reshape(tf.stack([coefficients * 2, coefficients * 2 + 1], axis=1), [-1])
    pairs = out.reshape(-1, 2)
    lib = namespace.backend(out)
    lib.multiply(coefficients, 2, out=pairs[:, 0])
    lib.add(pairs[:, 0], 1, out=pairs[:, 1])
    return out

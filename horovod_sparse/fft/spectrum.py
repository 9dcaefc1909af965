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

"ortho" makes each chunk's transform orthonormal up to the Hermitian symmetry
(Parseval): ``sum(x**2) == sum(weight * |X|**2)`` with weight 1 for the DC and (even
L) Nyquist coefficients and 2 for the others, whose negative-frequency twins are
implied; ``weight * |X|**2`` is the energy a coefficient carries into the signal, and
what :meth:`ChunkedSpectrum.energy_keys` ranks.
"""
from horovod_sparse.ops import magnitude, namespace, views

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
        buffer ``x`` into ``out`` (same library and device); return ``out``."""
        fft = namespace.backend(x).fft
        for signal, coefficients, _ in self._parts(x, out):
            fft.rfft(signal, None, -1, "ortho", out=coefficients)
        return out

    def inverse(self, spectrum, out):
        """Write the float32 buffer (length ``n``) of ``spectrum`` (length ``size``) into
        ``out``; return it. The imaginary parts of DC and Nyquist coefficients are
        ignored (irfft's convention)."""
        fft = namespace.backend(spectrum).fft
        for signal, coefficients, length in self._parts(out, spectrum):
            fft.irfft(coefficients, length, -1, "ortho", out=signal)
        return out

    def energy_keys(self, spectrum, out, scratch, block=_ENERGY_BLOCK):
        """int32 keys, ordered like every coefficient's energy ``weight * |X|**2``, written
        into ``out`` (a float32 buffer of ``n_coefficients``, reinterpreted; returned as its
        int32 view). ``scratch``: float32, at least ``2 * min(n_coefficients, block)``;
        ``block`` coefficients are squared at a time (on CPU the squares stay in cache).

        Computed in float32 as (re*re + im*im), halved for DC and Nyquist: scaling by a
        power of two ranks like the weights 1 and 2 do, and cannot overflow. The keys are
        the float bits (:func:`~horovod_sparse.ops.magnitude.magnitude_keys`): exact integer
        comparisons, NaN above everything.
        """
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


def coefficient_positions(coefficients, out):
    """Float positions (2j, 2j + 1) of sorted int64 coefficients j, written into the int64
    buffer ``out`` (twice as long, same library); returns it, sorted."""
    pairs = out.reshape(-1, 2)
    lib = namespace.backend(out)
    lib.multiply(coefficients, 2, out=pairs[:, 0])
    lib.add(pairs[:, 0], 1, out=pairs[:, 1])
    return out

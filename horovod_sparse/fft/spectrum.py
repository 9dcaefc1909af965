"""The chunked real spectrum of a gradient buffer, as a flat float32 vector.

A buffer of ``n`` elements is cut into chunks of ``chunk_size`` consecutive elements;
the last chunk is shorter when ``chunk_size`` does not divide ``n`` and is transformed
at its own length (no padding, so no coefficient describes elements that do not
exist). Each chunk of length L has L // 2 + 1 complex coefficients
(``np.fft.rfft(chunk, norm="ortho")``); coefficient j of the whole buffer (chunks in
order) is stored at float positions 2j (real part) and 2j + 1 (imaginary part). The
sparse exchange's index space is thus [0, 2 * n_coefficients).

The transforms run in float64 and the spectrum / signal are rounded to float32.
"ortho" makes each chunk's transform orthonormal up to the Hermitian symmetry
(Parseval): ``sum(x**2) == sum(weight * |X|**2)`` with weight 1 for the DC and (even
L) Nyquist coefficients and 2 for the others, whose negative-frequency twins are
implied; ``weight * |X|**2`` is the energy a coefficient carries into the signal.
"""
import numpy as np

VALUE_DTYPE = np.float32


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
        self.weights = np.concatenate([np.tile(_weights(self.chunk_size), self.full_chunks),
                                       _weights(self.tail) if self.tail else np.empty(0)])

    def forward(self, x):
        """float32 spectrum of length ``size`` (re, im interleaved) of the buffer ``x``."""
        x = np.asarray(x, dtype=np.float64)
        split = self.full_chunks * self.chunk_size
        parts = []
        if self.full_chunks:
            parts.append(np.fft.rfft(x[:split].reshape(self.full_chunks, self.chunk_size),
                                     axis=1, norm="ortho").ravel())
        if self.tail:
            parts.append(np.fft.rfft(x[split:], norm="ortho"))
        coefficients = np.concatenate(parts) if parts else np.empty(0, np.complex128)
        return coefficients.astype(np.complex64).view(VALUE_DTYPE)

    def inverse(self, spectrum):
        """float32 buffer of length ``n`` from a spectrum of length ``size``. The imaginary
        parts of DC and Nyquist coefficients are ignored (irfft's convention)."""
        spectrum = np.ascontiguousarray(spectrum, dtype=VALUE_DTYPE)
        coefficients = spectrum.view(np.complex64).astype(np.complex128)
        split = self.full_chunks * self.full_coefficients
        parts = []
        if self.full_chunks:
            parts.append(np.fft.irfft(coefficients[:split].reshape(self.full_chunks, -1),
                                      n=self.chunk_size, axis=1, norm="ortho").ravel())
        if self.tail:
            parts.append(np.fft.irfft(coefficients[split:], n=self.tail, norm="ortho"))
        out = np.concatenate(parts) if parts else np.empty(0)
        return out.astype(VALUE_DTYPE)

    def energies(self, spectrum):
        """float64 energy ``weight * |X|**2`` of every coefficient (Parseval share)."""
        s = np.asarray(spectrum, dtype=np.float64)
        return self.weights * (s[0::2] ** 2 + s[1::2] ** 2)


def _weights(length):
    """Parseval weights of the rfft coefficients of a chunk of ``length``."""
    w = np.full(length // 2 + 1, 2.0)
    w[0] = 1.0
    if length % 2 == 0:
        w[-1] = 1.0
    return w


def top_coefficients(energies, kept):
    """Sorted int64 positions of the ``kept`` largest ``energies`` (ties: lower position
    first; NaN counts as largest, so a broken gradient is sent rather than hidden).

    O(size): one partition for the threshold, then the ties at the threshold by position.
    """
    count = energies.size
    if kept >= count:
        return np.arange(count, dtype=np.int64)
    if kept <= 0:
        return np.empty(0, np.int64)
    e = np.where(np.isnan(energies), np.inf, energies)
    threshold = np.partition(e, count - kept)[count - kept]
    above = e > threshold
    ties = np.flatnonzero(e == threshold)[:kept - int(above.sum())]
    above[ties] = True
    return np.flatnonzero(above).astype(np.int64)


def coefficient_positions(coefficients):
    """Float positions (2j, 2j + 1) of sorted coefficients j, sorted int64."""
    positions = np.empty(2 * coefficients.size, np.int64)
    positions[0::2] = 2 * coefficients
    positions[1::2] = 2 * coefficients + 1
    return positions

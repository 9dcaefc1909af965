"""The FFT pipeline's energy keys, fused into one pass over the spectrum.

What it replaces (numpy, :meth:`horovod_sparse.fft.spectrum.ChunkedSpectrum.energy_keys`):
per block of coefficients ``squares = pairs * pairs`` and ``energies = squares[:, 0] +
squares[:, 1]``, then a pass halving every chunk's DC (and, for an even chunk, Nyquist)
energy, then ``magnitude_keys`` (the float bits with the sign cleared) over all keys. Here
each coefficient is read once and its key written once.

The transforms stay pocketfft (``numpy.fft``): a compiled FFT would round differently.

Bits: per coefficient the same float32 operations in the same order (``re*re + im*im``,
then ``* 0.5`` at the edges; no fast-math, no FMA contraction), and the sign is cleared by
``abs`` (it only clears the sign bit, a NaN's payload kept), so the keys are numpy's.

Example::

    energy_keys(spectrum, energies, full_chunks, chunk_size, tail)
    keys = energies.view(np.int32)   # ordered like the coefficients' energies
"""
import numpy as np

from horovod_sparse.ops.cpu import inlined, jit


@inlined
def _chunk_energies(spectrum, energies, first, count, even):
    """Energies of ``count`` coefficients from coefficient ``first`` (one chunk): DC halved,
    and the last one (Nyquist) when ``even``; non-negative (``abs``: the key's cleared sign)."""
    half = np.float32(0.5)
    for j in range(count):
        re = spectrum[2 * (first + j)]
        im = spectrum[2 * (first + j) + 1]
        energies[first + j] = abs(re * re + im * im)
    energies[first] = abs((spectrum[2 * first] * spectrum[2 * first]
                           + spectrum[2 * first + 1] * spectrum[2 * first + 1]) * half)
    if even and count > 1:
        last = first + count - 1
        energies[last] = abs((spectrum[2 * last] * spectrum[2 * last]
                              + spectrum[2 * last + 1] * spectrum[2 * last + 1]) * half)


@jit
def energy_keys(spectrum, energies, full_chunks, chunk_size, tail):
    """Every coefficient's weighted energy into ``energies`` (float32, n_coefficients; its int32
    view is the keys): ``full_chunks`` chunks of ``chunk_size`` elements then a chunk of ``tail``
    (0: none). Replaces the numpy loop of ``ChunkedSpectrum.energy_keys``, its halving of the
    edges and its ``magnitude_keys``."""
    per_chunk = chunk_size // 2 + 1
    for c in range(full_chunks):
        _chunk_energies(spectrum, energies, c * per_chunk, per_chunk, chunk_size % 2 == 0)
    if tail > 0:
        _chunk_energies(spectrum, energies, full_chunks * per_chunk, tail // 2 + 1, tail % 2 == 0)

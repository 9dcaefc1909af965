"""FFT-based gradient sparsification (Wang et al., HPDC'20): the chunked real spectrum
(:mod:`.spectrum`), the exact top-k of its energies (:mod:`.selection`) and the per-buffer
pipeline (:mod:`.pipeline`) behind the ``fft`` compressor, on the gradient's own device."""
from .pipeline import FFTSparsifier, FFTStepInfo
from .spectrum import ChunkedSpectrum

__all__ = ["FFTSparsifier", "FFTStepInfo", "ChunkedSpectrum"]

"""FFT-based gradient sparsification (Wang et al., HPDC'20): the chunked real spectrum
(:mod:`.spectrum`) and the per-buffer pipeline (:mod:`.pipeline`) behind the ``fft``
compressor."""
from .pipeline import FFTSparsifier, FFTStepInfo
from .spectrum import ChunkedSpectrum

__all__ = ["FFTSparsifier", "FFTStepInfo", "ChunkedSpectrum"]

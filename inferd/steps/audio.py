"""`audio_mfcc`: WAV bytes -> MFCC features, computed with numpy/scipy.

    - {type: audio_mfcc, input: audio, output: mfcc, sample_rate: 16000, n_mfcc: 13,
       n_fft: 512, hop_length: 160, n_mels: 40, frames: 101}

audio BYTES [n] or [n, 1] (RIFF WAV: 8/16/24/32-bit PCM or float) -> FP32 [n, n_mfcc, frames].
Multi-channel audio is averaged to mono. A file at another sample rate is resampled
(polyphase, scipy.signal.resample_poly) when `resample: true`, else refused with a 400.
`frames` fixes the frame count (zero-padded or cut: what a fixed-input model needs); without it
the rows of one request are zero-padded to that request's longest clip.

The features are librosa's `feature.mfcc` with the same parameters (center=True with zero
padding, periodic Hann window, power spectrum, Slaney mel filters, power_to_db with ref=1,
amin=1e-10, top_db=80, orthonormal DCT-II), which tests check. librosa itself is not used at
run time: it compiles its kernels with numba on first use (over 10 s on a fresh install), a
stall the first audio request would pay.
"""

from __future__ import annotations

import io
import math
from functools import lru_cache

import numpy as np
import scipy.fft
import scipy.signal
from pydantic import Field, model_validator
from scipy.io import wavfile

from inferd.errors import InvalidRequestError
from inferd.steps.base import StepContext, StepOptions


class AudioMfccOptions(StepOptions):
    input: str = "audio"
    output: str = "mfcc"
    sample_rate: int = Field(default=16000, gt=0)
    resample: bool = True  # false: a WAV at another rate is refused
    n_mfcc: int = Field(default=13, gt=0)
    n_fft: int = Field(default=512, gt=1)
    hop_length: int = Field(default=160, gt=0)
    n_mels: int = Field(default=40, gt=0)
    fmin: float = Field(default=0.0, ge=0.0)
    fmax: float | None = Field(default=None, gt=0.0)  # None: sample_rate / 2
    top_db: float | None = Field(default=80.0, gt=0.0)
    frames: int | None = Field(default=None, gt=0)
    max_seconds: float = Field(default=60.0, gt=0.0)  # longer clips are refused (400)

    @model_validator(mode="after")
    def _check(self) -> AudioMfccOptions:
        if self.n_mfcc > self.n_mels:
            raise ValueError(f"n_mfcc ({self.n_mfcc}) must be <= n_mels ({self.n_mels})")
        nyquist = self.sample_rate / 2
        if (self.fmax or nyquist) > nyquist or self.fmin >= (self.fmax or nyquist):
            raise ValueError(f"need fmin < fmax <= sample_rate / 2 ({nyquist})")
        return self


class AudioMfccStep:
    def __init__(self, options: AudioMfccOptions, ctx: StepContext) -> None:
        self.stage: str = ctx.stage
        self.ctx = ctx
        self.options = options
        o = options
        self._mel = mel_filterbank(o.sample_rate, o.n_fft, o.n_mels, o.fmin, o.fmax)

    def __call__(self, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        name = self.options.input
        rows = self.ctx.take_rows(tensors, name, "WAV file")
        features = [self.features(item) for item in rows]
        out = {k: v for k, v in tensors.items() if k != name}
        out[self.options.output] = self._stack(features)
        return out

    def features(self, item: object) -> np.ndarray:
        """One WAV file -> MFCC [n_mfcc, frames] float32."""
        o = self.options
        if not isinstance(item, bytes | bytearray | np.bytes_):
            raise InvalidRequestError(f"input {o.input!r}: expected BYTES (WAV files)", o.input)
        signal = self._signal(bytes(item))
        return mfcc(signal, self._mel, o.n_mfcc, o.n_fft, o.hop_length, o.top_db)

    def _signal(self, blob: bytes) -> np.ndarray:
        o = self.options
        rate, samples = read_wav(blob, o.input)
        if samples.shape[0] > o.max_seconds * rate:
            raise InvalidRequestError(
                f"input {o.input!r}: clip is {samples.shape[0] / rate:.1f} s, over the "
                f"{o.max_seconds:g} s limit",
                o.input,
            )
        if rate == o.sample_rate:
            return samples
        if not o.resample:
            raise InvalidRequestError(
                f"input {o.input!r}: sample rate {rate} Hz; this model takes {o.sample_rate} Hz",
                o.input,
            )
        g = math.gcd(rate, o.sample_rate)
        return scipy.signal.resample_poly(samples, o.sample_rate // g, rate // g).astype(np.float32)

    def _stack(self, features: list[np.ndarray]) -> np.ndarray:
        frames = self.options.frames or max((f.shape[1] for f in features), default=0)
        out = np.zeros((len(features), self.options.n_mfcc, frames), dtype=np.float32)
        for row, f in enumerate(features):
            width = min(frames, f.shape[1])
            out[row, :, :width] = f[:, :width]
        return out


def read_wav(blob: bytes, name: str = "audio") -> tuple[int, np.ndarray]:
    """(sample rate, mono float32 samples in [-1, 1])."""
    try:
        rate, data = wavfile.read(io.BytesIO(blob))
    except Exception as e:  # scipy raises ValueError, struct.error, EOFError... on bad files
        raise InvalidRequestError(f"input {name!r}: not a readable WAV file: {e}", name) from e
    if data.dtype == np.uint8:  # 8-bit PCM is unsigned, centred on 128
        samples = (data.astype(np.float32) - 128.0) / 128.0
    elif data.dtype.kind == "i":  # 16/32-bit PCM; scipy left-justifies 24-bit into int32
        samples = data.astype(np.float32) / float(2 ** (8 * data.dtype.itemsize - 1))
    else:
        samples = data.astype(np.float32)
    if samples.ndim == 2:  # [samples, channels] -> mono
        samples = samples.mean(axis=1)
    if samples.size == 0:
        raise InvalidRequestError(f"input {name!r}: the WAV file has no samples", name)
    return int(rate), samples


# -- MFCC (librosa-compatible) -------------------------------------------------------------------


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    # Slaney's auditory-toolbox scale: linear below 1 kHz, logarithmic above.
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    hz = np.asarray(hz, dtype=np.float64)
    mel = hz / f_sp
    high = hz >= min_log_hz
    mel[high] = min_log_mel + np.log(hz[high] / min_log_hz) / logstep
    return mel


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, logstep = min_log_hz / f_sp, math.log(6.4) / 27.0
    hz = f_sp * mel
    high = mel >= min_log_mel
    hz[high] = min_log_hz * np.exp(logstep * (mel[high] - min_log_mel))
    return hz


@lru_cache(maxsize=16)
def mel_filterbank(
    sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0, fmax: float | None = None
) -> np.ndarray:
    """Slaney-normalized triangular filters [n_mels, 1 + n_fft // 2] (librosa.filters.mel)."""
    fmax = sample_rate / 2 if fmax is None else fmax
    fft_freqs = np.linspace(0.0, sample_rate / 2, 1 + n_fft // 2)
    mel_min, mel_max = _hz_to_mel(np.array([fmin, fmax]))
    edges = _mel_to_hz(np.linspace(float(mel_min), float(mel_max), n_mels + 2))
    widths = np.diff(edges)
    ramps = edges[:, None] - fft_freqs[None, :]
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]  # equal area per filter
    out = weights.astype(np.float32)
    out.setflags(write=False)  # shared through the cache
    return out


def power_spectrogram(signal: np.ndarray, n_fft: int, hop_length: int) -> np.ndarray:
    """|STFT|^2 [1 + n_fft // 2, frames], frames centred (zero padding of n_fft // 2)."""
    padded = np.pad(signal.astype(np.float32), n_fft // 2)
    if padded.shape[0] < n_fft:
        padded = np.pad(padded, (0, n_fft - padded.shape[0]))
    frames = np.lib.stride_tricks.sliding_window_view(padded, n_fft)[::hop_length]
    window = scipy.signal.get_window("hann", n_fft, fftbins=True).astype(np.float32)
    spectrum = scipy.fft.rfft(frames * window, axis=-1)  # [frames, bins]
    return (np.abs(spectrum) ** 2).T


def mfcc(
    signal: np.ndarray,
    mel: np.ndarray,
    n_mfcc: int,
    n_fft: int,
    hop_length: int,
    top_db: float | None = 80.0,
) -> np.ndarray:
    """MFCC [n_mfcc, frames] float32 of a mono signal, given mel filters from mel_filterbank."""
    mel_power = mel @ power_spectrogram(signal, n_fft, hop_length)  # [n_mels, frames]
    db = 10.0 * np.log10(np.maximum(mel_power, 1e-10))
    if top_db is not None:
        db = np.maximum(db, db.max() - top_db)
    return scipy.fft.dct(db, type=2, axis=0, norm="ortho")[:n_mfcc].astype(np.float32)

"""From sampled ids to what the caller sees: detokenization and stop strings."""

from inferd.postprocess.detokenizer import IncrementalDetokenizer
from inferd.postprocess.stop_checker import StopChecker, StopResult
from inferd.postprocess.text_stream import TextDelta, TextStream

__all__ = ["IncrementalDetokenizer", "StopChecker", "StopResult", "TextDelta", "TextStream"]

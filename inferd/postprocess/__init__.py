"""The stages after the engine: the LLM lane's, from sampled ids to what the caller sees
(incremental detokenization, stop strings, the text stream), and the image lane's image encode
(pixels to PNG, JPEG or WebP: image_encode.py).

(Classic-model postprocessing steps — softmax, pooling, NMS, labels — live in inferd/steps/.)
"""

from inferd.postprocess.detokenizer import IncrementalDetokenizer
from inferd.postprocess.stop_checker import StopChecker, StopResult
from inferd.postprocess.text_stream import TextDelta, TextStream

__all__ = ["IncrementalDetokenizer", "StopChecker", "StopResult", "TextDelta", "TextStream"]

"""Classic-model pre- and postprocessing steps (tokenize, image, MFCC, softmax, pooling, NMS,
classification labels), run per request around the dynamic batcher.

base.py: the Step protocol, StepOptions, StepContext. registry.py: build_steps, the factory
(the only importer of the step modules). One module per step family.
"""

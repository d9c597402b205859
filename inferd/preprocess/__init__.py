"""The LLM lane's text stages before the engine: the tokenizer and chat templates.

(Classic-model preprocessing steps — tokenize, image, audio — live in inferd/steps/.)
"""

from inferd.preprocess.tokenizer import NoChatTemplateError, Tokenizer, load_generation_config

__all__ = ["NoChatTemplateError", "Tokenizer", "load_generation_config"]

"""Turning requests into token ids: the tokenizer and chat templates."""

from inferd.preprocess.tokenizer import NoChatTemplateError, Tokenizer, load_generation_config

__all__ = ["NoChatTemplateError", "Tokenizer", "load_generation_config"]

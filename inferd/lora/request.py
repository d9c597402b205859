"""What a request names to run under a LoRA adapter: vLLM's `LoRARequest`.

    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))

`lora_name` is the adapter's identity everywhere: the OpenAI `model` field, the prefix cache's
key and the router's block hashes. `lora_int_id` is kept for vLLM compatibility (any positive
integer); `lora_path` is a PEFT folder (adapter_config.json + adapter_model.safetensors). Pure
Python: the gateway builds these.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str
    # The base model the adapter was trained on, as /v1/models reports it (None: the served one).
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")

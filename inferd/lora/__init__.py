"""LoRA adapters over one base model, many of them in one batch (S-LoRA, Punica).

request.py: LoRARequest, what a request names (pure Python: the gateway builds it).
adapter.py: a PEFT folder read and checked against the model, packed per linear layer.
layer.py: the batched low-rank term each linear layer adds to its own rows (the slots).
manager.py: adapters known, loaded (host memory, LRU) and resident in slots for a step.
"""

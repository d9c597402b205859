"""The paged KV cache's bookkeeping: the block manager, the prefix cache and its stable block hash
(pure Python; the K/V tensors themselves live in the model runner)."""

"""The LLM engine: the step loop (llm_engine.py), the offline API (llm.py), the engine core process
(core_proc.py) and, in the API server, its client (core_client.py), streams and AsyncLLM."""

"""The model repository: building a served model from a folder (builder, the one place that
assembles backends + batching + steps) and the index of loaded models and versions
(manager.ModelRepository). The config.yaml schema it reads is inferd/model_config.py.

Nothing is re-exported here: import `inferd.repository.manager` directly (it pulls in the
backends and the batching pipeline, which a reader of the schema alone should not pay for).
"""

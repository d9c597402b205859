"""The model repository: config.yaml schema (config), building a served model from a folder
(builder), and the index of loaded models and versions (manager.ModelRepository).

Nothing is re-exported here on purpose: the batching pipeline imports
`inferd.repository.config`, and the manager imports the pipeline, so importing the manager from
this package's __init__ would make that a cycle. Import `inferd.repository.manager` directly.
"""

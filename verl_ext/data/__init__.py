"""Data: loaders and built-in benchmarks (:mod:`.datasets`), prompt templates (:mod:`.templates`),
verl parquet writer (``python -m verl_ext.data.prepare``) and the toy addition task (:mod:`.toy`).
Importing this package imports nothing heavy."""

"""Data: every source (files, image folders, loader scripts, arrays, readers) as validated
batches for a model's inputs.

- :mod:`.request` — :class:`DataRequest`, one data role as a record (import-light).
- :mod:`.source` — :func:`open_data` → :class:`DataSource` of :class:`Batch` es.
- :mod:`.readers`, :mod:`.images`, :mod:`.feeds`, :mod:`.labels` — reading and checking.
- :mod:`.sample` — the bundled sample model and its data.
"""

"""Triton kernels, each beside the torch reference twin that its tests compare against.

* ``kv_write``: the K/V write of ``do_kv_cache_update`` (twin: ``metadata.writer.write_kv_reference``).
* ``quoka_score``: QuoKA page scores (twin: ``selectors.quoka.score_pages``).

Import the modules directly; each needs ``triton`` (CUDA tensors, or CPU tensors under
``TRITON_INTERPRET=1``).
"""

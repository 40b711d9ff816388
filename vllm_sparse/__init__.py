"""vllm-sparse: training-free sparse attention backends for vLLM."""

__version__ = "0.1.0"


def register() -> None:
    """The ``vllm.general_plugins`` entry point (see ``plugin.register``)."""
    from vllm_sparse.plugin import register as _register

    _register()

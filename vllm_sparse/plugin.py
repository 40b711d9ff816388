"""Registration with vLLM: backend names -> classes, spawn-safe pickling, the CPU platform hook.

``register()`` is the ``vllm.general_plugins`` entry point. vLLM calls it in every process
(front-end, engine core, workers), possibly several times: everything here is idempotent.
"""

from __future__ import annotations

import copyreg
import logging

BACKENDS = {
    "SPARSE_QUOKA": "vllm_sparse.backend.backends.SparseQuokaBackend",
    "SPARSE_QUEST": "vllm_sparse.backend.backends.SparseQuestBackend",
    "SPARSE_TWILIGHT": "vllm_sparse.backend.backends.SparseTwilightBackend",
    "SPARSE_KASCADE": "vllm_sparse.backend.backends.SparseKascadeBackend",
    "SPARSE_COMPACT": "vllm_sparse.backend.backends.SparseCompactBackend",
}

logger = logging.getLogger("vllm_sparse")


def _setup_logging() -> None:
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("(vllm-sparse pid=%(process)d) %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def _resolve_backend(name: str):
    """Unpickling target: registers the plugin in a freshly spawned process, then looks ``name`` up."""
    register()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[name]


def _reduce_backend_enum(member):
    """Pickle plugin-owned members by name (dynamic members cannot be unpickled by value)."""
    if member.name in BACKENDS:
        return _resolve_backend, (member.name,)
    return type(member), (member._value_,)


def _patch_cpu_platform() -> None:
    """vLLM's CPU platform ignores the chosen backend; make it honour ours (and validate it)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.get_attn_backend_cls.__func__
    if getattr(original, "_vllm_sparse", False):
        return

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        if selected_backend is not None and selected_backend.name in BACKENDS:
            backend_cls = selected_backend.get_class()
            reasons = backend_cls.validate_configuration(
                device_capability=None, **attn_selector_config._asdict()
            )
            if reasons:
                raise ValueError(
                    f"Selected backend {selected_backend.name} is not valid for this configuration. "
                    "Reasons:\n  - " + "\n  - ".join(reasons)
                )
            logger.info("vllm-sparse: using %s on CPU", selected_backend.name)
            return selected_backend.get_path()
        return original(cls, selected_backend, attn_selector_config, num_heads)

    get_attn_backend_cls._vllm_sparse = True
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)


def register() -> None:
    """Register every sparse backend name with vLLM (idempotent; runs in every process)."""
    _setup_logging()
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for name, path in BACKENDS.items():
        if name not in AttentionBackendEnum.__members__:
            register_backend(name, path)
    copyreg.pickle(AttentionBackendEnum, _reduce_backend_enum)
    _patch_cpu_platform()
    from vllm_sparse.kernels.jit_trace import install_if_asked

    install_if_asked()

"""One model of device activity for every backend a Kineto trace may come from (CUDA, ROCm/HIP,
MTIA, XPU, Enflame GCU, PrivateUse1 devices, ...), so that what is a device op, a runtime call
that launches one, or a synchronising call is decided in one place and the same way everywhere.

Why: Kineto names its activity types per backend (``libkineto::ActivityType``: ``kernel``,
``gpu_memcpy``, ``cuda_runtime``, ``mtia_ccp_events``, ``mtia_runtime``, ``xpu_runtime``,
``privateuse1_runtime``, ``hip_runtime`` in ROCm's builds, ...), and newer Kineto aliases them
(``MTIA_CCP_EVENTS = CONCURRENT_KERNEL``, ``MTIA_RUNTIME = RUNTIME``). Reading only CUDA's names
stored MTIA's device ops as ``other`` (so its ranks were analysed as host ranks) and ROCm's
``hipLaunchKernel`` as a non-launch (so its kernels had no launch). HTA reads the same fields:
a device op is an event on a stream, a launch one of the runtime calls it lists (CUDA's and
MTIA's ``runFunction - job_prep_and_submit_for_execution``), classified by name after that.

The stored vocabulary stays the schema's (``event.category``): ``kernel``, ``memcpy``,
``memset``, ``gpu_user_annotation``, ``cuda_sync`` on the device; ``cuda_runtime`` and
``cuda_driver`` are the host's runtime and driver calls *of any backend* (the names are CUDA's
for the stores and queries that already use them).
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "DEVICE_KERNEL_CATEGORIES",
    "DRIVER_CATEGORIES",
    "RUNTIME_CATEGORIES",
    "STREAM_WAIT_CALLS",
    "SYNC_CALLS",
    "category_sql",
]

# Trace categories (lower case) -> stored category. A backend's device op category whose name
# says nothing of its kind (``mtia_ccp_events``) is a kernel unless its name says it copies or
# sets memory (``Memcpy ...``, ``Memset``), as HTA's name rules read it.
DEVICE_KERNEL_CATEGORIES = ("kernel", "mtia_ccp_events", "concurrent_kernel")
"""Categories of device ops: kernels, or copies and sets when their name says so."""
_MEMCPY = ("gpu_memcpy", "memcpy", "gcu_memcpy")
_MEMSET = ("gpu_memset", "memset", "gcu_memset")
_DEVICE_ANNOTATION = ("gpu_user_annotation", "gcu_user_annotation")
_SYNC = ("cuda_sync", "gcu_sync")
RUNTIME_CATEGORIES = (
    "cuda_runtime",
    "runtime",
    "hip_runtime",
    "mtia_runtime",
    "xpu_runtime",
    "gcu_runtime",
    "privateuse1_runtime",
    "glow_runtime",
    "hpu_op",
)
"""Host runtime calls of any backend (stored as ``cuda_runtime``): they launch device ops,
linked by ``correlation``, or wait for them."""
DRIVER_CATEGORIES = (
    "cuda_driver",
    "driver",
    "hip_driver",
    "xpu_driver",
    "gcu_driver",
    "privateuse1_driver",
)
"""Host driver calls of any backend (stored as ``cuda_driver``)."""
_HOST = ("cpu_op", "user_annotation", "python_function")
_HOST_ALIASES = {"operator": "cpu_op"}


def _in(values: tuple[str, ...]) -> str:
    return "(" + ", ".join(f"'{v}'" for v in values) + ")"


def category_sql(cat: str, name: str, ph: str) -> str:
    """SQL for the stored category of a trace event (``event.category``).

    Args:
        cat: SQL of the event's ``cat``.
        name: SQL of its ``name`` (a device op of a backend-neutral category is a copy or a set
            by its name).
        ph: SQL of its phase (``i``/``I`` instants are ``instant``).
    """
    c = f"lower({cat})"
    aliases = " ".join(f"WHEN {c} = '{k}' THEN '{v}'" for k, v in _HOST_ALIASES.items())
    return f"""CASE
    WHEN {ph} IN ('i', 'I') THEN 'instant'
    WHEN {c} IN {_in(_HOST)} THEN {c}
    WHEN {c} IN {_in(DEVICE_KERNEL_CATEGORIES)} THEN
        CASE WHEN {c} <> 'kernel' AND starts_with({name}, 'Memcpy') THEN 'memcpy'
             WHEN {c} <> 'kernel' AND starts_with({name}, 'Memset') THEN 'memset'
             ELSE 'kernel' END
    WHEN {c} IN {_in(_MEMCPY)} THEN 'memcpy'
    WHEN {c} IN {_in(_MEMSET)} THEN 'memset'
    WHEN {c} IN {_in(_DEVICE_ANNOTATION)} THEN 'gpu_user_annotation'
    WHEN {c} IN {_in(_SYNC)} THEN 'cuda_sync'
    WHEN {c} IN {_in(RUNTIME_CATEGORIES)} THEN 'cuda_runtime'
    WHEN {c} IN {_in(DRIVER_CATEGORIES)} THEN 'cuda_driver'
    {aliases}
    ELSE 'other'
END"""


def _both(cuda: dict[str, Literal["device", "stream"]]) -> dict[str, Literal["device", "stream"]]:
    """CUDA's calls and HIP's of the same meaning (``cudaX`` -> ``hipX``, ``cuX`` -> ``hipX``)."""
    out = dict(cuda)
    for k, v in cuda.items():
        out["hip" + k.removeprefix("cuda").removeprefix("cu")] = v
    return out


SYNC_CALLS: dict[str, Literal["device", "stream"]] = _both(
    {
        "cudaDeviceSynchronize": "device",
        "cuCtxSynchronize": "device",
        "cudaStreamSynchronize": "stream",
        "cuStreamSynchronize": "stream",
        "cudaEventSynchronize": "stream",
        "cuEventSynchronize": "stream",
        "cudaMemcpy": "stream",
        "cudaMemcpy2D": "stream",
        "cudaMemcpy3D": "stream",
        "cudaMemcpyToSymbol": "stream",
        "cudaMemcpyFromSymbol": "stream",
    }
) | {"hipMemcpyWithStream": "stream"}
"""Synchronising runtime calls of CUDA and HIP (blocking copies included, ``*Async`` ones not)
and what they wait for: every stream of the device, or one stream."""

STREAM_WAIT_CALLS = ("cudaStreamWaitEvent", "cuStreamWaitEvent", "hipStreamWaitEvent")
"""Runtime calls that make a stream wait for an event recorded on another one."""

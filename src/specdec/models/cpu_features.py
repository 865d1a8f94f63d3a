"""What this CPU can run, and which of its paths oneDNN is allowed to take.

oneDNN (PyTorch's CPU matmul library) picks its kernels by instruction set:
AVX2, AVX-512, AVX512-BF16, AMX. The environment variable ONEDNN_MAX_CPU_ISA
caps that choice for the whole process, so one machine can run the paths
of older CPUs; specdec's tests use it to check each path users meet, and
the loader honours it (a cap below AVX-512 means no native bf16 packing).
"""

from __future__ import annotations

import os
import platform

import torch

# oneDNN's names for the caps, oldest first, with the /proc/cpuinfo flags each needs.
_AVX512_CORE = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
ISA_CAPS: dict[str, set[str]] = {
    "AVX2": {"avx2", "fma"},
    "AVX512_CORE": _AVX512_CORE,
    "AVX512_CORE_VNNI": _AVX512_CORE | {"avx512_vnni"},
    "AVX512_CORE_BF16": _AVX512_CORE | {"avx512_vnni", "avx512_bf16"},
    "AVX512_CORE_AMX": _AVX512_CORE | {"avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"},
}
CAP_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


def cpu_flags() -> set[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo); empty where unreadable."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def supported_isa_caps(flags: set[str] | None = None) -> list[str]:
    """The oneDNN caps this CPU can run, oldest first (each one a path some users' CPUs take)."""
    flags = cpu_flags() if flags is None else flags
    return [cap for cap, needed in ISA_CAPS.items() if needed <= flags]


def isa_cap_in_environment() -> str | None:
    """ONEDNN_MAX_CPU_ISA (or its older name) as set for this process; None if unset or not a cap we know."""
    for variable in CAP_VARIABLES:
        value = os.environ.get(variable, "").strip().upper()
        if value in ISA_CAPS:
            return value
    return None


def effective_isa() -> str | None:
    """The newest path oneDNN may take here: the CPU's best, lowered to the environment's cap.
    None where the flags cannot be read (not Linux/x86)."""
    supported = supported_isa_caps()
    if not supported:
        return None
    cap = isa_cap_in_environment()
    if cap is None:
        return supported[-1]
    names = list(ISA_CAPS)
    return names[min(names.index(cap), names.index(supported[-1]))]


def onednn_bf16_usable() -> bool:
    """Whether oneDNN runs bf16 matmuls at all (natively from AVX512-BF16, emulated on AVX-512)."""
    if not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return False
    isa = effective_isa()
    return isa is None or isa != "AVX2"


def int8_dot_exact() -> bool:
    """Whether oneDNN's u8 x s8 matmuls accumulate exactly in int32 here (VNNI or AMX).

    Without VNNI, oneDNN multiplies with vpmaddubsw, which adds pairs of u8 x s8
    products into a *saturating* int16: full-range int8 activations and weights
    overflow it (measured: errors of 10^5 on a 1536-long dot product under
    ONEDNN_MAX_CPU_ISA=AVX2 and AVX512_CORE, none from AVX512_CORE_VNNI up).
    AVX-VNNI on AVX2-only CPUs (avx_vnni) would do too, but no such CPU has been
    measured here, so it does not count yet.
    """
    return effective_isa() in ("AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX512_CORE_AMX")

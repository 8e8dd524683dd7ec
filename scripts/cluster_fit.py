"""How many thread-block clusters of flash-sm90's main build fit the GPU at once, by cluster size? The
driver's answer (cuOccupancyMaxActiveClusters) for the plain 64-row build at its own shared memory and
384 threads, cluster sizes 1-8 (the portable range). It decides whether the splits of one row tile could
merge through distributed shared memory in one wave: DeepSeek T65 P8k B1 is 17 row tiles of 7 splits
(docs/PERF.md, session 19). A measuring aid: nothing here is checked.

    python3 scripts/cluster_fit.py      (sm_90 GPU)
"""
import ctypes

from kdtr.kernels import registry as kernels
from kdtr.kernels.launch import CTYPES, device_info, function_ptr, load_function
from kdtr.kernels.pdl import LaunchConfig

CLUSTER_DIMENSION = 4
"""CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION (cuda.h)."""


class ClusterAttribute(ctypes.Structure):
    """CUlaunchAttribute with its value union read as clusterDim {x, y, z}."""

    _fields_ = [("id", ctypes.c_uint32), ("pad", ctypes.c_char * 4), ("x", ctypes.c_uint32), ("y", ctypes.c_uint32),
                ("z", ctypes.c_uint32), ("value_pad", ctypes.c_char * 52)]


kernel = kernels.resolve_kernel("flash-sm90")
v = kernel.variant
cfg = kernel.config()
threads, smem = v.launch_shape(cfg, 4)
fn = load_function(v.source, v.main.format(mt=4, out=CTYPES["bf16"], bug=0, merge=0, xr=0), arch=v.arch).function
fn.max_dynamic_shared_size_bytes = smem
lib = ctypes.CDLL("libcuda.so.1")
lib.cuOccupancyMaxActiveClusters.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_void_p]
sms = device_info()["sm_count"]
print(f"{sms} SMs, {threads} threads, {smem} B dynamic shared memory a CTA")
print("cluster size | clusters at once | CTAs at once")
for size in range(1, 9):
    attr = ClusterAttribute(id=CLUSTER_DIMENSION, x=1, y=size, z=1)
    # the grid only has to be a multiple of the cluster: one row tile's splits are one cluster along y
    config = LaunchConfig(1, size * 17, 1, threads, 1, 1, smem, None, None, 1)
    config.attrs = ctypes.cast(ctypes.pointer(attr), type(config.attrs))
    n = ctypes.c_int()
    rc = lib.cuOccupancyMaxActiveClusters(ctypes.byref(n), ctypes.c_void_p(function_ptr(fn)), ctypes.byref(config))
    print(f"{size:12d} | {n.value if rc == 0 else f'CUDA error {rc}':>16} | {n.value * size if rc == 0 else '':>12}")

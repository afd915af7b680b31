"""A CUFA_TRACE=1 build's stamp tables (bench/profile/tile_timeline.py, bwd_timeline.py): the
global table a kernel writes its stamps into, read back after one launch."""
import sys

import numpy as np


def device_table(variant, name, shape):
    """Kernel `variant`'s global array `name` (u64, `shape`) as a CuPy array, in place."""
    import cupy
    import torch
    from cufa import _compile
    fn, function = _compile.get_kernel(variant, torch.cuda.current_device())
    address = function.module.get_global_var(name)
    memory = cupy.cuda.UnownedMemory(address, int(np.prod(shape)) * 8, fn,
                                     torch.cuda.current_device())
    return cupy.ndarray(shape, dtype=cupy.uint64, memptr=cupy.cuda.MemoryPointer(memory, 0))


def traced_launch(launch, prefix, name, shape, stamped, what):
    """launch() once with the tables of every kernel compiled so far whose key starts with
    `prefix` zeroed; the launch's kernel is the one whose table `stamped` finds filled ->
    (its key, its table as a NumPy array). Exits naming `what` unless exactly one is."""
    import torch
    from cufa import _compile
    tables = {var.key: device_table(var, name, shape) for (_, var) in list(_compile._kernels)
              if var.key.startswith(prefix)}
    for table in tables.values():
        table.fill(0)
    torch.cuda.synchronize()
    launch()
    torch.cuda.synchronize()
    filled = [key for key, table in tables.items() if stamped(table)]
    if len(filled) != 1:
        sys.exit(f"expected one {what} launch, found {filled}")
    return filled[0], tables[filled[0]].get()

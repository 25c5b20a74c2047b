"""CUDA C++ kernels (``*.cu``, plain CUDA without torch headers) and their ctypes bindings.

``gpu.cuda.binding`` compiles the quantize and row-layout attention sources with nvcc on first use and
calls them on torch CUDA tensors; ``ptxas_report`` compile-checks them for Hopper (sm_90) without a
GPU. ``gpu.cuda.fragment_cache`` is the split-K decode kernel over a paged cache in the fragment layout
(``gpu.cuda.fragment``: where codes go; ``gpu.cuda.lookup``: the byte-permute lookups, in numpy),
built per configuration; ``gpu.cuda.static``/``gpu.cuda.sass`` read its sm_90a SASS (the instruction
budget gate), ``gpu.cuda.roofline`` models its time, ``gpu.cuda.device_check`` compares ncu's counts.
All of it also runs on CPU tensors through the host emulation (``host_emu.h``).
"""

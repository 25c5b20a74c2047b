"""CUDA C++ kernels (``*.cu``, plain CUDA without torch headers) and their ctypes binding.

``gpu.cuda.binding`` compiles the sources with nvcc on first use and calls them on torch CUDA
tensors; ``ptxas_report`` compile-checks them for Hopper (sm_90) without a GPU.
"""

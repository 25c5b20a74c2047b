"""GPU runtime: Triton and CUDA kernels that read the exported tables and match kvq_ref.

Kernels own no math: codebooks come from table files (``gpu.tables``), rotations from
``kvq_ref.rotations``, and every kernel is tested against the kvq_ref spec (``tests/gpu``).
"""

"""Real-model evaluation of the kvq_ref methods (SmolLM2-135M, Gemma-3-270M), offline on CPU.

A top-level package so that ``kvq_ref`` stays the dependency-light specification: ``kvq_eval``
imports ``kvq_ref`` and ``codebooks``, never the other way round (``tests/kvq_eval/test_layout.py``).
Needs the ``eval`` extra (transformers, gguf, accelerate) and the model wheels (installed by the
Makefile set-up).
"""

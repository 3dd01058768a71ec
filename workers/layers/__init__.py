"""Model building blocks: tensor-parallel layers, RoPE, attention and its kernels, KV cache.

The bottom of the stack: nothing here imports from the rest of the project."""

"""INT4 weights (GPTQ and AWQ checkpoints, and the layouts decode repacks them into): the
typed weight (`Int4Weight`), the torch reference, the Triton GEMV / GEMM / MMA kernels;
`dispatch` is what the engine calls."""

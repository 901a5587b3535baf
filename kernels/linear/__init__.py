"""Linear layers: the bf16 GEMV, the 1-byte (int8 / fp8) GEMV and GEMM, per-token fp8
quantization, and the add + RMS norm epilogue shared by the batch-1 GEMVs; `dispatch` is what
the engine calls."""

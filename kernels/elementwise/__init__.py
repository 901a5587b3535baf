"""The small steps between a layer's GEMVs: fused add + RMS norm, rotary embedding,
SiLU-and-mul; `dispatch` is what the engine calls."""

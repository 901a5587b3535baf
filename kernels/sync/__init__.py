"""What the decode chain's kernels share to coordinate: programmatic dependent launch (PDL)
and device-resident semaphores for split-K reductions."""

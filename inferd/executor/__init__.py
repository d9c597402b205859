"""The model runner: batch preparation, the forward pass and sampling on the device, CUDA graphs;
the only code that places tensors on a device."""
